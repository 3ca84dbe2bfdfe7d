"""--simulate-rank on CPU: one process runs exactly rank R of a TP/EP world of N (random weights,
torch's fake backend), so one device can hold and run one rank of the real model.

In process: the rank's parameters are the sharded count serving/models/rank_plan predicts; a
forward's logits are finite, over the real vocabulary only, and zero outside the rank's vocab
shard; the collectives a step issues are counted. Over HTTP (one worker of rank 3 of tp 4 / ep 4
with EAGLE on a vocabulary of 410, padded to 412; a prefill + decode pair both simulating rank 1
of tp 2 / ep 2, decode holding more rows than it runs): chat completions and /generate
complete, the warnings and /server_info's field are there, the memory plan is logged beside what
was built, nothing leaks; a decode simulating another rank is refused at the handshake; flags
that cannot work are refused with one line. bench/simulated_rank.py's server part, run
from a checkout without pdserve installed (as on the GPU machine), records the simulated decode
role's request rows from /get_server_info.
"""

from __future__ import annotations

import dataclasses
import json
import re
import subprocess
import threading
from pathlib import Path

import httpx
import pytest
import torch

from serving.config import ModelConfig
from serving.distributed import ParallelState, set_state
from tests.pd_pair import FAST_TIMEOUTS, PDPair
from tests.server_proc import Server, eagle_flags

REPO = Path(__file__).resolve().parents[1]
VOCAB = 410  # does not divide by 4: padded to 412, the last rank's last 2 rows are padding


def prompt(seed: int, n: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB, (n,), generator=g).tolist()


def rank_plan(config, rank: int, tp: int, ep: int, fp8=None):
    """The plan of rank `rank` at the small sizes these tests build (float32 on CPU)."""
    from serving.models.rank_plan import predict_rank

    return predict_rank(
        config,
        tp_size=tp,
        ep_size=ep,
        rank=rank,
        dtype=torch.float32,
        context=256,
        running=4,
        extra=8,
        speculative_steps=1,
        page_size=16,
        mem_fraction_static=0.7,
        total_memory=None,
        fp8=fp8,
    )


@pytest.mark.parametrize("rank,tp,ep", [(1, 2, 2), (3, 4, 1), (2, 4, 4), (1, 1, 2)])
def test_rank_parameters_equal_the_plan(v410_ckpt, rank, tp, ep):
    """The random shard has exactly the parameters the plan predicts for that rank, and the
    vocabulary's padding rows are zero (rank 3 of tp 4: rows 101 and 102 of its 103)."""
    from serving.models.random_init import random_weights

    config = ModelConfig.from_pretrained(v410_ckpt)
    plan = rank_plan(config, rank, tp, ep)
    set_state(ParallelState(rank, tp, ep, simulated=True))
    try:
        target, draft = random_weights(config, torch.float32, "cpu")
    finally:
        set_state(ParallelState())
    params = [p for m in (target, draft) for p in m.parameters()]
    assert sum(p.numel() for p in params) == plan.params
    assert sum(p.numel() * p.element_size() for p in params) == plan.weight_bytes
    assert plan.params < plan.full_params
    assert plan.rows == 4 + 8 + 1 and 0 < plan.kda_row_bytes < plan.row_bytes
    share = -(-VOCAB // tp)
    real = min(VOCAB - rank * share, share) if tp > 1 else VOCAB
    for weight in (target.embed_tokens, target.lm_head.weight):
        assert weight.shape[0] == (share if tp > 1 else VOCAB)
        assert weight[real:].abs().sum() == 0 and weight[:real].abs().sum() > 0


@pytest.mark.parametrize("rank,tp,ep", [(1, 2, 2), (3, 4, 4), (1, 1, 2)])
def test_fp8_rank_equals_the_plan(v410_fp8, monkeypatch, rank, tp, ep):
    """A config in block FP8: the shard holds float8_e4m3fn weights with float32 block scales
    where a CUDA load of the checkpoint would (every module with FP8 kernels; kv_b, embeddings,
    norms, router dense), minus --fp8-keep-bf16's kinds and the shapes timed slower in FP8
    (made-up timings here); the plan with that decision counts exactly what was built, without
    it more FP8. Each FP8 weight is the block quantization of the dense build's value (same
    seed), the routed gate and up halves apart."""
    from kernels.fp8 import quantize_weight
    from serving.models.random_init import random_weights
    from serving.models.rank_plan import fp8_plan
    from tests.test_fp8 import given_timings

    config = ModelConfig.from_pretrained(v410_fp8)
    given_timings(monkeypatch, lambda shape: min(shape) <= 8)
    keep = frozenset({"shared_expert"})

    def plan(fp8):
        return rank_plan(config, rank, tp, ep, fp8)

    set_state(ParallelState(rank, tp, ep, simulated=True))
    try:
        target, draft = random_weights(
            config, torch.float32, "cpu", fp8_execution=True, keep_bf16=keep
        )
        dense, dense_draft = random_weights(config, torch.float32, "cpu")
    finally:
        set_state(ParallelState())
    choice = target.fp8_choice
    assert choice.dense_shapes and choice.dense_shapes != {t.shape for t in choice.timings}
    params = [p for m in (target, draft) for p in m.parameters()]
    built = sum(p.numel() * p.element_size() for p in params)
    offline = fp8_plan(str(v410_fp8), config, keep, headers=False)
    decided = plan(dataclasses.replace(offline, dense_shapes=choice.dense_shapes))
    assert built == decided.weight_bytes and sum(p.numel() for p in params) == decided.params
    assert plan(offline).weight_bytes < built < plan(None).weight_bytes
    want = dict(dense.named_parameters())
    want.update({f"draft.{n}": p for n, p in dense_draft.named_parameters()})
    got = dict(target.named_parameters())
    got.update({f"draft.{n}": p for n, p in draft.named_parameters()})
    fp8 = {n for n, p in got.items() if p.dtype == torch.float8_e4m3fn}
    assert fp8 and {n + "_scale_inv" for n in fp8} == {n for n in got if n.endswith("_scale_inv")}
    assert not [n for n in fp8 if "kv_b_proj" in n or "shared_experts" in n], fp8
    for name, p in got.items():
        if name in fp8 and name.endswith(".w13"):
            half = p.shape[1] // 2
            for rows in (slice(0, half), slice(half, None)):
                q, _ = quantize_weight(want[name][:, rows])
                assert torch.equal(p[:, rows].float(), q.float()), name
        elif name in fp8:
            w8, scale = quantize_weight(want[name])
            assert torch.equal(p.float(), w8.float()), name
            assert torch.equal(got[name + "_scale_inv"], scale), name
        elif not name.endswith("_scale_inv"):
            assert torch.equal(p, want[name]), name


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_simulated_forward_is_finite_and_counts_collectives(v410_ckpt, v410_fp8, fp8):
    """Rank 3 of tp 4: logits over the 410 real tokens only, finite, zero outside rank 3's
    columns 309..409 (the all-gather's other parts are zeroed, not left as the fake backend
    leaves them); the step's all-reduces and its one all-gather are counted with their bytes."""
    from serving.distributed import count_collectives, destroy_parallel, init_simulated
    from serving.executor.model_runner import ModelRunner, StepInput
    from serving.memory.pool import MemoryPool, PoolPlan
    from serving.models.random_init import random_weights

    config = ModelConfig.from_pretrained(v410_fp8 if fp8 else v410_ckpt)
    init_simulated(3, 4, 1)
    try:
        model, _ = random_weights(config, torch.float32, "cpu", draft=False, fp8_execution=fp8)
        held = [m for m in model.modules() if getattr(m, "weight_scale_inv", None) is not None]
        assert bool(held) == fp8  # the W8A8 torch references run at rank 3's shapes
        pool = MemoryPool(config, PoolPlan(2, 32, 16, 256), torch.float32, "cpu")
        runner = ModelRunner(model, pool)
        row = pool.alloc_row()
        assert pool.grow(row, [], 60)
        out = runner.forward([StepInput(row, 0, prompt(1, 50))])
        with count_collectives() as tally:
            step = runner.forward([StepInput(row, 50, [320])])
    finally:
        destroy_parallel()
    for logits in (out.logits, step.logits):
        assert logits.shape == (1, VOCAB) and torch.isfinite(logits).all()
        assert logits[:, :309].abs().sum() == 0 and logits[:, 309:].abs().sum() > 0
    # the embedding, then per layer attention's row-parallel output and the MLP's (the indexer
    # is replicated under TP: its pool scores need none); one all-gather of logits
    calls, nbytes = tally["all_reduce"]
    assert calls == 1 + 2 * config.num_hidden_layers, tally
    assert nbytes == calls * config.hidden_size * 4, tally  # each [1, hidden] float32
    assert tally["all_gather"] == [1, 103 * 4], tally  # rank 3's [1, 103] logits


def test_flags_that_cannot_work_are_refused(tiny_ckpt):
    from serving.server_args import ArgsError, ServerArgs

    def refused(*flags: str) -> str:
        args = ServerArgs.from_cli(["--model-path", str(tiny_ckpt), "--device", "cpu", *flags])
        with pytest.raises(ArgsError) as exc:
            args.validate()
        return str(exc.value)

    assert "with one rank there is nothing to simulate" in refused("--simulate-rank", "0")
    assert "must be in [0, 4)" in refused("--tp-size", "4", "--simulate-rank", "4")
    assert "must be in [0, 2)" in refused("--ep-size", "2", "--simulate-rank", "-1")
    multi = ("--tp-size", "4", "--nnodes", "2", "--dist-init-addr", "10.0.0.1:5000")
    assert "one process on one node" in refused(*multi, "--simulate-rank", "1")
    assert "--simulate-rank" in ServerArgs.parser().format_help()
    ok = ServerArgs.from_cli(
        ["--model-path", str(tiny_ckpt), "--tp-size", "8", "--simulate-rank", "7"]
    )
    ok.validate()
    assert ok.rank_processes == 1 and ok.world_size == 8 and ok.ranks_per_node == 1


def _generate(url: str, ids: list[int], n: int) -> httpx.Response:
    sampling = {"max_new_tokens": n, "temperature": 0, "ignore_eos": True}
    return httpx.post(
        url + "/generate", json={"input_ids": ids, "sampling_params": sampling}, timeout=120
    )


def test_worker_serves_and_says_so(v410_ckpt, tmp_path):
    """Rank 3 of tp 4 / ep 4, EAGLE 1 step, on the padded vocabulary: requests complete (their
    tokens mean nothing), concurrently too, and every row and page is free afterwards."""
    srv = Server(
        v410_ckpt,
        "--tp-size",
        "4",
        "--ep-size",
        "4",
        "--simulate-rank",
        "3",
        "--context-length",
        "256",
        "--max-running-requests",
        "4",
        "--chunked-prefill-size",
        "32",
        *eagle_flags(1),
        log_dir=tmp_path,
    )
    try:
        chat = {
            "model": str(v410_ckpt),
            "messages": [{"role": "user", "content": "hello"}],
            "max_tokens": 6,
            "temperature": 0,
        }
        r = httpx.post(srv.url + "/v1/chat/completions", json=chat, timeout=120)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] >= 1
        got: dict[int, httpx.Response] = {}

        def one(i: int) -> None:
            got[i] = _generate(srv.url, prompt(i, 20 + 17 * i), 8)

        threads = [threading.Thread(target=one, args=(i,)) for i in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=180)
        for i in range(3):
            assert got[i].status_code == 200, got[i].text
            ids = got[i].json()["output_ids"]
            assert ids and all(0 <= t < VOCAB for t in ids), ids
        stats = srv.idle_pool()
        assert stats["spec_verify_steps"] > 0, stats
        info = httpx.get(srv.url + "/get_server_info", timeout=5).json()
        sim = info["simulation"]
        assert (sim["simulated_rank"], sim["world_size"]) == (3, 4), sim
        assert "meaningless" in sim["warning"]
        log = srv.log_path.read_text()
        assert re.search(r"WARNING .*--simulate-rank 3: .* meaningless", log), log
        assert re.search(r"WARNING .*SIMULATED RANK 3 of a world of 4", log), log
        assert "start-up: weights built (random)" in log and "start-up: scheduler ready" in log
        assert "memory plan (serving.tools.plan): weights per rank" in log, log
        assert "request rows 5 (running 4 + extra 0 + 1 padding)" in log, log
        assert "the plan predicts" not in log, log  # built weights == predicted weights
    finally:
        assert srv.stop() == 0


PD = ("--tp-size", "2", "--ep-size", "2", "--context-length", "256", "--skip-server-warmup")


@pytest.fixture(scope="module")
def sim_pair(v410_ckpt, tmp_path_factory):
    pytest.importorskip("mooncake.engine")
    logs = tmp_path_factory.mktemp("sim-pd")
    pair = PDPair(
        v410_ckpt,
        logs,
        prefill_flags=(*PD, "--simulate-rank", "1", "--chunked-prefill-size", "16"),
        decode_flags=(
            *PD,
            "--simulate-rank",
            "1",
            "--max-running-requests",
            "2",
            "--disaggregation-decode-extra-slots",
            "4",
        ),
    )
    yield pair
    pair.stop()


def test_simulated_pd_pair_hands_over_and_holds_extra_rows(sim_pair):
    """Prefill and decode both simulate rank 1: each request's KV (rank 1's share) is handed
    over and decoded; six at once fill decode's 2 running + 4 extra rows."""
    got: dict[int, tuple[httpx.Response, httpx.Response]] = {}

    def one(i: int) -> None:
        body = {
            "input_ids": prompt(40 + i, 9 + 13 * i),
            "sampling_params": {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True},
        }
        got[i] = sim_pair.dispatch("/generate", body, timeout=120)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=240)
    for i in range(6):
        decode, prefill = got[i]
        assert prefill.status_code == 200 and decode.status_code == 200, decode.text
        assert decode.json()["meta_info"]["completion_tokens"] == 6
    stats = sim_pair.decode.idle_pool(timeout=30)
    assert stats["total_rows"] == 6 and stats["peak_used_rows"] > 2, stats  # extra rows held
    sim_pair.prefill.idle_pool(timeout=30)


def test_decode_simulating_another_rank_is_refused(sim_pair, v410_ckpt, tmp_path):
    other = Server(
        v410_ckpt,
        "--disaggregation-mode",
        "decode",
        *PD,
        "--simulate-rank",
        "0",
        log_dir=tmp_path,
        env=FAST_TIMEOUTS,
    )
    try:
        pair = PDPair.join(sim_pair.prefill, sim_pair.bootstrap_port, other)
        body = {"input_ids": prompt(60, 12), "sampling_params": {"max_new_tokens": 2}}
        decode, prefill = pair.dispatch("/generate", body, timeout=60)
        why = "prefill is simulated rank 1, decode simulated rank 0"
        assert decode.status_code == 502 and why in decode.text, decode.text
        assert prefill.status_code == 502 and why in prefill.text, prefill.text
        sim_pair.prefill.idle_pool(timeout=30)
        other.idle_pool(timeout=30)
    finally:
        assert other.stop() == 0


def test_engine_bench_runs_a_simulated_rank(v410_ckpt, tmp_path):
    """bench.fast_path's rank stages on CPU (no graphs, no CUDA profiler): every stage leaves
    its JSON line, the collectives are counted per step and projected, the floor is computed;
    a --variant's prefill, decode, EAGLE and layer rows come beside the base's, and its switch
    is restored after."""
    import json

    import serving.layers.mlp as mlp
    from bench.fast_path import main

    before = mlp.GROUPED_MIN_PAIRS_PER_EXPERT
    out = tmp_path / "rank.jsonl"
    main(
        [
            *("--out", str(out), "--model-path", str(v410_ckpt), "--device", "cpu"),
            *("--simulate-rank", "3", "--tp-size", "4", "--ep-size", "4"),
            *("--stages", "prefill,decode,eagle,layers,collectives,floor"),
            *("--contexts", "40,72", "--batch-sizes", "1", "--prefill-tokens", "24"),
            *("--context-fill", "mapped", "--no-torch-path", "--repeat", "1"),
            *("--variant", "moe=serving.layers.mlp.GROUPED_MIN_PAIRS_PER_EXPERT=0"),
        ]
    )
    assert mlp.GROUPED_MIN_PAIRS_PER_EXPERT == before
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert not [r for r in rows if r["stage"] == "error"], rows
    by_stage: dict[str, list[dict]] = {}
    for r in rows:
        by_stage.setdefault(r["stage"], []).append(r)
    assert [r["variant"] for r in by_stage["prefill"]] == ["base", "moe"]
    for step in ("prefill", "decode", "eagle"):
        got = [r["variant"] for r in by_stage["layer_kinds"] if r["step"] == step]
        assert got == ["base", "moe"], (step, got)
    assert "simulated=True" in by_stage["built"][0]["rank"]
    for stage in ("decode_graphs", "eagle_step"):  # 2 contexts per variant
        assert [r["variant"] for r in by_stage[stage]] == ["base"] * 2 + ["moe"] * 2, stage
    kinds = {r["step"]: r["ms"] for r in by_stage["layer_kinds"] if r["variant"] == "base"}
    assert set(kinds) == {"decode", "prefill", "eagle"}
    for ms in kinds.values():  # every kind seen, none counted twice (MoE holds a dense MLP)
        assert ms["KDA"] > 0 and ms["DSA"] > 0 and ms["MoE"] > 0 and ms["mHC"] > 0, kinds
        assert 0 <= ms["rest"] < ms["step"], kinds
    coll = {r["step"]: r for r in by_stage["collectives"]}
    assert coll["decode"]["counts"]["all_gather"] == {"calls": 1, "bytes": 103 * 4}
    # EAGLE's step: the target's verify and the draft's catch-up, each with its logits gathered
    assert coll["eagle"]["counts"]["all_gather"]["calls"] == 2
    assert coll["eagle"]["projected_step_ms"] > coll["eagle"]["measured_compute_ms"]
    floors = by_stage["hbm_floor"]
    assert len(floors) == 4 and all(f["floor_ms"] > 0 and f["total_bytes"] > 0 for f in floors)
    longer = {(f["step"], f["batch"], f["context"]): f["index_key_bytes"] for f in floors}
    assert longer[("decode", 1, 72)] > longer[("decode", 1, 40)]


def test_bench_rows_decode_tokens_of_their_own():
    """bench.fast_path feeds each batch row its own token of this rank's embedding shard: rows
    of one token over one mapped context would route alike, and a batch's MoE would read one
    token's experts (the b8 / b32 rank figures before 2026-12-05)."""
    from bench.fast_path import own_tokens, row_tokens

    set_state(ParallelState(3, 8, 8, simulated=True))
    try:
        low, high = own_tokens(1000)
        tokens = row_tokens(1000, 32)
    finally:
        set_state(ParallelState())
    assert (low, high) == (375, 500)
    assert len(set(tokens)) == 32 and all(low < t < high for t in tokens), tokens
    assert row_tokens(5, 6) == [1, 2, 3, 4, 1, 2]  # tp 1: past the vocabulary, it wraps


def test_hbm_floor_of_the_real_rank(tmp_path):
    """Rank 0 of the real config at TP8/EP8 (meta device, no memory): a decode step at batch 1
    reads about 4.7 GB (2.5 GB of dense weights, lm_head shard included, and the one local
    expert per MoE layer its token is expected to pick), the issue's ~1 ms at 4.23 TB/s; at
    batch 32 the experts dominate."""
    from bench.step_costs import hbm_floor
    from serving.models.glm5_next import Glm5NextForCausalLM
    from serving.tools.tiny_model import write_checkpoint

    config = ModelConfig.from_pretrained(write_checkpoint(tmp_path / "real", preset="real"))
    set_state(ParallelState(0, 8, 8, simulated=True))
    try:
        with torch.device("meta"):
            target = Glm5NextForCausalLM(config, torch.bfloat16)
    finally:
        set_state(ParallelState())
    one = hbm_floor(config, [target], batch=1, context=4096, tp_size=8)
    assert 1.0 < one["floor_ms"] < 1.25, one
    assert 2.0e9 < one["experts_bytes"] < 2.3e9, one  # 42 MoE layers x 1 expert x 50 MB
    full = hbm_floor(config, [target], batch=32, context=65536, tp_size=8)
    assert full["experts_bytes"] > 0.8 * full["total_bytes"], full
    assert 1.1e9 < full["kda_state_bytes"] < 1.3e9, full  # 32 rows x 18.5 MB, read + written
    short = hbm_floor(config, [target], batch=32, context=4096, tp_size=8)
    assert full["index_key_bytes"] == 16 * short["index_key_bytes"], (full, short)


def test_layer_kinds_split_needs_the_cpu_ranges():
    """The layers stage's attribution: labelled CPU ranges carry the time (here CPU ops), the
    CUDA profile records the CPU ranges too (run 5 profiled CUDA alone and read 0.0 ms for every
    kind), and a profile whose step range holds nothing is refused, not reported as zeros."""
    from torch.profiler import ProfilerActivity, profile, record_function

    from bench.step_costs import profiler_activities, split_by_kind

    assert ProfilerActivity.CPU in profiler_activities(cuda=True)
    assert ProfilerActivity.CUDA in profiler_activities(cuda=True)
    a = torch.randn(256, 256)
    with profile(activities=profiler_activities(cuda=False)) as prof:
        with record_function("step"):
            with record_function("MoE"):
                for _ in range(20):
                    a = (a @ a).tanh()
            with record_function("mHC"):
                a = a + 1
            a = a * 2  # rest
    ms, launches = split_by_kind(prof, "step", cuda=False)
    assert launches == {}  # kernel counts come from a CUDA trace only
    assert ms["MoE"] > ms["mHC"] > 0 and ms["KDA"] == 0 and ms["rest"] > 0, ms
    with pytest.raises(ValueError, match="no device time under 'step' \\(1 ranges\\)"):
        split_by_kind(prof, "step", cuda=True)  # the trace path: a step, but no kernels
    assert abs(sum(v for k, v in ms.items() if k != "step") - ms["step"]) < 1e-6, ms
    with profile(activities=profiler_activities(cuda=False)) as prof:
        a = a + 1
    with pytest.raises(ValueError, match="no CPU time under 'step'"):
        split_by_kind(prof, "step", cuda=False)


def test_kernel_time_goes_to_the_range_around_its_launch():
    """The CUDA split reads a Chrome trace: each device event is charged, through its launch's
    correlation id, to the innermost kind range around the launch (runtime or driver API
    launches alike), the rest of the step to "rest"; launches outside the step count nowhere,
    and a launch on another thread is not inside this thread's ranges."""
    from bench.step_costs import KINDS, kernel_time_by_range

    def host(name, cat, ts, dur, tid=1, corr=None):
        args = {} if corr is None else {"correlation": corr}
        return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "pid": 1,
                "tid": tid, "args": args}  # fmt: skip

    def kernel(corr, dur, cat="kernel"):
        return {"ph": "X", "cat": cat, "name": f"k{corr}", "ts": 1000 + corr, "dur": dur,
                "pid": 0, "tid": 7, "args": {"correlation": corr}}  # fmt: skip

    events = [
        host("step", "user_annotation", 0, 100),
        host("KDA", "user_annotation", 10, 20),
        host("cuLaunchKernelEx", "cuda_driver", 15, 1, corr=1),  # Triton's launch path
        host("aten::mm", "cpu_op", 20, 5),
        host("cudaLaunchKernel", "cuda_runtime", 21, 1, corr=2),  # inside an op inside KDA
        host("MoE", "user_annotation", 40, 20),
        host("mHC", "user_annotation", 45, 5),  # a kind inside a kind: the innermost wins
        host("cuLaunchKernelEx", "cuda_driver", 46, 1, corr=3),
        host("cudaMemcpyAsync", "cuda_runtime", 55, 1, corr=4),
        host("cudaLaunchKernel", "cuda_runtime", 70, 1, corr=5),  # the step's rest
        host("cudaLaunchKernel", "cuda_runtime", 150, 1, corr=6),  # after the step
        host("cudaLaunchKernel", "cuda_runtime", 20, 1, tid=2, corr=7),  # another thread
        kernel(1, 5.0), kernel(2, 7.0), kernel(3, 3.0), kernel(4, 2.0, "gpu_memcpy"),
        kernel(5, 4.0), kernel(6, 100.0), kernel(7, 50.0),
        {"ph": "X", "cat": "gpu_user_annotation", "name": "KDA", "ts": 1000, "dur": 80,
         "pid": 0, "tid": 7, "args": {}},  # the profiler's device copy of a range: not a kernel
    ]  # fmt: skip
    totals, kernels, steps = kernel_time_by_range({"traceEvents": events}, KINDS, "step")
    assert steps == 1
    assert totals == {**dict.fromkeys(KINDS, 0.0), "KDA": 12.0, "mHC": 3.0, "MoE": 2.0,
                      "step": 21.0}, totals  # fmt: skip
    # the memcpy (corr 4) is time, not a kernel launch
    assert kernels == {**dict.fromkeys(KINDS, 0), "KDA": 2, "mHC": 1, "step": 4}, kernels


def test_graph_steps_count_a_replay_s_kernels_and_its_gaps():
    """A replayed graph's kernels share their cudaGraphLaunch's correlation id: each step range
    gets its kernels' count, busy time (overlaps counted once), span and the idle gap between;
    graph_kernels ranks the kernel names by their time a step."""
    from bench.step_costs import graph_kernels, graph_steps

    def host(name, cat, ts, dur, corr=None):
        args = {} if corr is None else {"correlation": corr}
        return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "pid": 1, "tid": 1,
                "args": args}  # fmt: skip

    def dev(corr, ts, dur, cat="kernel", name="k"):
        return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "pid": 0, "tid": 7,
                "args": {"correlation": corr}}  # fmt: skip

    events = [
        host("step", "user_annotation", 0, 50),
        host("cudaGraphLaunch", "cuda_runtime", 5, 2, corr=1),
        host("step", "user_annotation", 100, 50),
        host("cudaGraphLaunch", "cuda_runtime", 105, 2, corr=2),
        dev(1, 1000, 10), dev(1, 1012, 10, name="g"), dev(1, 1015, 3),
        dev(1, 1030, 5, "gpu_memset"), dev(2, 2000, 20), dev(2, 2030, 10),
    ]  # fmt: skip
    rows = graph_steps({"traceEvents": events}, "step")
    assert rows == [
        {"kernels": 3, "busy_us": 25.0, "span_us": 35.0, "gap_us": 10.0},
        {"kernels": 2, "busy_us": 30.0, "span_us": 40.0, "gap_us": 10.0},
    ], rows
    # by name, means over the two steps, longest first; the memset is no kernel
    assert graph_kernels({"traceEvents": events}, "step") == [
        {"name": "k", "calls": 2.0, "us": 21.5},
        {"name": "g", "calls": 0.5, "us": 5.0},
    ]


@pytest.fixture(scope="module")
def uninstalled_python(tmp_path_factory) -> Path:
    """An interpreter with every package of this one but pdserve, which is not installed (no
    pdserve-*.dist-info, no editable finder): how the GPU scripts run the repository (the image's
    venv, the wheels in a site dir, the checkout on sys.path)."""
    import site
    import venv

    root = tmp_path_factory.mktemp("uninstalled")
    venv.create(root, with_pip=False, symlinks=True)
    (packages,) = root.glob("lib/python3*/site-packages")
    for entry in Path(site.getsitepackages()[0]).iterdir():
        if "pdserve" not in entry.name:
            (packages / entry.name).symlink_to(entry)
    python = root / "bin" / "python"
    probe = "import importlib.util as u, torch; assert u.find_spec('mooncake') is not None"
    subprocess.run([python, "-c", probe], check=True, timeout=120)
    return python


def test_gpu_script_reads_the_simulated_decode_rows(v410_ckpt, tmp_path, uninstalled_python):
    """bench/simulated_rank.py's server part at a tiny size on the CPU, run from the
    checkout as on the GPU machine: /get_server_info answers (run 5's raised on the missing
    package metadata, and the script read the 500's body as nulls) and the script records the
    simulated decode role's request rows. Its requests run locally (SGLang's fake bootstrap
    host): at most --max-running-requests rows at once; the extra rows are for PD transfers."""
    pytest.importorskip("mooncake.engine")
    out = tmp_path / "out"
    seed = "--tp-size 2 --ep-size 2 --context-length 256 --max-running-requests 2"
    seed += " --chunked-prefill-size 32 --skip-server-warmup"
    cmd = [
        *(str(uninstalled_python), "bench/simulated_rank.py", "--parts", "server"),
        *("--device", "cpu", "--model-path", str(v410_ckpt), "--seed-flags", seed),
        *("--decode-flags", "--disaggregation-mode decode --disaggregation-decode-extra-slots 4"),
        *("--concurrent", "6", "--prompt-len", "20", "--max-new-tokens", "4"),
        *("--budget-s", "240", "--out", str(out)),
    ]
    run = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    results = json.loads((out / "results.json").read_text())
    assert run.returncode == 0 and not results["errors"], (results["errors"], run.stdout[-3000:])
    server = results["server"]
    assert server["role"] == "decode" and server["concurrent"]["ok"] == 6, server
    info = server["server_info"]
    assert info["simulation"]["simulated_rank"] == 0, info
    assert info["rows"]["total_rows"] == 6 and info["rows"]["used_rows"] == 0, info
    assert info["rows"]["peak_used_rows"] == 2, info
