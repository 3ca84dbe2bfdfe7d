"""Helpers that run TP/EP ranks in spawned processes (tests/test_tp.py, test_tp_fast_path.py)."""

from __future__ import annotations

import multiprocessing as mp
import socket
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

# three requests of different lengths (longer than index_topk + kpool, so selection is sparse)
PROMPT_LENS = (23, 70, 41)
DECODE_STEPS = 4
CHUNKS = (1, 5, 13, 32, 50)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def prompt(seed: int, n: int, high: int = 1000) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, high, (n,), generator=g).tolist()


def scenario(ckpt: str) -> list[torch.Tensor]:
    """Logits of a ragged batch (prefill + decode steps) and of a chunked prefill, in order."""
    from serving.config import ModelConfig
    from serving.models.loader import load_weights
    from serving.tools.generate import StepRunner

    config = ModelConfig.from_pretrained(ckpt)
    model, _ = load_weights(ckpt, config, torch.float32)
    out = []
    runner = StepRunner(model, max_requests=4, max_context=256)
    high = min(1000, config.vocab_size)
    prompts = [prompt(i, n, high) for i, n in enumerate(PROMPT_LENS)]
    seqs = [runner.add(p) for p in prompts]
    logits = runner.step(seqs, list(PROMPT_LENS)).logits
    out.append(logits)
    for step in range(DECODE_STEPS):
        for i, seq in enumerate(seqs):
            seq.tokens.append(7 + 31 * step + i)  # fixed tokens: no dependence on argmax ties
        out.append(runner.step(seqs, [1] * len(seqs)).logits)
    seq = runner.add(prompt(9, 70, high))
    bounds = [0, *CHUNKS, 70]
    for a, b in zip(bounds, bounds[1:]):
        out.append(runner.step([seq], [b - a], logits="all").logits)
    return out


def _reporting(main, rank: int, errors, *args) -> None:
    """A rank process's target: main(rank, *args); a failure reaches the parent through errors."""
    try:
        main(rank, *args)
    except BaseException:
        errors.put(f"rank {rank}: {traceback.format_exc()}")
        raise


def _rank_main(rank, tp, ep, port, ckpt, out_path) -> None:
    from serving.distributed import destroy_parallel, init_parallel

    init_parallel(rank, tp, ep, f"tcp://127.0.0.1:{port}", "cpu", timeout_s=120)
    torch.set_num_threads(1)
    logits = scenario(ckpt)
    if rank == 0:
        torch.save(logits, out_path)
    destroy_parallel()


def run_ranks(ckpt: Path, tp: int, ep: int, out_path: Path, timeout: float = 180.0) -> None:
    """Run `scenario` on max(tp, ep) gloo ranks; rank 0 saves its logits to out_path."""
    ctx = mp.get_context("spawn")
    errors = ctx.Queue()
    port = free_port()
    world = max(tp, ep)
    procs = [
        ctx.Process(
            target=_reporting,
            args=(_rank_main, r, errors, tp, ep, port, str(ckpt), str(out_path)),
        )
        for r in range(world)
    ]
    _join(procs, errors, timeout)


def _join(procs, errors, timeout: float) -> None:
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout)
    alive = [p for p in procs if p.is_alive()]
    for p in alive:
        p.kill()
    failures = []
    while not errors.empty():
        failures.append(errors.get())
    assert not alive, f"ranks still running after {timeout}s"
    assert not failures and all(p.exitcode == 0 for p in procs), "\n".join(failures)


def _vm_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def _load_main(ckpt, rank, tp, ep, results) -> None:
    try:
        from serving.config import ModelConfig
        from serving.distributed import ParallelState, set_state
        from serving.models.loader import load_weights

        torch.set_num_threads(1)
        config = ModelConfig.from_pretrained(ckpt)
        before = _vm_kib("VmHWM")  # interpreter + torch + our modules, nothing loaded yet
        set_state(ParallelState(rank=rank, tp_size=tp, ep_size=ep))
        load_weights(ckpt, config, torch.float32)
        results.put((rank, tp, ep, before, _vm_kib("VmHWM")))
    except BaseException:
        results.put((rank, tp, ep, traceback.format_exc(), None))
        raise


def load_peaks(ckpt: Path, layouts: list[tuple[int, int, int]], timeout: float = 180.0) -> dict:
    """{(rank, tp, ep): (VmHWM before loading, VmHWM after) in KiB}, each layout loaded in its
    own spawned process (no process group: loading needs none), all at once."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=_load_main, args=(str(ckpt), *lay, results)) for lay in layouts]
    for p in procs:
        p.start()
    out = {}
    for _ in procs:
        rank, tp, ep, before, after = results.get(timeout=timeout)
        assert after is not None, before
        out[(rank, tp, ep)] = (before, after)
    for p in procs:
        p.join(timeout)
    return out


# ---- the sharded fast path against one rank, every layout in one pair of rank processes ----
# (tests/test_tp_fast_path.py: two ranks on one GPU over gloo, and the same body on the CPU)

REPO = Path(__file__).resolve().parents[1]
SMALL_MODEL = REPO / "serving" / "assets" / "small_model"
HELDOUT = REPO / "tests" / "data" / "small_heldout.txt"
LAYOUTS = ((2, 1), (1, 2), (2, 2))  # (tp, ep): world 2 each, so one process group serves all
# Rank 1 reads rank 0's slices (it computes rank 0's heads / experts a second time): wrong on
# purpose, to show the comparison fails.
WRONG_SHARDS = ((2, 1), (1, 2))
# Held-out text of three lengths; the 300-token one is past the small model's index_topk +
# index_kpool (272), so its later queries and its decode steps select pools sparsely.
FAST_PROMPT_LENS = (37, 300, 90)
FAST_DECODE_STEPS = 6


def layout_name(tp: int, ep: int) -> str:
    return f"tp{tp}ep{ep}"


def heldout_prompts(ckpt: Path) -> list[list[int]]:
    from tokenizers import Tokenizer

    from training.eval_small import heldout_texts

    tok = Tokenizer.from_file(str(Path(ckpt) / "tokenizer.json"))
    ids = [i for t in heldout_texts(HELDOUT) for i in tok.encode(t, add_special_tokens=False).ids]
    out, at = [], 0
    for n in FAST_PROMPT_LENS:
        out.append(ids[at : at + n])
        at += n
    assert [len(p) for p in out] == list(FAST_PROMPT_LENS), "held-out text too short"
    return out


@torch.inference_mode()
def greedy_run(
    ckpt: Path, device: str, fed=None, load_as=None, dtype: torch.dtype = torch.bfloat16
) -> dict:
    """One layout (the parallel state set by the caller) on `device` in `dtype`: the prefill's
    last-token logits of the three prompts (one ragged batch), then FAST_DECODE_STEPS decode
    steps of all three. Each step is fed `fed[step]` (one token per prompt; the reference's
    greedy tokens, so every layout sees the same context) or, when fed is None, this run's own
    greedy tokens (the reference). load_as: the ParallelState the weights are read under,
    when it is not the one the forward runs under (a wrong shard). Logits come back as float32
    on the CPU: {"prefill": [3, V], "decode": [[3, V]] * steps, "fed": [[3]] * steps, "s"}."""
    from serving.config import ModelConfig
    from serving.distributed import set_state, state
    from serving.models.loader import load_weights
    from serving.tools.generate import StepRunner

    t0 = time.monotonic()
    config = ModelConfig.from_pretrained(ckpt)
    running = state()
    if load_as is not None:
        set_state(load_as)
    try:
        model, _ = load_weights(ckpt, config, dtype, device)
    finally:
        set_state(running)
    runner = StepRunner(model, max_requests=4, max_context=512, device=device)
    prompts = heldout_prompts(ckpt)
    seqs = [runner.add(p) for p in prompts]
    logits = runner.step(seqs, [len(p) for p in prompts]).logits.float()
    out = {"prefill": logits.cpu(), "decode": [], "fed": []}
    for step in range(FAST_DECODE_STEPS):
        tokens = logits.argmax(-1).tolist() if fed is None else fed[step]
        for seq, t in zip(seqs, tokens):
            seq.tokens.append(t)
        out["fed"].append(tokens)
        logits = runner.step(seqs, [1] * len(seqs)).logits.float()
        out["decode"].append(logits.cpu())
    for seq in seqs:
        runner.release(seq)
    out["s"] = round(time.monotonic() - t0, 2)  # load + forwards (+ compiles on a cold cache)
    return out


def _layouts_main(rank, port, ckpt, device, out_path) -> None:
    from serving.distributed import ParallelState, destroy_parallel, init_parallel, set_state

    if device == "cuda":
        # Both ranks on GPU 0 (of what CUDA_VISIBLE_DEVICES shows): each process has its
        # own CUDA context there; their kernels time-share the device.
        torch.cuda.set_device(0)
    # gloo on CUDA too: NCCL refuses two ranks on one device (the test mode of init_parallel)
    init_parallel(rank, 2, 2, f"tcp://127.0.0.1:{port}", device, 300, backend="gloo")
    torch.set_num_threads(1)
    results = {}
    fed = [None]
    if rank == 0:  # the reference: one rank, no collective (rank 1 waits for its tokens)
        set_state(ParallelState())
        results["tp1"] = greedy_run(ckpt, device)
        fed = [results["tp1"]["fed"]]
        # bf16's own distance from float32 (the torch path on the CPU): the noise scale
        results["tp1_fp32_cpu"] = greedy_run(ckpt, "cpu", fed[0], dtype=torch.float32)
    dist.broadcast_object_list(fed, src=0)  # every layout is fed the reference's tokens
    for tp, ep in LAYOUTS:
        set_state(ParallelState(rank, tp, ep))
        results[layout_name(tp, ep)] = greedy_run(ckpt, device, fed[0])
    for tp, ep in WRONG_SHARDS:
        set_state(ParallelState(rank, tp, ep))
        wrong = ParallelState(0, tp, ep)
        results["wrong_" + layout_name(tp, ep)] = greedy_run(ckpt, device, fed[0], wrong)
    if rank == 0:
        torch.save(results, out_path)
    destroy_parallel()


def run_layouts(ckpt: Path, device: str, out_path: Path, timeout: float = 240.0) -> None:
    """Two rank processes on `device` (both on GPU 0 for "cuda") over gloo: rank 0 runs the
    one-rank reference ("tp1", and "tp1_fp32_cpu" fed the same tokens), then both run every
    layout of LAYOUTS and WRONG_SHARDS; rank 0 saves {name: greedy_run's result} to out_path."""
    ctx = mp.get_context("spawn")
    errors = ctx.Queue()
    port = free_port()
    args = (port, str(ckpt), device, str(out_path))
    procs = [
        ctx.Process(target=_reporting, args=(_layouts_main, r, errors, *args)) for r in range(2)
    ]
    _join(procs, errors, timeout)
