"""Kernel-shaped operations of the GLM-5.3-Flash model.

Each module holds the plain-torch reference of one operation. The model calls these functions
only, so a Triton implementation with the same signature can replace a reference without
touching the model. Shapes use T = tokens in the batch, B = requests, H = heads.

Hazard: the Hugging Face hub package `kernels` shares this import name. transformers probes it
with find_spec plus a distribution-version check (it wants 0.16 <= version < 0.17); our
distribution is `pdserve` with a version outside that window and this package has no
`__version__`, so transformers treats hub kernels as absent.
tests/test_nextn_and_tiny.py::test_transformers_ignores_our_kernels_package holds
that line.
"""

import contextlib
import os

import torch

# PDSERVE_TORCH_KERNELS=1 keeps the torch references on CUDA too: the oracle a fast path is
# compared with, and the "before" of the benchmarks.
TORCH_ONLY = os.environ.get("PDSERVE_TORCH_KERNELS") == "1"


@contextlib.contextmanager
def torch_path():
    """Run the block on the torch references, as PDSERVE_TORCH_KERNELS=1 does: the oracle, and
    the only path with backward passes. Not thread-safe (one module flag)."""
    global TORCH_ONLY
    before, TORCH_ONLY = TORCH_ONLY, True
    try:
        yield
    finally:
        TORCH_ONLY = before


# The fast path on CPU tensors too, every Triton kernel interpreted: only under
# TRITON_INTERPRET=1 (slow: tiny models). tests/test_interpreted_fast_path.py sets it to hold the
# whole model's fast path to the torch path on a CPU; PDSERVE_INTERPRET_FAST_PATH=1 sets it at
# import (bench.launch_count).
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1" and (
    os.environ.get("PDSERVE_INTERPRET_FAST_PATH") == "1"
)


def fast_path(t: torch.Tensor) -> bool:
    """Whether ops on `t` run the Triton / fla-core kernels of kernels/triton/ (CUDA, or CPU
    tensors under INTERPRETED)."""
    return (t.is_cuda or INTERPRETED) and not TORCH_ONLY
