"""e4m3 rounding and per-group activation quantization inside Triton kernels: the code every
block-FP8 kernel quantizes with (kernels/triton/fp8.py: quantize_act and the GEMM's fused
quantization; kernels/triton/skinny_gemm.py), so their bits equal kernels.fp8.quantize_act's.

The scale is amax / 448 and the values x * (448 / amax), both quotients tl.math.div_rn (Triton's
`/` is an approximate division on CUDA); the values are rounded to nearest-even on the e4m3 grid
by hand before any cast, so GPU and TRITON_INTERPRET=1 (whose own fp32 -> fp8 cast truncates)
give the torch reference's bits.
"""

from __future__ import annotations

import triton
import triton.language as tl

from kernels.fp8 import AMAX_FLOOR, FP8_MAX

AMAX_FLOOR_C = tl.constexpr(AMAX_FLOOR)
FP8_MAX_C = tl.constexpr(FP8_MAX)


@triton.jit
def round_e4m3(q):
    """q (fp32, |q| <= 448) rounded to nearest-even on the e4m3 grid: 3 mantissa bits, steps
    of 2^(e-3) for exponent e >= -6 and 2^-9 below (subnormals). Exact in fp32."""
    bits = q.to(tl.int32, bitcast=True)
    e = tl.maximum(((bits >> 23) & 0xFF) - 127, -6)
    step = ((e + 124) << 23).to(tl.float32, bitcast=True)  # 2^(e-3)
    inv = ((130 - e) << 23).to(tl.float32, bitcast=True)  # 2^(3-e)
    r = q * inv  # exact (a power of two): an fma contraction with the add below is harmless
    r = (r + 12582912.0) - 12582912.0  # 1.5 * 2^23: round to nearest-even integer
    return r * step


@triton.jit
def quant_rows(x):
    """x [R, C] fp32, each row one group (entries past the group are 0): (the e4m3 values as
    fp32, the scales [R]), as kernels.fp8.quantize_act."""
    amax = tl.maximum(tl.max(tl.abs(x), axis=1), AMAX_FLOOR_C)
    fp8_max = tl.zeros_like(amax) + FP8_MAX_C
    inv = tl.math.div_rn(fp8_max, amax)
    q = tl.minimum(tl.maximum(x * inv[:, None], -FP8_MAX_C), FP8_MAX_C)
    return round_e4m3(q), tl.math.div_rn(amax, fp8_max)
