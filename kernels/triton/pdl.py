"""Programmatic dependent launch (PDL, Hopper and later) for the decode path's Triton kernels.

A decode step at batch 1 is ~500 short kernels, each of a few microseconds, and the graph's
replay leaves a gap before each. With PDL a kernel is launched while the one before it still
runs: its programs are scheduled and wait in `grid_dependency()` until the previous kernel has
completed and its writes are visible, so the launch and scheduling latency overlaps the
previous kernel's tail instead of following it.

On by default where the GPU has it (compute capability 9.0+; read once, at import);
PDSERVE_PDL=0 turns it off. On, the kernels below are launched with `launch_pdl=True` (LAUNCH)
and begin with grid_dependency(). Off (and on CPU), both are no-ops and the kernels compile
exactly as without PDL (the interpreter ignores the launch option). Measured on the H200 (docs/
BENCHMARKS.md, real-size rank): the decode step 3.6-4.5% shorter, and the GPU suite passes
with it on.

Invariant (why waiting first is always safe): a kernel launched with PDL executes nothing of
its own before grid_dependency() returns, and that waits for the complete previous grid with
its memory flushed. So neither a read-after-write nor a write-after-read can cross it, whatever
the previous kernel is; a previous kernel launched without PDL (cuBLAS, torch's own) simply
never lets the next one start early. It also signals at once that its own dependents may
launch: they wait in their own grid_dependency(). Hazard: a kernel launched with LAUNCH must
call grid_dependency() before it reads or writes anything a kernel writes; one that does not
races its predecessor.

One exception: loads of memory no kernel writes during a forward, the weights, may come before
the wait, so their latency overlaps the previous kernel's tail (the skinny GEMM's GEMV form, the
mHC boundary's fn, the router's first tile). (A weight converted by the kernel just before is no
exception to this: torch's kernels never trigger early launch, so what follows one starts after
it ends.) And one widening of it: when a PDL kernel starts, only the kernel right before it may
still run (that one let it launch only after its own wait, so every kernel before that has
completed), so memory that kernel never writes may be read before the wait too: the KDA
decode core reads the layer's conv and recurrent state there (no kernel but the core itself,
one step back, writes them; the kernel before it is the layer's input projection), and the mHC
boundary at one token a block the streams, post and comb of the boundary before (the kernel
before it is its sublayer's last, which writes only the sublayer's output). Nothing
else may: the previous grid may still be writing its outputs. (A TP all-reduce between them is
an NCCL kernel, launched without PDL: what follows it starts after it ends.)
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait


def sm90() -> bool:
    # griddepcontrol is sm_90+ PTX: an older GPU would fail to compile the kernels.
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9


ENABLED = os.environ.get("PDSERVE_PDL", "1") != "0" and sm90()
_ON = tl.constexpr(ENABLED)
# the launch option of every kernel that begins with grid_dependency()
LAUNCH = {"launch_pdl": True} if ENABLED else {}


@triton.jit
def grid_dependency():
    """First statement of a PDL kernel: wait for the previous grid, let the next one launch."""
    if _ON:
        gdc_wait()
        gdc_launch_dependents()
