"""Weight rows prefetched into L2 at a decode kernel's start (Hopper's bulk L2 prefetch).

At batch 1 a decode kernel's weight read is a chain of dependent loads, not a stream of bytes:
a GEMV program keeps one or two K tiles in flight (kernels/triton/skinny_gemm.gemv_rows), so
the H200's rank-0 MoE gate/up took 20.6 us a layer for ~8 us of bytes, the dense projections
1.6-2x theirs. A program that first asks L2 for its whole weight slice (one
`cp.async.bulk.prefetch.L2` per row segment: the copy engine streams it, the threads go on)
puts every byte in flight at once; its loads then meet lines already in L2 or on their way.
Before the PDL wait (kernels/triton/pdl.py: weights are memory no kernel writes) the bytes
arrive while the previous kernel's last programs run.

A prefetch is a hint: it changes no result (the kernels' tests hold with it on or off), only
where the loads find their bytes. Rows are rounded out to 16 bytes (the instruction's alignment),
so a segment may also fetch up to 15 bytes on either side of it: harmless, a prefetch reads
nothing back and L2 lines are 128 bytes anyway. sm_90+ only, never under the interpreter.

Off (ENABLED; bench.fast_path --variant pf=kernels.triton.l2_prefetch.ENABLED=True): on the
H200's 45-layer FP8 rank (session 40, two processes) the decode step at batch 1 took 3.956 /
3.953 ms with it against 3.891 / 3.727 without, equal at 8 rows. Still to time: the bf16 rank,
whose MoE runs the GEMV form (the FP8 one's tl.dot gate/up grows from 96 to 138 registers
with it); dropped if it does not win there.
"""

from __future__ import annotations

import triton
import triton.language as tl

from kernels.triton import INTERPRETER
from kernels.triton.pdl import sm90

ENABLED = False
SUPPORTED = not INTERPRETER and sm90()  # the bulk prefetch is sm_90+ PTX


def prefetch_on() -> bool:
    """The PREFETCH constexpr of a launch (read at every call: a variant flips ENABLED)."""
    return ENABLED and SUPPORTED


@triton.jit
def _bulk_prefetch(start, end, live):
    # [start, end) rounded out to 16 bytes; `live` 0: nothing issued
    tl.inline_asm_elementwise(
        """{
        .reg .b64 a, e;
        .reg .b32 s;
        .reg .pred p;
        and.b64 a, $1, -16;
        add.s64 e, $2, 15;
        and.b64 e, e, -16;
        sub.s64 e, e, a;
        cvt.u32.u64 s, e;
        setp.ne.b32 p, $3, 0;
        @p cp.async.bulk.prefetch.L2.global [a], s;
        mov.u32 $0, 0;
        }""",
        "=r,l,l,r",
        [start, end, live],
        dtype=tl.int32,
        is_pure=False,
        pack=1,
    )


@triton.jit
def prefetch_tile(
    w_ptr,  # [N_ROWS, K] row-major weight
    n0,
    N_ROWS,
    K,
    k_lo,
    k_hi,
    BLOCK_N: tl.constexpr,
):
    """L2 prefetch of columns k_lo .. k_hi of rows n0 .. n0 + BLOCK_N (those below N_ROWS), one
    instruction a row. The rows are spread over a [BLOCK_N, LANES] tile as wide as 4 warps, so
    no thread holds a copy of another's row (a copy would issue the row twice); lane 0 of each
    row issues (the copy engine takes one thread's request at a time: ptxas loops over a warp's)."""
    LANES: tl.constexpr = max(1, 128 // BLOCK_N)
    n = n0 + tl.arange(0, BLOCK_N)
    lane = tl.arange(0, LANES)
    issue = (n < N_ROWS)[:, None] & (lane == 0)[None, :] & (k_lo < k_hi)
    rows = w_ptr + tl.minimum(n, N_ROWS - 1).to(tl.int64)[:, None] * K
    rows = rows + tl.zeros([BLOCK_N, LANES], dtype=tl.int64)
    _bulk_prefetch(rows + k_lo, rows + k_hi, issue.to(tl.int32))
