"""Per-CPU host speed of this machine, with the measuring thread pinned to each CPU in turn: a
fixed pure-Python loop (bench.prefix_cache.python_loop_ms), and on CUDA 2,000 small kernel
launches and 300 device-to-host copies of 64 KiB into pageable memory (what Mooncake's TCP
transport does per slice). One JSON object by CPU on stdout.

    python3 -m bench.host_probe

Why: the H200 machine's virtual CPUs differ up to 1.8x in host speed, which ones changing from
machine to machine (docs/BENCHMARKS.md, the prefix cache's third H200 run).
"""

from __future__ import annotations

import json
import os
import time

import torch

from bench.prefix_cache import python_loop_ms


def probe_cpu() -> dict:
    out = {"loop_ms": python_loop_ms()}
    if torch.cuda.is_available():
        x = torch.zeros(16, device="cuda")
        src = torch.zeros(65536, dtype=torch.uint8, device="cuda")
        host = torch.empty(65536, dtype=torch.uint8)  # pageable, as Mooncake's staging
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(2000):
            x.add_(1)
        out["launch_us"] = round((time.perf_counter() - t) / 2000 * 1e6, 2)
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(300):
            host.copy_(src)
        out["d2h_64k_us"] = round((time.perf_counter() - t) / 300 * 1e6, 1)
    return out


def main() -> None:
    report = {}
    for cpu in sorted(os.sched_getaffinity(0)):
        os.sched_setaffinity(0, {cpu})
        report[cpu] = probe_cpu()
    print(json.dumps(report))


if __name__ == "__main__":
    main()
