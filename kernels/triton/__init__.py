"""Triton implementations of kernels/ references (same signatures, CUDA or TRITON_INTERPRET)."""
