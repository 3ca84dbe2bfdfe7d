"""The OpenAI scenarios of test_openai_server.py against router + PD pair: our router in front of
a prefill and a decode worker (Mooncake over loopback TCP), both started as the seed starts
them, with `--reasoning-parser glm45 --tool-call-parser glm47`, on the scripted checkpoint."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.test_openai_server import SCENARIOS, WORKER_FLAGS, make_peer, scenario_id


@pytest.fixture(scope="module")
def stack(scripted_ckpt: Path, tmp_path_factory: pytest.TempPathFactory):
    from tests.pd_pair import PDPair
    from tests.router_proc import RouterProc

    logs = tmp_path_factory.mktemp("openai-pd")
    pair = PDPair(scripted_ckpt, logs, prefill_flags=WORKER_FLAGS, decode_flags=WORKER_FLAGS)
    try:
        router = RouterProc(
            "--pd-disaggregation",
            "--prefill",
            pair.prefill.url,
            str(pair.bootstrap_port),
            "--decode",
            pair.decode.url,
            "--health-check-interval-secs",
            "0.2",
            "--health-success-threshold",
            "1",
            log_dir=logs,
        )
    except Exception:
        pair.stop()
        raise
    try:
        router.wait_ready()
        yield router, pair
    finally:
        code = router.stop()
        pair.stop()
    assert code == 0


@pytest.mark.parametrize("scenario", SCENARIOS, ids=scenario_id)
def test_router_and_pd_pair(stack, scripted_ckpt: Path, scenario) -> None:
    router, pair = stack
    scenario(make_peer(router.url, scripted_ckpt))
    pair.idle()
