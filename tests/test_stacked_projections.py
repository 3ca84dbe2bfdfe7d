"""serving/layers/linear.py StackedProjections: a layer's projections of one input run as one
GEMM over their stacked weights, with the same outputs as the parts run one by one; the
fallbacks (storage replaced after stacking, training, FP8 parts) run the parts one by one."""

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
    # KDA, MLA + indexer from x and from q_lora, MLPs
    assert {"q_proj", "q_a_proj", "q_b_proj", "gate_proj"} <= kinds, kinds
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(5, config.hidden_size, generator=gen)
    for stack in stacks:
        assert stack.stacked is not None, stack.names
        x = torch.randn(5, stack.stacked.shape[1], generator=gen)
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


def test_fp8_or_row_split_parts_do_not_stack():
    owner = nn.Module()
    owner.a = Linear(256, 128, torch.bfloat16)
    owner.b = Linear(256, 128, torch.bfloat16)
    owner.a.hold_fp8()
    assert StackedProjections(owner, ("a", "b")).stack() is False
    owner.c = Linear(256, 128, torch.bfloat16)
    owner.c.split = "row"  # a partial sum needs its all-reduce after the GEMM
    assert StackedProjections(owner, ("b", "c")).stack() is False
    stack = StackedProjections(owner, ("b",))
    assert stack.stack() is True and owner.b.weight.data_ptr() == stack.stacked.data_ptr()
