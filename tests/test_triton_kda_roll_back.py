"""EAGLE's KDA roll-back in one launch (kernels/triton/kda_roll_back.py) against the torch
references (serving/speculative/kda_history.py's restore_kda_states on the torch path): every
layer's recurrent and conv state at each request row set to the ones after its last accepted
verify position; rows not in the batch untouched; the table of addresses reused by a second
roll-back from the same verify outputs (a graph replay) with other positions. The CPU cases run
the kernel under Triton's interpreter (TRITON_INTERPRET=1)."""

from __future__ import annotations

import os

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

import kernels  # noqa: E402
from serving.memory.cache import KDALayerCache  # noqa: E402
from serving.speculative.graphs import Verified  # noqa: E402
from serving.speculative.kda_history import restore_kda_states  # noqa: E402
from tests.triton_interp import patch_triton_interpreter  # noqa: E402

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
if INTERPRET:
    patch_triton_interpreter()


class _Cache:
    """The slice of ModelCache restore_kda_states reads: kda(layer)."""

    def __init__(self, layers: dict[int, KDALayerCache]) -> None:
        self.layers = layers

    def kda(self, layer: int) -> KDALayerCache:
        return self.layers[layer]


def _case(device, conv_dtype, heads=2, dk=8, dv=16, width=3, positions=3, batch=3, rows=6):
    """Caches of three KDA layers (ids 0, 2, 5: a hybrid model's) and one verify's history."""
    gen = torch.Generator().manual_seed(0)

    def rand(*shape, dtype=torch.float32):
        return torch.randn(*shape, generator=gen).to(device=device, dtype=dtype)

    chans = 3 * heads * dk
    layers, history = {}, {}
    for layer in (0, 2, 5):
        layers[layer] = KDALayerCache(
            conv=rand(rows, chans, width, dtype=conv_dtype), state=rand(rows, heads, dk, dv)
        )
        history[layer] = [
            rand(batch, chans, width + positions, dtype=conv_dtype),
            rand(batch, positions, heads, dk, dv),
        ]
    verified = Verified(torch.empty(0), torch.empty(0), torch.empty(0), history, batch=None)
    return _Cache(layers), verified


def _copy(cache: _Cache) -> _Cache:
    return _Cache(
        {i: KDALayerCache(c.conv.clone(), c.state.clone()) for i, c in cache.layers.items()}
    )


def _check(device, conv_dtype):
    """Two roll-backs from one verify's outputs (a replay), each on the fast path and on the
    torch path, on a copy of the caches each; the second reuses the first's table, a third on
    other caches makes its own."""
    cache, verified = _case(device, conv_dtype)
    fast, ref = _copy(cache), _copy(cache)
    rows = torch.tensor([4, 1, 3], device=device)
    tables = []
    for last in ([2, 0, 1], [0, 1, 2]):
        last = torch.tensor(last, device=device)
        restore_kda_states(fast, verified, rows, last)
        tables.append(verified.kda_table)
        with kernels.torch_path():
            restore_kda_states(ref, verified, rows, last)
        for layer, want in ref.layers.items():
            got = fast.layers[layer]
            assert torch.equal(got.state, want.state) and torch.equal(got.conv, want.conv), layer
            untouched = [0, 2, 5]  # rows not in the batch keep their states
            assert torch.equal(got.state[untouched], cache.layers[layer].state[untouched])
            assert not torch.equal(got.state[rows], cache.layers[layer].state[rows])
    assert tables[0] is tables[1], "the same outputs and caches: the table is reused"
    other = _copy(cache)
    restore_kda_states(other, verified, rows, last)
    assert verified.kda_table is not tables[0], "other caches: a table of their own"
    for layer, want in ref.layers.items():
        assert torch.equal(other.layers[layer].state, want.state), layer


@pytest.mark.skipif(not INTERPRET, reason="CPU cases need TRITON_INTERPRET=1")
@pytest.mark.parametrize("conv_dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_kda_roll_back_interpreter(conv_dtype, monkeypatch):
    monkeypatch.setattr(kernels, "INTERPRETED", True)  # the fast path on CPU tensors
    _check("cpu", conv_dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("conv_dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_kda_roll_back_gpu(conv_dtype):
    _check("cuda", conv_dtype)
