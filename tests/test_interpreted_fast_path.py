"""The whole model's fast path on a CPU: every Triton kernel and fla-core's KDA kernels run under
Triton's interpreter (kernels.INTERPRETED), in the engine, against the torch path.

Each kernel has its own tests at tiny and real shapes; this holds their wiring (which kernel a
batch takes, the buffers between them, the pool rows they index) to the torch path's greedy
tokens, on the CPU suite's interpreter pass (`make test`), where until now only a GPU run did.
Float32 on the tiny checkpoint, short prompts: the interpreter runs a program at a time.
"""

from __future__ import annotations

import os

import pytest
import torch

import kernels
from serving.engine.build import build_engine
from serving.protocol import GenerateRequest
from serving.sampling_params import SamplingParams
from serving.server_args import ServerArgs
from tests.server_proc import eagle_flags
from tests.triton_interp import count_launches, patch_triton_interpreter

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
pytestmark = pytest.mark.skipif(not INTERPRET, reason="the fast path on CPU needs the interpreter")
if INTERPRET:
    patch_triton_interpreter()

# kernels each path must launch (the model's every layer kind, prefill and decode)
PREFILL_KERNELS = {"_conv_kernel", "_union_kernel", "_score_pools_kernel", "_mhc_post_kernel"}
DECODE_KERNELS = {
    "_kda_decode_layer_kernel",
    "_mla_split_kernel",
    "_mhc_boundary_kernel",
    "_swiglu_kernel",
    "_rms_norm_kernel",
}


# A decode step's launches by layer kind on the tiny model (KDA, DSA, DSA with the shared indexer,
# KDA; a dense MLP then 3 MoE), counted as bench.launch_count counts them (a Triton launch or a
# torch op that launches a CUDA kernel): issue 43 point 1's budget. A change that adds launches
# to the decode step changes these on purpose.
# mHC: 7 boundaries, the first collapse (2) and the last expansion (1).
DECODE_LAUNCHES = {"KDA": 6, "DSA": 14, "MoE": 9, "dense MLP": 3, "mHC": 10, "lm_head": 1,
                   "rest": 4}  # fmt: skip
# An EAGLE step's (1 draft step) two device programs, the draft's layer counted with the target's
# (bench.launch_count --eagle): the verify's 2 tokens per request take the decode kernels; its
# "rest" holds the KDA roll-back (one launch), the draft's norms (one launch each, its residual
# adds inside two), the chain, the stashes; the catch-up reuses the verify's batch geometry.
EAGLE_LAUNCHES = {"KDA": 6, "DSA": 21, "MoE": 12, "dense MLP": 3, "mHC": 10, "lm_head": 2,
                  "rest": 29}  # fmt: skip


def _run(ckpt, fast: bool, flags: tuple[str, ...], monkeypatch, launches_of: list | None = None):
    """Greedy tokens of two requests, and the Triton kernels launched (by name); launches_of
    receives bench.launch_count's summary of the second decode step (with EAGLE: of the second
    EAGLE step's two device programs)."""
    from bench.launch_count import counting, counting_eagle, summary

    launches = count_launches(monkeypatch)
    monkeypatch.setattr(kernels, "INTERPRETED", fast)
    args = ServerArgs.from_cli(
        [
            *("--model-path", str(ckpt), "--device", "cpu", "--dtype", "float32"),
            *("--page-size", "16", "--max-total-tokens", "1024", "--skip-server-warmup"),
            *flags,
        ]
    )
    sched = build_engine(args)[0]
    gen = torch.Generator().manual_seed(3)
    for i, n in enumerate((5, 11)):
        prompt = torch.randint(0, 1000, (n,), generator=gen).tolist()
        params = SamplingParams(max_new_tokens=3, temperature=0.0, ignore_eos=True)
        sched.add(GenerateRequest(f"r{i}", prompt, params))
    out: dict[str, list[int]] = {}
    eagle = sched.spec is not None
    counted = counting_eagle(sched.spec, 2) if eagle else counting(sched.runner.model, step=2)
    with counted as counter:
        while sched.has_work:
            for o in sched.step():
                out.setdefault(o.rid, []).extend(o.new_token_ids)
    if launches_of is not None:
        launches_of.append(summary(counter, sched.runner.model.config))
    sched.check_invariants()
    sched.refresh_stats()
    assert sched.stats.used_rows == 0, sched.stats
    return out, launches


@pytest.fixture(scope="module")
def torch_tokens(tiny_ckpt):
    with pytest.MonkeyPatch.context() as mp:
        tokens, launches = _run(tiny_ckpt, False, (), mp)
    assert not launches, launches  # the torch path launches no Triton kernel
    return tokens


def test_fast_path_greedy_equals_torch_path(tiny_ckpt, torch_tokens, monkeypatch):
    step = []
    tokens, launches = _run(tiny_ckpt, True, (), monkeypatch, step)
    assert (PREFILL_KERNELS | DECODE_KERNELS) <= set(launches), launches
    assert tokens == torch_tokens
    by_kind = {k: v["triton"] + v["torch"] for k, v in step[0]["by_kind"].items()}
    assert by_kind == DECODE_LAUNCHES, step[0]["kernels"]


def test_fast_path_eagle_equals_torch_path(tiny_ckpt, torch_tokens, monkeypatch):
    """EAGLE (1 draft step): the draft and the 2-token verify through the decode kernels (the
    verify's KDA core is kda_decode_layer over both tokens, recording the roll-back history; the
    roll-back of every KDA layer one launch)."""
    step = []
    tokens, launches = _run(tiny_ckpt, True, tuple(eagle_flags(1)), monkeypatch, step)
    assert DECODE_KERNELS | {"_kda_roll_back_kernel"} <= set(launches), launches
    assert tokens == torch_tokens
    by_kind = {k: v["triton"] + v["torch"] for k, v in step[0]["by_kind"].items()}
    assert by_kind == EAGLE_LAUNCHES, step[0]["kernels"]
