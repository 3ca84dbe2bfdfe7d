"""The online-softmax update the sparse attention kernels share (sparse_mla, dsa_decode's split
attention, sparse_mla_union): one block of scores and its value rows folded into each row's
running max m, sum l and [rows, R] accumulator, all fp32.

Inlined by Triton into each kernel. Checked when it was factored out (sm_90a, serving's
configurations): the PTX is what each kernel compiled to with the update written out, but for
debug line info; the SASS too, but for ptxas renaming 3 registers in the fp32 (tests-only) union.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def online_softmax_update(s, v, m_i, l_i, acc, DOT_PREC: tl.constexpr):
    """s: [M, N] fp32 scores in the log2 domain (scale * log2(e) applied), -inf where a key is
    masked; v: [N, R] the keys' value rows. Returns (m, l, acc), l and acc not normalised
    (out = acc / l where l > 0; log2-sum-exp = m + log2(l)).

    A row whose keys are all masked so far has m = -inf: m_safe stands in 0 so that no
    exp2(-inf - -inf) = NaN appears, and its l and acc stay 0. P is rounded to v's dtype before
    P @ V, like the reference's softmax(...).to(dtype)."""
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PREC)
    return m_new, l_i, acc
