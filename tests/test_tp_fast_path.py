"""The sharded fast path against one rank: TP2, EP2 and TP2+EP2 on the shipped small model
(serving/assets/small_model) in bfloat16, each compared with TP1 computed in the same run.

On CUDA (marked gpu) both rank processes share GPU 0 and talk over gloo (init_parallel's test
mode: NCCL refuses two ranks on one device; gloo stages CUDA tensors through pinned host memory
for all_reduce, all_gather and broadcast, the only tensor collectives the forward issues). So
the Triton and fla kernels run at their per-rank head counts (2 KDA and MLA heads of 4, all 4
indexer heads: the indexer is replicated;
8 routed experts of 16 with EP, all 16 at intermediate 32 with TP2 alone) and their partial
sums meet in the all-reduce.
The same body runs on the CPU (the torch references), which is also where it was calibrated.

What is compared (tests/tp_ranks.greedy_run): the prefill's last-token logits of three held-out
prompts in one ragged batch (one past index_topk + index_kpool, so the indexer selects), then 6
decode steps fed the reference's greedy tokens (every layout sees the same context).
- Logits: relative Frobenius error ||ours - ref|| / ||ref|| per step at most LOGITS_TOL.
  bfloat16 keeps 8 significant bits; a sharded layer rounds each rank's partial output to bf16
  before the all-reduce adds them (one rounding more, in another order), and the difference
  compounds over 8 layers and the mHC streams. On the CPU (`pytest -s -m "not gpu"` on this file,
  2026-12-01) the three layouts sit 0.009-0.045 from TP1, about TP1's own distance in bf16 from
  float32 (tp1_vs_fp32, 0.009-0.038): sharding adds no more than bf16 does. 0.1 is twice the
  largest; a wrong shard sits at 0.24-0.91.
- Greedy tokens: each of ours must be one the reference ranks near the top, its reference
  logit within NEAR_TIE of the reference's best. The small model's top-2 margins are often
  below 0.2 logits, so equal argmaxes cannot be demanded where bf16 moves the reference's top
  two logits by up to 0.69 (top2_drift, CPU): a flip needs a margin under twice that. A wrong
  shard's top logits move by 0.9-14.6.
With -s each layout prints these figures, rank 0's seconds per layout and TP1's (whose first
call compiles the kernels on a cold Triton cache).
"""

from __future__ import annotations

import json

import pytest
import torch

from tests.tp_ranks import LAYOUTS, SMALL_MODEL, WRONG_SHARDS, layout_name, run_layouts

LOGITS_TOL = 0.1
NEAR_TIE = 2.0  # logits: above twice the largest top-2 drift measured (0.69)


@pytest.fixture(
    scope="module",
    params=[
        "cpu",
        pytest.param(
            "cuda",
            marks=[
                pytest.mark.gpu,
                pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
            ],
        ),
    ],
)
def runs(request, tmp_path_factory):
    """{layout name: tests/tp_ranks.greedy_run's result}, "tp1" the reference."""
    out = tmp_path_factory.mktemp(f"layouts_{request.param}") / "runs.pt"
    run_layouts(SMALL_MODEL, request.param, out, timeout=300.0)
    return torch.load(out)


def _steps(run: dict) -> list[torch.Tensor]:
    return [run["prefill"], *run["decode"]]


def compare(ours: dict, ref: dict) -> tuple[list[str], list[str], dict]:
    """(steps whose logits break LOGITS_TOL, greedy tokens that break NEAR_TIE, a summary)."""
    logits, tokens, rel, top2, equal, total = [], [], [], [], 0, 0
    assert ours["fed"] == ref["fed"]
    for step, (a, b) in enumerate(zip(_steps(ours), _steps(ref), strict=True)):
        assert a.shape == b.shape, (a.shape, b.shape)
        err = ((a - b).norm() / b.norm()).item()
        rel.append(round(err, 4))
        best2 = b.topk(2, -1).indices  # how far the reference's top two logits moved
        top2.append(round((a.gather(-1, best2) - b.gather(-1, best2)).abs().max().item(), 3))
        if not err <= LOGITS_TOL:
            logits.append(f"step {step}: logits {err:.3f} from TP1's (bound {LOGITS_TOL})")
        picked = a.argmax(-1)
        deficit = b.max(-1).values - b.gather(-1, picked[:, None])[:, 0]
        equal += int((picked == b.argmax(-1)).sum())
        total += picked.numel()
        for i, d in enumerate(deficit.tolist()):
            if d > NEAR_TIE:
                tokens.append(
                    f"step {step}, prompt {i}: greedy token {int(picked[i])} is {d:.2f} logits "
                    f"under TP1's best {int(b[i].argmax())} (near-tie bound {NEAR_TIE})"
                )
    summary = {"rel_frobenius": rel, "top2_drift": top2, "greedy_equal": f"{equal}/{total}"}
    summary["rank0_s"] = ours["s"]
    return logits, tokens, summary


@pytest.mark.parametrize("tp,ep", LAYOUTS, ids=[layout_name(*lay) for lay in LAYOUTS])
def test_layout_matches_one_rank(runs, tp, ep):
    logits, tokens, summary = compare(runs[layout_name(tp, ep)], runs["tp1"])
    _, _, drift = compare(runs["tp1"], runs["tp1_fp32_cpu"])
    summary.update(tp1_s=runs["tp1"]["s"], tp1_vs_fp32=drift["rel_frobenius"])
    print(json.dumps({"layout": layout_name(tp, ep), **summary}))  # -s: the figures to quote
    assert not logits + tokens, "\n".join(logits + tokens)


@pytest.mark.parametrize("tp,ep", WRONG_SHARDS, ids=[layout_name(*lay) for lay in WRONG_SHARDS])
def test_a_wrong_shard_fails_the_comparison(runs, tp, ep):
    """Rank 1 reading rank 0's slices (heads and vocabulary rows at TP2, experts at EP2) must
    break the logits bound at every step: the comparison above can fail."""
    logits, _, summary = compare(runs["wrong_" + layout_name(tp, ep)], runs["tp1"])
    print(json.dumps({"layout": "wrong_" + layout_name(tp, ep), **summary}))
    assert len(logits) == 1 + len(runs["tp1"]["decode"]), summary
