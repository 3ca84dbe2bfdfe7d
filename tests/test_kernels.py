"""Kernel references: tie rule, extend/decode agreement, sparse attention vs a dense mask."""

from __future__ import annotations

import torch

from kernels import indexer, kda, sparse_mla
from serving.config import ModelConfig
from serving.models.loader import load_weights
from serving.tools.generate import StepRunner


def test_ties_pick_the_lowest_pool_index():
    scores = torch.tensor([[0.0, 1.0, 1.0, 0.5, 1.0, 0.0, 0.0, 0.0]])
    picked = indexer.select_tokens(
        scores, torch.tensor([31]), kpool=4, select_pools=2, select_tail=False
    )
    assert sorted(set(picked[0].tolist()) - {-1}) == list(range(4, 12))  # pools 1 and 2
    zeros = torch.zeros(1, 8)
    picked = indexer.select_tokens(
        zeros, torch.tensor([31]), kpool=4, select_pools=3, select_tail=False
    )
    assert sorted(picked[0].tolist()) == list(range(12))  # pools 0, 1, 2


def test_selection_respects_visibility_and_tail():
    scores = torch.arange(8, dtype=torch.float32).unsqueeze(0).repeat(2, 1)
    picked = indexer.select_tokens(
        scores, torch.tensor([9, 13]), kpool=4, select_pools=4, select_tail=True
    )
    # position 9: complete visible pools 0, 1; tail = tokens 8, 9
    assert sorted(set(picked[0].tolist()) - {-1}) == list(range(10))
    # position 13: pools 0..2 visible, tail 12, 13
    assert sorted(set(picked[1].tolist()) - {-1}) == list(range(14))
    assert picked.shape[1] == 4 * 4 + 3


def test_all_tied_scores_agree_across_paths(tiny_ckpt):
    """With the indexer's head weights zeroed every pool ties; prefill, chunked prefill and
    decode must still pick the same tokens (the tie rule), so their logits agree."""
    config = ModelConfig.from_pretrained(tiny_ckpt)
    model, _ = load_weights(tiny_ckpt, config, torch.float32)
    for layer in model.layers:
        idx = getattr(layer.self_attn, "indexer", None)
        if idx is not None:
            idx.weights_proj.weight.zero_()
    tokens = list(range(3, 83))
    full = StepRunner(model, max_requests=1, max_context=128)
    seq = full.add(tokens)
    ref = full.step([seq], [len(tokens)], logits="all").logits
    step = StepRunner(model, max_requests=1, max_context=128)
    seq = step.add(tokens)
    outs = [step.step([seq], [37], logits="all").logits]
    outs += [step.step([seq], [1]).logits for _ in range(len(tokens) - 37)]
    got = torch.cat(outs)
    assert ((got - ref).abs().max() / ref.abs().max()).item() < 1e-5


def test_kda_extend_equals_repeated_decode():
    torch.manual_seed(0)
    t, h, d = 11, 2, 8
    q, k, v = (torch.randn(t, h, d) for _ in range(3))
    g = -torch.rand(t, h, d)
    beta = torch.rand(t, h)
    rows = torch.tensor([1])
    s1 = torch.zeros(2, h, d, d)
    out_ext = kda.kda_extend(q, k, v, g, beta, s1, rows, [t])
    s2 = torch.zeros(2, h, d, d)
    out_dec = torch.cat(
        [
            kda.kda_decode(
                q[i : i + 1], k[i : i + 1], v[i : i + 1], g[i : i + 1], beta[i : i + 1], s2, rows
            )
            for i in range(t)
        ]
    )
    torch.testing.assert_close(out_ext, out_dec)
    torch.testing.assert_close(s1, s2)


def test_conv_extend_equals_repeated_decode():
    torch.manual_seed(0)
    c, kk, t = 6, 4, 9
    x, w = torch.randn(t, c), torch.randn(c, kk)
    rows = torch.tensor([2])
    st1, st2 = torch.zeros(3, c, kk - 1), torch.zeros(3, c, kk - 1)
    y1 = kda.causal_conv_extend(x, w, st1, rows, [t])
    y2 = torch.cat([kda.causal_conv_decode(x[i : i + 1], w, st2, rows) for i in range(t)])
    torch.testing.assert_close(y1, y2)
    torch.testing.assert_close(st1, st2)


def test_uniform_kda_and_conv_equal_ragged_extend_with_history():
    """The graph-safe uniform paths (speculative verify) = the ragged extend, history included."""
    torch.manual_seed(0)
    b, step, h, d, c, kk = 3, 4, 2, 8, 6, 4
    q, k, v = (torch.randn(b * step, h, d) for _ in range(3))
    g, beta = -torch.rand(b * step, h, d), torch.rand(b * step, h)
    rows = torch.tensor([3, 1, 2])
    init = torch.randn(4, h, d, d)
    s1, s2 = init.clone(), init.clone()
    hist1, hist2 = [], []
    out1 = kda.kda_extend(q, k, v, g, beta, s1, rows, [step] * b, hist1)
    out2 = kda.kda_uniform(q, k, v, g, beta, s2, rows, step, hist2)
    torch.testing.assert_close(out1, out2)
    torch.testing.assert_close(s1, s2)
    torch.testing.assert_close(hist1[0], hist2[0])
    x, w = torch.randn(b * step, c), torch.randn(c, kk)
    st0 = torch.randn(4, c, kk - 1)
    st1, st2 = st0.clone(), st0.clone()
    hist1, hist2 = [], []
    y1 = kda.causal_conv_extend(x, w, st1, rows, [step] * b, hist1)
    y2 = kda.causal_conv_uniform(x, w, st2, rows, step, hist2)
    torch.testing.assert_close(y1, y2)
    torch.testing.assert_close(st1, st2)
    torch.testing.assert_close(hist1[0], hist2[0])


def test_sparse_mla_matches_dense_masked_attention():
    torch.manual_seed(0)
    n, h, r, s = 5, 3, 8, 20
    q, latent = torch.randn(n, h, r), torch.randn(s, r)
    slots = torch.full((n, 6), -1)
    for i in range(n):
        slots[i, : i + 2] = torch.randperm(s)[: i + 2]
    out = sparse_mla.sparse_mla_attention(q, latent, slots, 0.3)
    mask = torch.full((n, s), float("-inf"))
    for i in range(n):
        mask[i, slots[i][slots[i] >= 0]] = 0
    probs = torch.softmax(torch.einsum("nhr,sr->nhs", q, latent) * 0.3 + mask[:, None], -1)
    torch.testing.assert_close(out, torch.einsum("nhs,sr->nhr", probs, latent))


def test_dense_experts_equal_sparse_experts():
    from kernels import moe

    torch.manual_seed(0)
    t, e, h, i = 7, 6, 16, 8
    x = torch.randn(t, h)
    w13, w2 = torch.randn(e, 2 * i, h) * 0.3, torch.randn(e, h, i) * 0.3
    gate = torch.randn(e, h)
    weights, ids = moe.route(x, gate, torch.zeros(e), 2, 2, 1, True, 2.5)
    torch.testing.assert_close(
        moe.experts_dense(x, w13, w2, weights, ids, 10.0),
        moe.experts(x, w13, w2, weights, ids, 10.0),
    )


def test_expert_id_e_selects_nothing():
    """EP passes the experts other ranks hold as id E: both paths skip those pairs, exactly as
    if their weight were 0."""
    from kernels import moe

    torch.manual_seed(1)
    t, e, h, i = 9, 4, 16, 8
    x = torch.randn(t, h)
    w13, w2 = torch.randn(e, 2 * i, h) * 0.3, torch.randn(e, h, i) * 0.3
    weights, ids = torch.rand(t, 3), torch.randint(0, e + 1, (t, 3))
    ids[0] = e  # a token with no local expert at all
    skip = ids == e
    zeroed = (weights.masked_fill(skip, 0.0), ids.masked_fill(skip, 0))
    want = moe.experts(x, w13, w2, *zeroed, 10.0)
    torch.testing.assert_close(moe.experts(x, w13, w2, weights, ids, 10.0), want)
    torch.testing.assert_close(moe.experts_dense(x, w13, w2, weights, ids, 10.0), want)
    assert torch.equal(want[0], torch.zeros(h))
