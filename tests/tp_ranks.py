"""Helpers that run one TP/EP rank in a spawned process (tests/test_tp.py)."""

from __future__ import annotations

import multiprocessing as mp
import socket
import traceback
from pathlib import Path

import torch

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


def _rank_main(rank, tp, ep, port, ckpt, out_path, errors) -> None:
    try:
        from serving.distributed import destroy_parallel, init_parallel

        init_parallel(rank, tp, ep, f"tcp://127.0.0.1:{port}", "cpu", timeout_s=120)
        torch.set_num_threads(1)
        logits = scenario(ckpt)
        if rank == 0:
            torch.save(logits, out_path)
        destroy_parallel()
    except BaseException:
        errors.put(f"rank {rank}: {traceback.format_exc()}")
        raise


def run_ranks(ckpt: Path, tp: int, ep: int, out_path: Path, timeout: float = 180.0) -> None:
    """Run `scenario` on max(tp, ep) gloo ranks; rank 0 saves its logits to out_path."""
    ctx = mp.get_context("spawn")
    errors = ctx.Queue()
    port = free_port()
    world = max(tp, ep)
    procs = [
        ctx.Process(target=_rank_main, args=(r, tp, ep, port, str(ckpt), str(out_path), errors))
        for r in range(world)
    ]
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
