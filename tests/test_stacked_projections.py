"""serving/layers/stacked_projections.py: a layer's projections of one input run as one GEMM
per run of parts (the dense ones; the block-FP8 ones, scales stacked with them) over their
stacked weights, with the same outputs as the parts run one by one; the fallbacks (storage
replaced after stacking, training, row-split parts) run the parts one by one. The FP8 stacks
on the GPU kernels: tests/test_triton_skinny_gemm.py."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kernels.fp8 import quantize_weight
from serving.config import ModelConfig
from serving.layers.linear import Linear
from serving.layers.stacked_projections import StackedProjections, _weight, stack_runs, stacked_rows
from serving.models.loader import load_weights


def _stacks(model: nn.Module) -> list[StackedProjections]:
    values = [v for m in model.modules() for v in vars(m).values()]
    return [v for v in values if isinstance(v, StackedProjections)]


def _one_by_one(stack: StackedProjections, x: torch.Tensor) -> list[torch.Tensor]:
    out = []
    for name in stack.names:
        part = stack._part(name)
        w = part.weight if isinstance(part, Linear) else part
        out.append(F.linear(x, w.detach().clone()))  # a copy: not a view of the stack
    return out


def test_every_stack_equals_its_parts_and_trains_through_them(tiny_ckpt):
    config = ModelConfig.from_pretrained(tiny_ckpt)
    target, draft = load_weights(str(tiny_ckpt), config, torch.float32, "cpu", load_draft=True)
    stacks = _stacks(target) + _stacks(draft)
    kinds = {s.names[0] for s in stacks}
    # KDA, MLA + indexer from x and from q_lora, MLPs
    assert {"q_proj", "q_a_proj", "q_b_proj", "gate_proj"} <= kinds, kinds
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(5, config.hidden_size, generator=gen)
    for stack in stacks:
        # one part (a layer without an indexer: q_b alone) runs as it is
        want_parts = [list(range(len(stack.names)))] if len(stack.names) > 1 else []
        assert [g.parts for g in stack.gemms] == want_parts, stack.names
        x = torch.randn(5, _weight(stack._part(stack.names[0])).shape[1], generator=gen)
        with torch.no_grad():
            got = stack(x)
        want = _one_by_one(stack, x)
        assert [g.shape for g in got] == [w.shape for w in want]
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)

    # training: gradients reach every part's own parameter
    stack = stacks[0]
    x = torch.randn(5, config.hidden_size, generator=gen)
    params = [stack._part(n) for n in stack.names]
    params = [p.weight if isinstance(p, Linear) else p for p in params]
    for p in params:
        p.requires_grad_(True)
    sum(y.sum() for y in stack(x)).backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in params)
    for p in params:
        p.requires_grad_(False)

    # storage replaced after stacking (module.to): the stale stack is not used
    target.to(torch.float64)
    stack = _stacks(target)[0]
    with torch.no_grad():
        got = stack(x.double())
    for g, w in zip(got, _one_by_one(stack, x.double())):
        torch.testing.assert_close(g, w)


def test_row_split_parts_do_not_stack():
    owner = nn.Module()
    owner.b = Linear(256, 128, torch.bfloat16)
    owner.c = Linear(256, 128, torch.bfloat16)
    owner.c.split = "row"  # a partial sum needs its all-reduce after the GEMM
    assert StackedProjections(owner, ("b", "c")).stack() is False
    stack = StackedProjections(owner, ("b",))
    assert stack.stack() is False and not stack.gemms  # one part: nothing to stack


def test_stack_runs():
    kda = [1024, 1024, 1024, 128, 128, 8]
    assert stack_runs(kda, [True] * 6) == [[0, 1, 2, 3, 4, 5]]
    assert stacked_rows(kda, fp8=True) == 3344 and stacked_rows(kda, fp8=False) == 3336
    # MLA q_a, kv_a and the indexer's wk in FP8; the kpool gate and weights_proj dense
    assert stack_runs([1536, 512, 128, 128, 4], [True, True, True, False, False]) == [
        [3, 4],
        [0, 1, 2],
    ]
    # a part that ends inside a scale block closes its run (a small model's 64-row q/k/v)
    assert stack_runs([64, 64, 128, 128], [True] * 4) == [[0], [1], [2, 3]]
    assert stack_runs([200, 128], [True, True]) == [[0], [1]]
    assert stacked_rows([64], fp8=True) == 64  # one part runs as it is


def _fp8_part(owner: nn.Module, name: str, rows: int, k: int, gen, kind="kda") -> None:
    part = Linear(k, rows, torch.float32, kind=kind)
    part.weight.data = torch.randn(rows, k, generator=gen) * k**-0.5
    w8, scale = quantize_weight(part.weight.data)
    part.hold_fp8()
    part.weight.data.copy_(w8)
    part.weight_scale_inv.data.copy_(scale)
    setattr(owner, name, part)


def test_fp8_parts_stack_with_their_scales():
    """KDA-like and DSA-like stacks at TP8's row counts on the CPU references (W8A8 in float32):
    FP8 parts in one GEMM (KDA's stack padded from 3336 to 3344 rows), the dense parts in
    another; each part's output equals it run alone, its parameters are views of the stacks,
    and fp8_choice times each part at its stack's shape."""
    from serving.models.fp8_choice import linear_shape

    gen = torch.Generator().manual_seed(0)
    k = 384
    kda = nn.Module()
    for name, rows in zip(("q", "k", "v", "f_a", "g_a", "b"), (1024, 1024, 1024, 128, 128, 8)):
        _fp8_part(kda, name, rows, k, gen)
    kda.f_b = Linear(128, 1024, torch.float32, kind="kda")  # not a part: its own shape
    stack = StackedProjections(kda, ("q", "k", "v", "f_a", "g_a", "b"))
    assert linear_shape(kda.q) == linear_shape(kda.b) == (3344, k)
    assert linear_shape(kda.f_b) == (1024, 128)
    assert linear_shape(kda.q, lambda part: part is not kda.b) == (3328, k)

    dsa = nn.Module()
    _fp8_part(dsa, "q_a", 1536, k, gen, kind="mla")
    _fp8_part(dsa, "kv_a", 512, k, gen, kind="mla")
    dsa.indexer = nn.Module()
    _fp8_part(dsa.indexer, "wk", 128, k, gen, kind="indexer")
    dsa.indexer.gate = nn.Parameter(torch.randn(128, k, generator=gen), requires_grad=False)
    dsa.indexer.weights_proj = Linear(k, 4, torch.float32)
    dsa.indexer.weights_proj.weight.data = torch.randn(4, k, generator=gen)
    names = ("q_a", "kv_a", "indexer.wk", "indexer.gate", "indexer.weights_proj")
    dsa_stack = StackedProjections(dsa, names)
    assert linear_shape(dsa.q_a) == (2176, k)
    assert linear_shape(dsa.q_a, lambda part: part.kind == "mla") == (2048, k)  # keep indexer

    x = torch.randn(7, k, generator=gen)
    for owner, s in ((kda, stack), (dsa, dsa_stack)):
        alone = [p(x) if isinstance(p, Linear) else F.linear(x, p) for p in map(s._part, s.names)]
        assert s.stack() is True
        fp8_gemm = next(g for g in s.gemms if g.scale is not None)
        assert fp8_gemm.weight.shape[0] == (3344 if owner is kda else 2176)
        for i in fp8_gemm.parts:
            part = s._part(s.names[i])
            assert part.weight.untyped_storage().data_ptr() == fp8_gemm.weight.data_ptr()
            assert part.weight_scale_inv.untyped_storage().data_ptr() == (fp8_gemm.scale.data_ptr())
        with torch.no_grad():
            got = s(x)
        for name, g, a in zip(s.names, got, alone):
            torch.testing.assert_close(g, a, rtol=1e-5, atol=1e-5, msg=name)
    assert [g.parts for g in dsa_stack.gemms] == [[3, 4], [0, 1, 2]]
    assert [g.parts for g in stack.gemms] == [[0, 1, 2, 3, 4, 5]]
