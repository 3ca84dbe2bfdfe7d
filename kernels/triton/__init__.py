"""Triton kernels (and fla-core wrappers) with the same signatures as the torch references one
level up; imported only on CUDA machines (or under TRITON_INTERPRET=1 in tests)."""
