"""The three set-ups the upstream ports run against, each started once for the package.

"single" is one worker; "pd" a prefill + decode pair behind our router; "sglang-router" the same
pair behind the real sglang-router (pip package) in PD mode. All run the scripted checkpoint
(tests/scripted_checkpoint.py) with the seed's `--reasoning-parser glm45 --tool-call-parser
glm47`, so every answer is known exactly.

A test that sglang-router cannot pass because of what it drops or refuses (docs/PROTOCOL.md)
carries `@pytest.mark.sglang_router_refuses(reason, **params)`: on that set-up (and, with params,
only for those parameter values) it becomes xfail(strict=True), so a router that starts to
forward the field turns the run red instead of passing silently.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.test_openai_server import WORKER_FLAGS, Peer, make_peer

SETUPS = ("single", "pd", "sglang-router")


def _missing(setup: str) -> str | None:
    """Why a set-up cannot run here, or None."""
    if setup == "single":
        return None
    if importlib.util.find_spec("mooncake") is None:
        return "the mooncake transfer engine is not installed"
    if setup == "sglang-router" and importlib.util.find_spec("sglang_router") is None:
        return "the sglang-router package is not installed"
    return None


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "sglang_router_refuses(reason, **params): xfail(strict=True) on the sglang-router set-up",
    )


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "target" in metafunc.fixturenames:
        ids = [f"setup_{s.split('-')[0]}" for s in SETUPS]  # setup_single, setup_pd, setup_sglang
        metafunc.parametrize("stack", SETUPS, ids=ids, indirect=True, scope="package")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        params = getattr(getattr(item, "callspec", None), "params", {})
        if params.get("stack") != "sglang-router":
            continue
        for mark in item.iter_markers("sglang_router_refuses"):
            if all(params.get(k) == v for k, v in mark.kwargs.items()):
                item.add_marker(pytest.mark.xfail(strict=True, reason=mark.args[0]))


@dataclass
class Target:
    """One set-up as a test sees it."""

    name: str
    url: str
    peer: Peer
    idle: Callable[[], object]


@pytest.fixture(scope="package")
def upstream_single(scripted_ckpt: Path, tmp_path_factory: pytest.TempPathFactory):
    from tests.server_proc import Server

    srv = Server(scripted_ckpt, *WORKER_FLAGS, log_dir=tmp_path_factory.mktemp("up-single"))
    yield srv
    assert srv.stop() == 0


@pytest.fixture(scope="package")
def upstream_pair(scripted_ckpt: Path, tmp_path_factory: pytest.TempPathFactory):
    """One PD pair, shared by our router and sglang-router (both may front it at once)."""
    from tests.pd_pair import PDPair

    logs = tmp_path_factory.mktemp("up-pd")
    pair = PDPair(scripted_ckpt, logs, prefill_flags=WORKER_FLAGS, decode_flags=WORKER_FLAGS)
    yield pair, logs
    pair.stop()


@pytest.fixture(scope="package")
def upstream_router(upstream_pair):
    from tests.router_proc import RouterProc

    pair, logs = upstream_pair
    router = RouterProc("--pd-disaggregation", "--prefill", pair.prefill.url,
                        str(pair.bootstrap_port), "--decode", pair.decode.url,
                        "--health-check-interval-secs", "0.2", "--health-success-threshold", "1",
                        log_dir=logs)  # fmt: skip
    try:
        router.wait_ready()
        yield router
    finally:
        code = router.stop()
    assert code == 0


@pytest.fixture(scope="package")
def upstream_sglang_router(upstream_pair, scripted_ckpt: Path):
    from tests.sglang_router_proc import SglangRouter

    pair, logs = upstream_pair
    router = SglangRouter(pair, scripted_ckpt, logs)
    try:
        router.wait_serving()
        yield router
    finally:
        router.stop()


@pytest.fixture(scope="package")
def stack(request: pytest.FixtureRequest, scripted_ckpt: Path) -> Target:
    setup = request.param
    if (why := _missing(setup)) is not None:
        pytest.skip(why)
    if setup == "single":
        srv = request.getfixturevalue("upstream_single")
        return Target(setup, srv.url, make_peer(srv.url, scripted_ckpt), srv.idle_pool)
    pair, _ = request.getfixturevalue("upstream_pair")
    name = "upstream_router" if setup == "pd" else "upstream_sglang_router"
    url = request.getfixturevalue(name).url
    return Target(setup, url, make_peer(url, scripted_ckpt), pair.idle)


@pytest.fixture
def target(stack: Target) -> Iterator[Target]:
    """The set-up under test; after each test no request may be left running."""
    yield stack
    stack.idle()
