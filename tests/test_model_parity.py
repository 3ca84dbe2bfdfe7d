"""Logits parity with transformers' glm5_next (the oracle), float32 on CPU.

Each config builds the oracle with perturbed random weights, saves it with save_pretrained and
loads it with our loader. Prompts are longer than index_topk so the sparse selection matters.
"""

from __future__ import annotations

import pytest
import torch

from serving.config import ModelConfig
from serving.models.loader import load_weights
from serving.tools.generate import StepRunner
from tests.hf_oracle import build_oracle, oracle_logits, text_config

pytest.importorskip("transformers")

KDA, DSA = "linear_attention", "deepseek_sparse_attention"
CONFIGS = {
    # kpool 4, a shared indexer layer right after a full one, grouped expert routing
    "kpool4_shared_grouped": text_config(
        layer_types=[KDA, DSA, DSA, KDA],
        indexer_types=["full", "full", "shared", "full"],
        mlp_layer_types=["dense", "sparse", "sparse", "sparse"],
        n_group=2,
        topk_group=1,
    ),
    # kpool 16 (index_topk 32 = 2 pools), DSA first, two dense layers
    "kpool16": text_config(
        index_kpool=16,
        index_topk=32,
        layer_types=[DSA, KDA, KDA, DSA],
        indexer_types=["full"] * 4,
        mlp_layer_types=["dense", "dense", "sparse", "sparse"],
    ),
    # two shared layers (transformers needs each right after a full one), kpool 8, softplus
    # forget gate (no lower bound), 2 shared experts
    "shared_softplus": text_config(
        num_hidden_layers=6,
        index_kpool=8,
        index_topk=16,
        layer_types=[KDA, DSA, DSA, KDA, DSA, DSA],
        indexer_types=["full", "full", "shared", "full", "full", "shared"],
        mlp_layer_types=["dense", "sparse", "sparse", "sparse", "dense", "sparse"],
        linear_lower_bound=None,
        n_shared_experts=2,
    ),
}
TOL = 1e-4
PROMPT_LEN = 70


def rel_err(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return ((ours - ref).abs().max() / ref.abs().max()).item()


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def pair(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    oracle = build_oracle(CONFIGS[request.param], path)
    config = ModelConfig.from_pretrained(path)
    assert config.index_topk + config.index_kpool < PROMPT_LEN, "prompt must select sparsely"
    ours, _ = load_weights(path, config, torch.float32)
    return oracle, ours


def prompt(seed: int, n: int = PROMPT_LEN) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 256, (n,), generator=g).tolist()


def test_full_prompt_logits(pair):
    oracle, ours = pair
    tokens = prompt(0)
    runner = StepRunner(ours, max_requests=2, max_context=256)
    seq = runner.add(tokens)
    out = runner.step([seq], [len(tokens)], logits="all")
    assert rel_err(out.logits, oracle_logits(oracle, tokens)) <= TOL


def test_greedy_decode_steps(pair):
    """16+ pure-argmax decode steps (EOS allowed as a token), each step checked."""
    oracle, ours = pair
    runner = StepRunner(ours, max_requests=2, max_context=256)
    seq = runner.add(prompt(1))
    out = runner.step([seq], [len(seq.tokens)])
    for _ in range(18):
        seq.tokens.append(int(out.logits[-1].argmax()))
        out = runner.step([seq], [1])
        ref = oracle_logits(oracle, seq.tokens)[-1]
        assert rel_err(out.logits[0], ref) <= TOL
        assert int(out.logits[0].argmax()) == int(ref.argmax())


@pytest.mark.parametrize("splits", [[1, 5, 13, 32, 50], [4, 8, 64], [31, 33, 47]])
def test_chunked_prefill(pair, splits):
    """The same prompt fed in chunks (aligned and unaligned to kpool) gives the same logits."""
    oracle, ours = pair
    tokens = prompt(2)
    runner = StepRunner(ours, max_requests=2, max_context=256)
    seq = runner.add(tokens)
    bounds = [0, *splits, len(tokens)]
    logits = [runner.step([seq], [b - a], logits="all").logits for a, b in zip(bounds, bounds[1:])]
    assert rel_err(torch.cat(logits), oracle_logits(oracle, tokens)) <= TOL


def test_ragged_batch(pair):
    """Requests of different lengths prefilled and decoded together match one by one."""
    oracle, ours = pair
    prompts = [prompt(3, 23), prompt(4, 70), prompt(5, 41)]
    runner = StepRunner(ours, max_requests=4, max_context=256)
    seqs = [runner.add(p) for p in prompts]
    out = runner.step(seqs, [len(p) for p in prompts])
    for _ in range(6):
        for seq, row in zip(seqs, out.logits):
            ref = oracle_logits(oracle, seq.tokens)[-1]
            assert rel_err(row, ref) <= TOL
            seq.tokens.append(int(ref.argmax()))
        out = runner.step(seqs, [1, 1, 1])


def test_ragged_chunks(pair):
    """Requests continued at different, kpool-unaligned starts in one batch (pools that close
    with members from before the chunk, in the ring) match the oracle at every chunk's end."""
    oracle, ours = pair
    prompts = [prompt(6, 70), prompt(7, 61), prompt(8, 45)]
    cuts = [[3, 22, 51, 70], [9, 10, 40, 61], [17, 34, 35, 45]]  # each request's chunk ends
    runner = StepRunner(ours, max_requests=4, max_context=256)
    seqs = [runner.add(p) for p in prompts]
    done = [0, 0, 0]
    for step in range(4):
        lens = [c[step] - d for c, d in zip(cuts, done)]
        out = runner.step(seqs, lens)
        for seq, end, row in zip(seqs, (c[step] for c in cuts), out.logits):
            assert rel_err(row, oracle_logits(oracle, seq.tokens[:end])[-1]) <= TOL, (step, end)
        done = [c[step] for c in cuts]
