"""Triton kernels (and fla-core wrappers) with the same signatures as the torch references one
level up; imported only on CUDA machines (or under TRITON_INTERPRET=1 in tests)."""

import os

# Triton's interpreter (TRITON_INTERPRET=1, set before Triton's import: it decides at each
# kernel's definition): no num_stages, programs run one at a time in order
INTERPRETER = os.environ.get("TRITON_INTERPRET") == "1"
