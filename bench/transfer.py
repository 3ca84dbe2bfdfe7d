"""KV handoff cost: the transfer alone (no forward), beside raw Mooncake bandwidth, same run.

    python -m bench.transfer [--presets tiny bench] [--device cuda] [--inflight 1 4]

Two processes on loopback, each with a real MemoryPool shaped by the model config and the real
Mooncake engine. For each prompt length the prefill side sends what a finished request sends:
its KV pages of every page buffer (runs merged) plus its request-state rows and aux row, as one
batch, exactly as workers/prefill.py does. The raw figure is one contiguous write of the same
number of bytes between the same two engines. With --inflight K, K such batches are submitted
at once (Mooncake's async writes) and waited for in order: `inflight_GiBps` is their bytes over
the time until the last is done (H200, session 7: no gain over one at a time, so the PD sender,
workers/rank_transfer.py, writes one job at a time). --device cuda puts both pools in GPU memory
(Mooncake's TCP transport then stages each slice through the host; MC_TCP_SLICE_SIZE sets the
slice, workers/transfer_engine.py its default).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import time

import torch

from serving.config import ModelConfig
from serving.memory.pool import MemoryPool, PoolPlan
from serving.tools.tiny_model import COMMON, PRESETS
from workers.kv_layout import page_buffers, page_writes, row_buffers, row_writes
from workers.transfer_engine import MooncakeEngine

PAGE_SIZE = 64
MAX_TOKENS = 4096 + PAGE_SIZE


def pool_for(config: ModelConfig, dtype: torch.dtype, device: str) -> MemoryPool:
    plan = PoolPlan(
        rows=2,
        pages=MAX_TOKENS // PAGE_SIZE + 1,
        page_size=PAGE_SIZE,
        max_context=MAX_TOKENS,
        with_draft=config.num_nextn_predict_layers > 0,
    )
    return MemoryPool(config, plan, dtype, device)


def raw_size(config: ModelConfig, dtype: torch.dtype) -> int:
    pool = pool_for(config, dtype, "cpu")
    return sum(b.nbytes for b in page_buffers(pool) + row_buffers(pool))


def target_side(config_raw: dict, dtype_name: str, device: str, conn) -> None:
    config, dtype = ModelConfig.from_dict(config_raw), getattr(torch, dtype_name)
    pool = pool_for(config, dtype, device)
    engine = MooncakeEngine("127.0.0.1", None)
    pages, rows = page_buffers(pool), row_buffers(pool)
    scratch = torch.empty(raw_size(config, dtype), dtype=torch.uint8, device=device)
    engine.register(
        [(b.addr, b.nbytes) for b in pages + rows] + [(scratch.data_ptr(), scratch.numel())]
    )
    conn.send(
        (engine.session_id, [b.addr for b in pages], [b.addr for b in rows], scratch.data_ptr())
    )
    conn.recv()  # hold the memory until the initiator is done


def measure(
    config_raw: dict, dtype_name: str, lengths: list[int], repeats: int, device: str,
    inflight: list[int],
) -> list[dict]:  # fmt: skip
    config, dtype = ModelConfig.from_dict(config_raw), getattr(torch, dtype_name)
    parent, child = mp.Pipe()
    proc = mp.get_context("spawn").Process(
        target=target_side, args=(config_raw, dtype_name, device, child)
    )
    proc.start()
    session, page_addrs, row_addrs, scratch_addr = parent.recv()
    pool = pool_for(config, dtype, device)
    for _, t in pool.target.tensors():
        if t.is_floating_point():
            t.normal_()  # real bytes, not zeros
    engine = MooncakeEngine("127.0.0.1", None)
    pages, rows = page_buffers(pool), row_buffers(pool)
    source = torch.randint(0, 255, (raw_size(config, dtype),), dtype=torch.uint8, device=device)
    engine.register(
        [(b.addr, b.nbytes) for b in pages + rows] + [(source.data_ptr(), source.numel())]
    )
    out = []
    try:
        for n in lengths:
            ids = list(range(1, pool.pages.pages_for(n) + 1))
            srcs, dsts, lens = page_writes(pages, page_addrs, ids, ids)
            r = row_writes(rows, row_addrs, 1, 1)
            srcs, dsts, lens = srcs + r[0], dsts + r[1], lens + r[2]
            total = sum(lens)
            engine.write(session, srcs, dsts, lens)  # warm-up (opens the segment)
            times = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                engine.write(session, srcs, dsts, lens)
                times.append(time.perf_counter() - t0)
            handoff = statistics.median(times)
            raw_times = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                engine.write(session, [source.data_ptr()], [scratch_addr], [total])
                raw_times.append(time.perf_counter() - t0)
            raw = statistics.median(raw_times)
            in_flight = {}
            for k in inflight:
                runs = []
                for _ in range(repeats):
                    t0 = time.perf_counter()
                    for batch in [engine.write_async(session, srcs, dsts, lens) for _ in range(k)]:
                        engine.wait(batch)
                    runs.append(time.perf_counter() - t0)
                in_flight[k] = round(k * total / statistics.median(runs) / 2**30, 3)
            out.append(
                {
                    "prompt_tokens": n,
                    "bytes": total,
                    "pieces": len(srcs),
                    "handoff_ms": round(handoff * 1000, 3),
                    "handoff_GiBps": round(total / handoff / 2**30, 3),
                    "raw_same_bytes_GiBps": round(total / raw / 2**30, 3),
                    "ratio_to_raw": round(raw / handoff, 3),
                    "inflight_GiBps": in_flight,
                }
            )
    finally:
        parent.send("done")
        proc.join()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--presets", nargs="+", default=["tiny", "bench"])
    ap.add_argument("--lengths", type=int, nargs="+", default=[128, 1024, 4096])
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--json", default=None)
    ap.add_argument("--device", default="cpu", help="where both pools live (cpu | cuda)")
    ap.add_argument(
        "--inflight", type=int, nargs="+", default=[1, 4], help="async writes in flight at once"
    )
    args = ap.parse_args()
    results = {}
    for preset in args.presets:
        raw = {**COMMON, **PRESETS[preset]}
        dtype = raw.pop("dtype")
        results[preset] = measure(
            raw, dtype, args.lengths, args.repeats, args.device, args.inflight
        )
        for row in results[preset]:
            print(json.dumps({"preset": preset, "device": args.device, **row}), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
