"""The scheduler in-process on the tiny checkpoint: batching, chunking, retraction, aborts.

The pool invariant (every row and page free or owned by exactly one live request) is checked
after every step (PDSERVE_CHECK_INVARIANTS) and at the end of every scenario.
"""

from __future__ import annotations

import traceback

import pytest
import torch

from serving.config import ModelConfig
from serving.engine import scheduler as scheduler_mod
from serving.engine.build import build_engine
from serving.models.loader import load_weights
from serving.protocol import FinishReason, GenerateRequest
from serving.sampling_params import SamplingParams
from serving.server_args import ServerArgs
from serving.tools.generate import StepRunner


@pytest.fixture(autouse=True)
def check_every_step(monkeypatch):
    monkeypatch.setattr(scheduler_mod, "CHECK_INVARIANTS", True)


def engine(tiny_ckpt, *flags: str):
    args = ServerArgs.from_cli(["--model-path", str(tiny_ckpt), "--page-size", "16", *flags])
    return build_engine(args)[0]


def run(sched, requests) -> dict[str, tuple[list[int], dict]]:
    for r in requests:
        sched.add(r)
    out: dict[str, list[int]] = {}
    reasons = {}
    for _ in range(10_000):
        for o in sched.step():
            out.setdefault(o.rid, []).extend(o.new_token_ids)
            if o.finished:
                reasons[o.rid] = o.finish_reason
        if not sched.has_work:
            break
    sched.check_invariants()
    assert sched.flush_cache() is None  # the prefix cache's pages and states go back too
    pool = sched.pool
    assert not pool.rows.used and not pool.pages.used and not pool.state_slots.used, "leak"
    return {rid: (out.get(rid, []), reasons[rid]) for rid in reasons}


def greedy(rid: str, prompt: list[int], n: int, **kw) -> GenerateRequest:
    return GenerateRequest(
        rid, prompt, SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True, **kw)
    )


def prompts(count: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randint(
            0, 1000, (int(torch.randint(5, 90, (1,), generator=g)),), generator=g
        ).tolist()
        for _ in range(count)
    ]


@pytest.fixture(scope="module")
def reference(tiny_ckpt):
    """Step-by-step greedy decoding of the model alone, one prompt at a time."""
    config = ModelConfig.from_pretrained(tiny_ckpt)
    model, _ = load_weights(tiny_ckpt, config, torch.float32)

    def ref(prompt: list[int], n: int) -> list[int]:
        return StepRunner(model, max_requests=1, max_context=512).greedy([prompt], n)[0]

    return ref


def test_batched_greedy_equals_model_alone(tiny_ckpt, reference):
    ps = prompts(6)
    got = run(engine(tiny_ckpt), [greedy(f"r{i}", p, 12) for i, p in enumerate(ps)])
    for i, p in enumerate(ps):
        assert got[f"r{i}"][0] == reference(p, 12)
        assert got[f"r{i}"][1].kind == "length"


def test_chunked_prefill_gives_same_tokens(tiny_ckpt):
    ps = prompts(4, seed=1)
    big = run(engine(tiny_ckpt), [greedy(f"r{i}", p, 8) for i, p in enumerate(ps)])
    small = run(
        engine(tiny_ckpt, "--chunked-prefill-size", "8", "--max-prefill-tokens", "20"),
        [greedy(f"r{i}", p, 8) for i, p in enumerate(ps)],
    )
    assert big == small


def test_running_limit_and_retraction(tiny_ckpt, reference):
    """A pool too small for every request to decode at once retracts and recomputes."""
    sched = engine(tiny_ckpt, "--max-total-tokens", "160", "--max-running-requests", "3")
    ps = [p[:40] for p in prompts(5, seed=2)]
    got = run(sched, [greedy(f"r{i}", p, 40) for i, p in enumerate(ps)])
    assert sched.stats.retractions > 0
    for i, p in enumerate(ps):
        assert got[f"r{i}"][0] == reference(p, 40)


def test_abort_frees_at_once(tiny_ckpt):
    sched = engine(tiny_ckpt)
    sched.add(greedy("a", list(range(50)), 100))
    sched.add(greedy("b", list(range(30)), 100))
    sched.step()
    sched.step()
    sched.abort("a")
    outs = sched.step()
    assert any(o.rid == "a" and o.finished and o.finish_reason.kind == "abort" for o in outs)
    sched.check_invariants()
    run(sched, [])


def test_rejections_are_immediate(tiny_ckpt):
    sched = engine(tiny_ckpt, "--context-length", "64")
    got = run(
        sched,
        [greedy("empty", [], 4), greedy("long", list(range(60)), 10), greedy("zero", [1, 2], 0)],
    )
    assert got["empty"][1].status == 400
    assert "context length" in got["long"][1].message
    assert got["zero"] == ([], FinishReason.length())


def test_stop_conditions(tiny_ckpt, reference):
    p = prompts(1, seed=3)[0]
    free = reference(p, 10)
    sched = engine(tiny_ckpt)
    got = run(sched, [greedy("tok", p, 10, stop_token_ids=[free[3]])])
    assert got["tok"] == (free[: free.index(free[3]) + 1], FinishReason.stop(free[3]))


def test_overlap_gives_the_tokens_of_the_sync_order(tiny_ckpt, reference):
    """Greedy tokens, finish reasons and leaks with the overlap scheduler (the default) equal
    --disable-overlap-schedule's; requests that stop (a stop token, EOS, max_tokens) when step N
    is processed were already in step N+1: its extra token is dropped and their memory comes
    back only after N+1 (the deferral path is exercised, then nothing leaks)."""
    ps = prompts(5, seed=4)
    free = reference(ps[0], 10)

    def requests():
        return [
            greedy("stop", ps[0], 10, stop_token_ids=[free[4]]),
            greedy("short", ps[1], 1),
            greedy("long", ps[2], 14),
            GenerateRequest("eos", ps[3], SamplingParams(max_new_tokens=9, temperature=0.0)),
            greedy("chunked", ps[4] * 3, 6),
        ]

    flags = ("--chunked-prefill-size", "32")
    sync = run(engine(tiny_ckpt, *flags, "--disable-overlap-schedule"), requests())
    sched = engine(tiny_ckpt, *flags)
    seen = {"in flight": 0, "deferred": 0}
    step, settle = sched.step, sched.admission.settle

    def watch_step():
        out = step()
        seen["in flight"] += sched.inflight is not None
        return out

    def watch_settle():
        seen["deferred"] += bool(sched.admission.deferred)
        settle()

    sched.step, sched.admission.settle = watch_step, watch_settle
    assert run(sched, requests()) == sync
    assert sync["stop"][0] == free[:5] and sync["long"][0] == reference(ps[2], 14)
    assert seen["in flight"] and seen["deferred"]  # it overlapped, and deferred a release


def test_abort_of_a_request_in_flight_drops_its_token(tiny_ckpt):
    sched = engine(tiny_ckpt)
    sched.add(greedy("a", list(range(40)), 50))
    sched.add(greedy("b", list(range(20)), 5))
    got: list[int] = []
    while len(got) < 3:
        got += [t for o in sched.step() if o.rid == "a" for t in o.new_token_ids]
    a = next(r for r in sched.inflight.reqs if r.rid == "a")
    sched.abort("a")
    assert a.row in sched.pool.rows.used and a in sched.admission.deferred  # until step done
    outs = [o for o in sched.step() if o.rid == "a"]
    assert outs and outs[0].finished and outs[0].new_token_ids == []
    assert all(o.rid != "a" for o in sched.step())  # the launched step's token never goes out
    run(sched, [])


class StepPathHazards(torch.overrides.TorchFunctionMode):
    """Records two ways a step launch waits for the device on CUDA, which a CPU run can see:
    `t[index] = <Python number>` with a tensor (or list) in the index, or with integers down to
    a single element (torch copies the number from the host with a blocking copy; the H200's
    prefill lost most of its time to these in row resets, and the fused MoE's torch align had
    one), and `torch.tensor`/`torch.as_tensor` with a device (a blocking copy; step-path code
    goes through forward_batch.to_device). Slicing (`t[:, 0] = 0`, `t[i:] = 0`) fills on the
    device and is not recorded, nor are the kernels' torch references (kernels/, the oracle:
    on CUDA the fast path runs instead)."""

    def __init__(self):
        super().__init__()
        self.sites: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        hazard = False
        if func is torch.Tensor.__setitem__ and isinstance(args[2], (int, float, bool)):
            key = args[1] if isinstance(args[1], tuple) else (args[1],)
            advanced = any(isinstance(k, (torch.Tensor, list)) for k in key)
            element = len(key) == args[0].dim() and all(type(k) is int for k in key)
            hazard = advanced or element
        elif func in (torch.tensor, torch.as_tensor):
            hazard = kwargs.get("device") is not None
        if hazard:
            frame = traceback.extract_stack(limit=2)[0]
            if "/kernels/" not in frame.filename:
                self.sites.append(f"{frame.filename}:{frame.lineno}")
        return func(*args, **kwargs)


EAGLE3 = ("--speculative-algorithm", "EAGLE", "--speculative-num-steps", "3",
          "--speculative-num-draft-tokens", "4")  # fmt: skip


@pytest.mark.parametrize("spec", [(), EAGLE3], ids=["plain", "eagle3"])
def test_step_paths_never_copy_from_the_host_blocking(tiny_ckpt, spec):
    """The CPU's stand-in for tests/test_gpu.py's sync check, for the hazards a CPU can see
    (StepPathHazards): chunked prefill, prompts sharing a prefix, decode (EAGLE too), new rows
    admitted while others run, sampled rows with min_new_tokens bans and logit_bias."""
    sched = engine(tiny_ckpt, "--chunked-prefill-size", "32", "--max-running-requests", "4", *spec)
    ps = prompts(6, seed=9)
    shared = ps[0] * 2
    requests = [greedy(f"g{i}", p, 6) for i, p in enumerate(ps[:4])]
    requests += [greedy("hit1", shared + [1, 2], 4), greedy("hit2", shared + [3], 4)]
    requests.append(
        GenerateRequest(
            "sampled",
            ps[5],
            SamplingParams(max_new_tokens=6, temperature=0.8, min_new_tokens=4,
                           logit_bias={7: -2.0}, stop_token_ids=[11]),
        )
    )  # fmt: skip
    with StepPathHazards() as watch:
        run(sched, requests)
    assert not watch.sites, watch.sites
