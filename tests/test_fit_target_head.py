"""training/fit_target_head.py: the refitted lm_head gives the random tiny target a learnable
first-order language (CPU, tiny checkpoint)."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from serving.config import ModelConfig
from serving.models.loader import load_weights
from serving.tools.generate import StepRunner
from training.fit_target_head import CHAIN_TOKENS, fit_head, markov_chain

TOKENS = 32768  # corpus tokens for the fit (about 2 s on 2 cores)


def test_markov_chain_is_deterministic_with_a_clear_favourite():
    succ, probs = markov_chain(CHAIN_TOKENS, 3, seed=0)
    again = markov_chain(CHAIN_TOKENS, 3, seed=0)
    assert torch.equal(succ, again[0]) and torch.equal(probs, again[1])
    assert not torch.equal(succ, markov_chain(CHAIN_TOKENS, 3, seed=1)[0])
    assert succ.shape == (CHAIN_TOKENS, 3) and int(succ.max()) < CHAIN_TOKENS
    assert all(len(set(row)) == 3 for row in succ.tolist())  # distinct successors
    torch.testing.assert_close(probs.sum(1), torch.ones(CHAIN_TOKENS))
    assert bool((probs[:, 0] >= 0.55).all())
    assert bool((probs[:, 0] - probs[:, 1:].max(1).values >= 0.1 - 1e-6).all())
    two = markov_chain(CHAIN_TOKENS, 2, seed=0)[1]
    assert bool((two[:, 0] - two[:, 1] >= 0.1 - 1e-6).all())


@pytest.fixture(scope="module")
def fitted(tiny_ckpt, tmp_path_factory):
    out = tmp_path_factory.mktemp("fitted")
    summary = fit_head(str(tiny_ckpt), str(out), "cpu", tokens=TOKENS, seed=0)
    return out, summary


def test_fit_is_deterministic_and_changes_only_lm_head(tiny_ckpt, fitted, tmp_path):
    out, summary = fitted
    assert summary["served_dtype_agrees"] == 1.0  # float32 checkpoint: served as fitted
    assert summary["fit_tokens"] >= TOKENS - 32
    fit_head(str(tiny_ckpt), str(tmp_path), "cpu", tokens=TOKENS, seed=0)
    before = load_file(str(tiny_ckpt / "model.safetensors"))
    after = load_file(str(out / "model.safetensors"))
    again = load_file(str(tmp_path / "model.safetensors"))
    assert after.keys() == before.keys()
    for name, t in before.items():
        assert after[name].dtype == t.dtype and after[name].shape == t.shape
        assert torch.equal(after[name], again[name]), name
        if name != "lm_head.weight":
            assert torch.equal(after[name], t), name
    head = after["lm_head.weight"]
    assert not torch.equal(head, before["lm_head.weight"])
    assert bool((head[CHAIN_TOKENS:] == 0).all())  # never a label: EOS and specials included


def test_fitted_target_follows_the_chain_on_new_prompts(fitted):
    """Greedy text from prompts the fit never saw follows the chain's favourite successor most
    of the time (measured 0.77 here) and never leaves the chain's tokens. On the fit's own
    sampled contexts the tiny target picks the favourite less often (summary follows_chain,
    ~0.4, still 400x chance): its 64-wide hidden state identifies the current token only so
    well. Greedy text revisits the tokens it is surest of."""
    out, summary = fitted
    assert summary["follows_chain"] > 0.3
    config = ModelConfig.from_pretrained(out)
    model, _ = load_weights(out, config, torch.float32, "cpu")
    succ, _ = markov_chain(CHAIN_TOKENS, 3, seed=0)
    g = torch.Generator().manual_seed(777)
    prompts = [torch.randint(0, CHAIN_TOKENS, (16,), generator=g).tolist() for _ in range(8)]
    gens = StepRunner(model, max_requests=8, max_context=128).greedy(prompts, 64)
    favourite = successor = total = 0
    for p, gen in zip(prompts, gens):
        seq = p + gen
        assert max(gen) < CHAIN_TOKENS
        for cur, nxt in zip(seq[len(p) - 1 : -1], gen):
            total += 1
            favourite += nxt == int(succ[cur, 0])
            successor += nxt in succ[cur].tolist()
    assert favourite / total > 0.6, (favourite, total)
    assert successor / total > 0.65, (successor, total)
