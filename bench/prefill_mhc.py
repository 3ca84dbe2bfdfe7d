"""The mHC boundary at prefill sizes (issue 44 point 4), rank 0 of TP8 on one GPU:

    python -m bench.prefill_mhc [--tokens 1024,8192] [--programs 528,1056,2112]
        [--finish-row 0,16384] [--stages 1,3]

One boundary, bf16 streams hc 4 x Hd 4096, fn [24, 16384] float32, 20 Sinkhorn iterations: the
old path (mhc_post, then mhc_pre: the streams read three times, written once) against
mhc_boundary_prefill (two launches; what mhc_boundary runs past BOUNDARY_MAX_TOKENS), and at
batches of up to BOUNDARY_MAX_TOKENS the fused one-launch boundary too (us_fused: where the
threshold between them belongs, `--tokens 4,8,16,32`). Each path captured in one CUDA graph over
copies of the inputs (fn included) adding up to twice the L2 (bench.decode_mhc_kda's timing);
us_* per call. floor_us: the boundary's HBM floor at prefill sizes, the old streams and `out`
read and the new streams and x written (fn's 1.5 MB left out), at HBM_BW; ratio: us_new /
floor_us (issue 44's target: 1.5).

--programs, --finish-row, --stages: values of kernels.triton.mhc's PREFILL_PROGRAMS (the split
count of the expansion's channels follows it), PREFILL_FINISH_ROW (16384: the finish loads a
token's whole row first; 0: two passes of 1024 channels after the Sinkhorn, as mhc_pre's) and
PREFILL_STAGES (the expansion's software pipelining) to sweep, every combination. One JSON line
per (tokens, programs, finish_row, stages).
"""

from __future__ import annotations

import argparse
import itertools
import json

import torch

from bench.decode_mhc_kda import HBM_BW, HC, HD, graph_us, n_copies

ITERS, EPS, NORM_EPS, RMS_EPS = 20, 1e-6, 1e-5, 1e-5


def inputs(tokens: int, gen: torch.Generator) -> dict:
    dev, dt = "cuda", torch.bfloat16
    mix = (2 + HC) * HC

    def rand(*shape, scale=1.0):
        return torch.randn(*shape, device=dev, generator=gen) * scale

    return dict(
        out=rand(tokens, HD).to(dt),
        streams=rand(tokens, HC, HD, scale=3.0).to(dt),
        post=torch.rand(tokens, HC, device=dev, generator=gen) * 2,
        comb=torch.rand(tokens, HC, HC, device=dev, generator=gen) * 0.5,
        fn=rand(mix, HC * HD, scale=(HC * HD) ** -0.5),
        base=rand(mix, scale=0.5),
        scale=torch.rand(3, device=dev, generator=gen) + 0.5,
        weight=(torch.rand(HD, device=dev, generator=gen) + 0.5).to(dt),
    )


def bench(tokens: int, programs: list[int], finish_row: list[int], stages: list[int]) -> None:
    from kernels.triton import mhc as tmhc

    gen = torch.Generator(device="cuda").manual_seed(tokens)
    floor_bytes = tokens * HD * 2 * (2 * HC + 2)  # streams in and out, out, x (bf16)
    fn_bytes = (2 + HC) * HC * HC * HD * 4
    copies = [inputs(tokens, gen) for _ in range(n_copies(floor_bytes + fn_bytes))]
    counter = torch.zeros(tmhc.BOUNDARY_MAX_TOKENS, dtype=torch.int32, device="cuda")

    def old(c):
        new = tmhc.mhc_post(c["out"], c["streams"], c["post"], c["comb"])
        args = (c["fn"], c["base"], c["scale"], ITERS, EPS, NORM_EPS, c["weight"], RMS_EPS)
        return tmhc.mhc_pre(new, *args)

    def new(c):
        args = (c["out"], c["streams"], c["post"], c["comb"], c["fn"], c["base"], c["scale"])
        return tmhc.mhc_boundary_prefill(*args, ITERS, EPS, NORM_EPS, c["weight"], RMS_EPS)

    def fused(c):
        args = (c["out"], c["streams"], c["post"], c["comb"], c["fn"], c["base"], c["scale"])
        return tmhc.mhc_boundary(*args, ITERS, EPS, NORM_EPS, c["weight"], RMS_EPS, counter)

    us_old = graph_us(old, copies)
    us_fused = graph_us(fused, copies) if tokens <= tmhc.BOUNDARY_MAX_TOKENS else None
    floor_us = floor_bytes / HBM_BW * 1e6
    defaults = tmhc.PREFILL_PROGRAMS, tmhc.PREFILL_FINISH_ROW, tmhc.PREFILL_STAGES
    try:
        for p, fr, st in itertools.product(programs, finish_row, stages):
            tmhc.PREFILL_PROGRAMS, tmhc.PREFILL_FINISH_ROW, tmhc.PREFILL_STAGES = p, fr, st
            us_new = graph_us(new, copies)
            print(
                json.dumps(
                    dict(
                        tokens=tokens,
                        programs=p,
                        finish_row=fr,
                        stages=st,
                        us_old=round(us_old, 2),
                        us_new=round(us_new, 2),
                        us_fused=us_fused and round(us_fused, 2),
                        floor_us=round(floor_us, 2),
                        ratio=round(us_new / floor_us, 3),
                    )
                ),
                flush=True,
            )
    finally:
        tmhc.PREFILL_PROGRAMS, tmhc.PREFILL_FINISH_ROW, tmhc.PREFILL_STAGES = defaults


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", default="1024,8192")
    parser.add_argument("--programs", default="528,1056,2112")
    parser.add_argument("--finish-row", default="0,16384")
    parser.add_argument("--stages", default="1,3")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench.prefill_mhc needs a CUDA device")
    for tokens in (int(t) for t in args.tokens.split(",")):
        ints = [
            [int(v) for v in a.split(",")] for a in (args.programs, args.finish_row, args.stages)
        ]
        bench(tokens, *ints)


if __name__ == "__main__":
    main()
