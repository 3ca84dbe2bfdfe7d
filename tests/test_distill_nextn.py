"""training/distill_nextn.py --depth K: draft steps 2..K trained unrolled through the server's
own draft forward, mirroring the EAGLE worker (serving/speculative/eagle.py); the target's
tensors stay byte-identical in the written checkpoint."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from safetensors import safe_open

from serving.config import ModelConfig
from serving.memory.pool import PoolPlan
from serving.models.loader import load_weights
from serving.speculative.eagle import Eagle, SpecConfig
from serving.tools.generate import StepRunner
from training.distill_nextn import (
    fresh_pool,
    make_data,
    target_hidden,
    train,
    training_prompts,
    unrolled_losses,
    unrolled_steps,
)

PROMPT, GEN, DEPTH = 8, 8, 3


@pytest.fixture(scope="module")
def setup(tiny_ckpt):
    """The tiny target and its draft (float32, cpu), 4 greedy sequences, their target hiddens
    and choices, and a pool plan for them."""
    config = ModelConfig.from_pretrained(tiny_ckpt)
    target, draft = load_weights(str(tiny_ckpt), config, torch.float32, "cpu", load_draft=True)
    page = max(16, config.index_kpool)
    runner = StepRunner(target, max_requests=4, max_context=PROMPT + GEN + 16, page_size=page)
    seqs = make_data(runner, training_prompts(config.vocab_size, 4, PROMPT, seed=3), GEN, 4)
    hiddens, choices = target_hidden(runner, seqs)
    length = PROMPT + GEN
    plan = PoolPlan(
        rows=4, pages=4 * -(-length // page) + 1, page_size=page, max_context=length,
        with_draft=True, num_draft_tokens=DEPTH + 1,
    )  # fmt: skip
    return config, target, draft, seqs, hiddens, choices, plan


def test_unrolled_steps_are_the_eagle_workers_draft_chain(setup):
    """With the text set to the draft's own chain, each unrolled step's argmax is the token the
    EAGLE worker drafts there (prefill extend, then steps 2..K from the stashed hidden)."""
    config, target, draft, seqs, hiddens, _, plan = setup
    cuts = [PROMPT, PROMPT + 1, PROMPT + 2, PROMPT + 3]
    pool, rows = fresh_pool(config, plan, "cpu", 4, PROMPT + GEN)
    eagle = Eagle(target, draft, pool, None, SpecConfig(num_steps=DEPTH))
    eagle.extend_draft(
        rows, [0] * 4, [s[1 : 1 + n] for s, n in zip(seqs, cuts)],
        torch.cat([h[:n] for h, n in zip(hiddens, cuts)]),
    )  # fmt: skip
    chains = eagle.draft_and_verify(
        torch.tensor([s[n] for s, n in zip(seqs, cuts)]), torch.tensor(cuts),
        torch.tensor(rows), max(cuts) + DEPTH + 1,
    ).chains.tolist()  # fmt: skip
    texts = [s[: n + 1] + c + [0] * (len(s) - n - 1 - DEPTH) for s, n, c in zip(seqs, cuts, chains)]
    pool, rows = fresh_pool(config, plan, "cpu", 4, PROMPT + GEN)
    with torch.no_grad():
        steps = unrolled_steps(
            draft, target, pool, rows, texts, [torch.tensor(t) for t in texts], hiddens, cuts,
            "target", PROMPT, DEPTH,
        )  # fmt: skip
    ends = torch.tensor(cuts).cumsum(0) - 1
    drafted = [steps[0][0][ends].argmax(-1)] + [logits.argmax(-1) for logits, _, _ in steps[1:]]
    assert torch.stack(drafted, dim=1).tolist() == chains


def test_training_lowers_the_depth_2_loss_on_a_fixed_batch(setup):
    config, target, draft, seqs, hiddens, choices, plan = setup
    draft = type(draft)(config, torch.float32)
    draft.load_state_dict(setup[2].state_dict())  # a copy: the module's draft stays as loaded
    for p in draft.parameters():
        p.requires_grad_(True)
    opt = torch.optim.AdamW(list(draft.parameters()), lr=1e-2, weight_decay=0.0)
    cuts = [PROMPT, PROMPT + 2, PROMPT + 4, PROMPT + 5]

    def losses():
        pool, rows = fresh_pool(config, plan, "cpu", 4, PROMPT + GEN)
        return unrolled_losses(
            draft, target, pool, rows, seqs, choices, hiddens, cuts, "target", PROMPT, 2
        )

    before = [x.item() for x in losses()]
    for _ in range(6):
        opt.zero_grad()
        sum(losses()).backward()
        opt.step()
    after = [x.item() for x in losses()]
    assert after[1] < before[1] - 0.5, (before, after)


def _tensors(path) -> dict[str, tuple[str, bytes]]:
    """Every tensor of the checkpoint at path: (dtype, raw bytes)."""
    out = {}
    for shard in sorted(path.glob("*.safetensors")):
        with safe_open(str(shard), "pt") as f:
            for name in f.keys():
                t = f.get_tensor(name)
                raw = t.contiguous().view(-1).view(torch.uint8)
                out[name] = (str(t.dtype), raw.numpy().tobytes())
    return out


def test_depth_2_changes_only_the_nextn_tensors(tiny_ckpt, tmp_path):
    summary = train(
        str(tiny_ckpt), str(tmp_path), steps=3, device="cpu", lr=1e-3, count=4, prompt_len=PROMPT,
        gen_len=GEN, batch_size=4, seed=0, labels="target", depth=2,
    )  # fmt: skip
    assert summary["depth"] == 2 and len(summary["last_depth_losses"]) == 2
    before, after = _tensors(tiny_ckpt), _tensors(tmp_path)
    assert before.keys() == after.keys()
    layers = ModelConfig.from_pretrained(tiny_ckpt).num_hidden_layers
    nextn = f"model.language_model.layers.{layers}."
    changed = {n for n in before if before[n] != after[n]}
    assert changed and all(n.startswith(nextn) for n in changed), sorted(changed)[:5]
    with pytest.raises(ValueError, match="gen_len"):
        train(str(tiny_ckpt), str(tmp_path / "x"), steps=1, device="cpu", lr=1e-3, count=4,
              prompt_len=PROMPT, gen_len=2, batch_size=4, seed=0, depth=2)  # fmt: skip


def test_soft_labels_are_the_targets_top_k_and_their_cross_entropy(setup, tiny_ckpt):
    """top_k > 1: each position's label is the target's top-k tokens, most likely first (the
    greedy choice), with probabilities renormalised over them; each step's loss is the
    probability-weighted cross-entropy over those tokens."""
    config, target, draft, seqs, hiddens, choices, plan = setup
    page = max(16, config.index_kpool)
    runner = StepRunner(target, max_requests=4, max_context=PROMPT + GEN + 16, page_size=page)
    _, soft = target_hidden(runner, seqs, top_k=4)
    for (ids, probs), greedy in zip(soft, choices):
        assert ids.shape == probs.shape == (len(greedy), 4)
        assert torch.equal(ids[:, 0], greedy)
        assert torch.allclose(probs.sum(-1), torch.ones(len(greedy)))
        assert bool((probs[:, :-1] >= probs[:, 1:]).all())
    cuts = [PROMPT, PROMPT + 2, PROMPT + 4, PROMPT + 5]
    args = (draft, target)
    with torch.no_grad():
        pool, rows = fresh_pool(config, plan, "cpu", 4, PROMPT + GEN)
        steps = unrolled_steps(*args, pool, rows, seqs, soft, hiddens, cuts, "target", PROMPT, 2)
        pool, rows = fresh_pool(config, plan, "cpu", 4, PROMPT + GEN)
        losses = unrolled_losses(*args, pool, rows, seqs, soft, hiddens, cuts, "target", PROMPT, 2)
    for (logits, (ids, probs), weight), loss in zip(steps, losses):
        each = sum(
            probs[:, j] * F.cross_entropy(logits, ids[:, j], reduction="none") for j in range(4)
        )
        assert torch.allclose(loss, (each * weight).sum() / weight.sum(), rtol=1e-5)
    with pytest.raises(ValueError, match="top_k"):
        train(str(tiny_ckpt), "unused", steps=1, device="cpu", lr=1e-3, count=4, prompt_len=PROMPT,
              gen_len=GEN, batch_size=4, seed=0, labels="text", top_k=4)  # fmt: skip
