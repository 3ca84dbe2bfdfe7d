"""The interpreter's bounds check (tests/triton_interp._check_bounds): an interpreted kernel that
loads, stores or adds atomically outside its tensor arguments' storages fails its launch, so the
interpreter pass finds the accesses that fault compiled on a GPU. Lanes masked off are not
accesses, and a view may read its storage past the view (as a GPU would, without a fault)."""

from __future__ import annotations

import os

import pytest

torch = pytest.importorskip("torch")
triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402

from tests.triton_interp import patch_triton_interpreter  # noqa: E402

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
pytestmark = pytest.mark.skipif(not INTERPRET, reason="the check is the interpreter's")
if INTERPRET:
    patch_triton_interpreter()


@triton.jit
def _shift_kernel(x_ptr, out_ptr, n, shift, ATOMIC: tl.constexpr, MASKED: tl.constexpr,
                  BLOCK: tl.constexpr):  # fmt: skip
    i = tl.arange(0, BLOCK)
    mask = (i + shift < n) & (i + shift >= 0) if MASKED else i < n
    x = tl.load(x_ptr + i + shift, mask=mask, other=0)
    if ATOMIC:
        tl.atomic_add(out_ptr + i + shift, x, mask=mask)
    else:
        tl.store(out_ptr + i + shift, x, mask=mask)


def _run(n, shift, atomic=False, masked=False, view=None):
    x = torch.arange(n, dtype=torch.int32)
    out = torch.zeros(n, dtype=torch.int32)
    if view is not None:
        x, out = x[view], out[view]
    _shift_kernel[(1,)](x, out, x.numel(), shift, atomic, masked, 16)
    return out


@pytest.mark.parametrize("atomic", [False, True])
def test_in_bounds_and_masked_accesses_pass(atomic):
    assert _run(16, 0, atomic).tolist() == list(range(16))
    # shifted past both ends, every such lane masked off
    assert _run(16, 5, atomic, masked=True).tolist() == [0] * 5 + list(range(5, 16))
    assert _run(16, -3, atomic, masked=True).tolist() == list(range(13)) + [0] * 3
    # a view reads its storage past the view's own elements: inside the allocation
    assert _run(32, 8, view=slice(0, 16)).tolist() == [0] * 8 + list(range(8, 16))


@pytest.mark.parametrize("shift", [1, -1, 4096])
def test_out_of_bounds_access_fails(shift):
    with pytest.raises(Exception, match="_shift_kernel: load of .* outside every tensor"):
        _run(16, shift)


def test_out_of_bounds_store_and_atomic_fail():
    # the load stays inside x's storage (a view of 32), the store leaves out's (16 elements)
    x = torch.arange(32, dtype=torch.int32)
    for atomic, access in ((False, "store"), (True, "atomic")):
        out = torch.zeros(16, dtype=torch.int32)
        with pytest.raises(Exception, match=f"{access} of 2 of 16 elements outside"):
            _shift_kernel[(1,)](x, out, 16, 2, atomic, False, 16)
