"""Triton kernels with the same signatures as the torch references one level up."""
