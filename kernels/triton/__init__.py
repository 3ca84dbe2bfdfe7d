"""Triton implementations of kernels/ references, with the references' signatures.

moe.experts is the fused MoE (align on device, grouped gate/up GEMM with SwiGLU, down GEMM with
the routing weight, combine); kda wires fla-core's KDA kernels (chunked and fused recurrent) and
a small Triton causal conv to kernels.kda's signatures. Importing these modules needs triton;
kda imports fla lazily inside its functions.
"""
