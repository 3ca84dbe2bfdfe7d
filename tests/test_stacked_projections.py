"""serving/layers/linear.py StackedProjections: a layer's projections of one input run as one
GEMM over their stacked weights (one per way the parts are held: dense, block FP8), with the
same outputs as the parts run one by one; the fallbacks (storage replaced after stacking,
training, a part that needs a collective) run the parts one by one."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from serving.config import ModelConfig
from serving.layers.linear import Linear, StackedProjections
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
    assert {"q_proj", "q_a_proj", "gate_proj"} <= kinds, kinds  # KDA, MLA + indexer, MLPs
    x = torch.randn(5, config.hidden_size, generator=torch.Generator().manual_seed(0))
    for stack in stacks:
        assert [len(s.index) for s in stack.stacks] == [len(stack.names)], stack.names
        with torch.no_grad():
            got = stack(x)
        want = _one_by_one(stack, x)
        assert [g.shape for g in got] == [w.shape for w in want]
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)

    # training: gradients reach every part's own parameter
    stack = stacks[0]
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


def _fp8_linear(rows: int, gen: torch.Generator) -> Linear:
    from kernels.fp8 import quantize_weight

    linear = Linear(256, rows, torch.float32)
    w8, scale = quantize_weight(torch.randn(rows, 256, generator=gen) / 16)
    linear.hold_fp8()
    with torch.no_grad():
        linear.weight.copy_(w8)
        linear.weight_scale_inv.copy_(scale)
    return linear


def test_fp8_parts_stack_with_their_scales_and_apart_from_dense_ones():
    """KDA's in_proj as the timed FP8 choice holds it: q/k/v in block FP8 (multiples of 128
    rows), the small ones dense; as --fp8-linears all does, every part FP8 with a partial last
    block. Each kind stacks alone; the outputs equal the parts one by one (W8A8 references)."""
    gen = torch.Generator().manual_seed(0)
    owner = nn.Module()
    x = torch.randn(3, 256, generator=gen)
    names = ("q", "k", "v", "f_a", "g_a", "b")
    for all_fp8 in (False, True):
        for name, rows in zip(names, (256, 128, 256, 128, 128, 8)):
            small = name in ("f_a", "g_a", "b")
            if small and not all_fp8:
                part = Linear(256, rows, torch.float32)
                part.weight.data = torch.randn(rows, 256, generator=gen) / 16
            else:
                part = _fp8_linear(rows, gen)
            setattr(owner, name, part)
        with torch.no_grad():
            want = [getattr(owner, n)(x) for n in names]
            stack = StackedProjections(owner, names)
            assert stack.stack() is True
            assert [s.index for s in stack.stacks] == (
                [list(range(6))] if all_fp8 else [[0, 1, 2], [3, 4, 5]]
            )
            assert owner.k.weight.data_ptr() != stack.stacks[0].weight.data_ptr()  # a view
            assert owner.k.weight_scale_inv.shape == (1, 2)
            got = stack(x)
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)


def test_row_split_or_straddling_parts_do_not_stack():
    gen = torch.Generator().manual_seed(0)
    owner = nn.Module()
    owner.a = Linear(256, 128, torch.bfloat16)
    owner.b = Linear(256, 128, torch.bfloat16)
    owner.c = Linear(256, 128, torch.bfloat16)
    owner.c.split = "row"  # a partial sum needs its all-reduce after the GEMM
    assert StackedProjections(owner, ("b", "c")).stack() is False
    stack = StackedProjections(owner, ("a", "b"))
    assert stack.stack() is True and owner.a.weight.data_ptr() == stack.stacks[0].weight.data_ptr()
    # FP8 parts whose scale blocks would span two parts (64 rows, then more) run alone
    owner.d, owner.e = _fp8_linear(64, gen), _fp8_linear(128, gen)
    assert StackedProjections(owner, ("d", "e")).stack() is False
