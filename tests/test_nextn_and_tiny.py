"""The tiny default checkpoint and the NextN draft layer."""

from __future__ import annotations

import hashlib
import subprocess
import sys

import torch

from serving.config import ModelConfig
from serving.forward_batch import ForwardBatch
from serving.memory.cache import allocate_model_cache
from serving.models.loader import load_weights
from serving.models.nextn import NextNDraft
from serving.tools.generate import StepRunner
from serving.tools.tiny_model import write_checkpoint


def _digest(path) -> str:
    return hashlib.sha256((path / "model.safetensors").read_bytes()).hexdigest()


def test_tiny_checkpoint_is_deterministic(tiny_ckpt, tmp_path):
    again = write_checkpoint(tmp_path / "again")
    assert _digest(again) == _digest(tiny_ckpt)
    for name in ("config.json", "tokenizer.json", "chat_template.jinja", "generation_config.json"):
        assert (again / name).read_bytes() == (tiny_ckpt / name).read_bytes(), name


def test_tiny_config_selects_sparsely_and_has_every_layer_kind(tiny_ckpt):
    c = ModelConfig.from_pretrained(tiny_ckpt)
    assert set(c.layer_types) == {"linear_attention", "deepseek_sparse_attention"}
    assert set(c.mlp_layer_types) == {"dense", "sparse"}
    assert set(c.indexer_types[i] for i in c.dsa_layers) == {"full", "shared"}
    assert c.n_shared_experts >= 1 and c.num_nextn_predict_layers == 1
    assert c.index_topk <= 64 and c.index_n_heads >= 16


def _draft_setup(tiny_ckpt):
    config = ModelConfig.from_pretrained(tiny_ckpt)
    target, draft = load_weights(tiny_ckpt, config, torch.float32, load_draft=True)
    assert isinstance(draft, NextNDraft)
    return config, target, draft


def _run_draft(config, target, draft, tokens, hidden):
    req_to_token = torch.zeros(2, 128, dtype=torch.int64)
    req_to_token[1] = torch.arange(128) + 16
    cache = allocate_model_cache(
        config,
        req_to_token,
        160,
        torch.float32,
        "cpu",
        layers=[config.num_hidden_layers],
        layer_types=config.draft_layer_types,
    )
    batch = ForwardBatch.build(tokens, [1], [0], [len(tokens)], req_to_token, logits="all")
    return draft(target, batch, hidden, cache)


def test_nextn_runs_is_deterministic_and_reads_target_hidden(tiny_ckpt):
    config, target, draft = _draft_setup(tiny_ckpt)
    runner = StepRunner(target, max_requests=1, max_context=128)
    prompt = list(range(5, 45))
    seq = runner.add(prompt)
    out = runner.step([seq], [len(prompt)], logits="all")
    assert out.hidden.shape == (len(prompt), config.hidden_size)
    next_tokens = prompt[1:] + [int(out.logits[-1].argmax())]
    a = _run_draft(config, target, draft, next_tokens, out.hidden)
    b = _run_draft(config, target, draft, next_tokens, out.hidden)
    assert a.logits.shape == (len(prompt), config.vocab_size)
    assert a.hidden.shape == (len(prompt), config.hidden_size)
    assert torch.equal(a.logits, b.logits)
    c = _run_draft(config, target, draft, next_tokens, torch.randn_like(out.hidden))
    assert not torch.allclose(a.logits, c.logits)


def test_generate_cli_runs_on_tiny(tiny_ckpt):
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "serving.tools.generate",
            "--model-path",
            str(tiny_ckpt),
            "--prompt",
            "Hello there",
            "--max-new-tokens",
            "4",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip()


def test_transformers_ignores_our_kernels_package():
    """Our `kernels` shares the import name of HF's hub package; transformers must not use it."""
    from transformers.utils import import_utils

    import kernels  # noqa: F401  (ours, importable)

    assert not import_utils.is_kernels_available()
