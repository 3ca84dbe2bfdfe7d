"""The OpenAI scenarios of test_openai_server.py through the real sglang-router in PD mode, in
front of our prefill + decode pair on the scripted checkpoint.

The scenarios left out depend on what sglang-router does not forward (docs/PROTOCOL.md): its own
model list, /v1/responses (501 in PD mode), continuous_usage_stats, completions prompts given as
token ids, and /generate's logit_bias and stop_regex; the errors scenario expects our status
codes where the router answers its own.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.test_openai_server import (
    WORKER_FLAGS,
    make_peer,
    scenario_completion_batch_echo,
    scenario_forced_string_enum,
    scenario_id,
    scenario_n_and_logprobs,
    scenario_reasoning_split,
    scenario_response_format,
    scenario_stop,
    scenario_streamed_tool_call,
    scenario_tool_call_round_trip,
    scenario_tool_choice,
)

pytest.importorskip("sglang_router")
pytest.importorskip("mooncake.engine")

SCENARIOS = [
    scenario_tool_call_round_trip,
    scenario_streamed_tool_call,
    scenario_reasoning_split,
    scenario_tool_choice,
    scenario_forced_string_enum,
    scenario_response_format,
    scenario_n_and_logprobs,
    scenario_stop,
    scenario_completion_batch_echo,
]


@pytest.fixture(scope="module")
def stack(scripted_ckpt: Path, tmp_path_factory: pytest.TempPathFactory):
    from tests.pd_pair import PDPair
    from tests.sglang_router_proc import SglangRouter

    logs = tmp_path_factory.mktemp("openai-sglang-router")
    pair = PDPair(scripted_ckpt, logs, prefill_flags=WORKER_FLAGS, decode_flags=WORKER_FLAGS)
    router = SglangRouter(pair, scripted_ckpt, logs)
    try:
        router.wait_serving()
        yield router, pair, scripted_ckpt
    finally:
        router.stop()
        pair.stop()


@pytest.mark.parametrize("scenario", SCENARIOS, ids=scenario_id)
def test_sglang_router_and_pd_pair(stack, scenario) -> None:
    router, pair, checkpoint = stack
    scenario(make_peer(router.url, checkpoint))
    pair.idle()
