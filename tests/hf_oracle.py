"""Build a randomized transformers glm5_next model (the oracle) and save it as a checkpoint."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from training.train_small import VISION as TINY_VISION  # the smallest vision tower


def text_config(**overrides: Any) -> dict[str, Any]:
    base = dict(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=4,
        n_shared_experts=1,
        n_routed_experts=8,
        num_experts_per_tok=2,
        kv_lora_rank=32,
        q_lora_rank=48,
        qk_nope_head_dim=16,
        v_head_dim=16,
        index_topk=16,
        index_head_dim=16,
        index_n_heads=16,
        linear_head_dim=16,
        linear_num_heads=4,
        hc_mult=4,
        index_kpool=4,
        pad_token_id=0,
        eos_token_id=[1, 2],
    )
    base.update(overrides)
    return base


def build_oracle(tc: dict[str, Any], out_dir: Path, seed: int = 0):
    """Return the eval-mode HF model, its weights perturbed so every parameter matters."""
    from transformers import Glm5NextConfig, Glm5NextForConditionalGeneration

    torch.manual_seed(seed)
    cfg = Glm5NextConfig(text_config=tc, vision_config=TINY_VISION)
    cfg._attn_implementation = "eager"
    model = Glm5NextForConditionalGeneration(cfg).eval()
    with torch.no_grad():
        for name, p in list(model.named_parameters()) + list(model.named_buffers()):
            if "visual" in name:
                continue
            if "e_score_correction_bias" in name:
                p.copy_(torch.rand_like(p) * 0.1)
            elif name.endswith("A_log"):
                p.copy_(torch.randn_like(p) * 0.5)
            elif "norm" in name and p.dim() == 1:
                p.copy_(1 + 0.1 * torch.randn_like(p))
            elif p.is_floating_point():
                p.add_(torch.randn_like(p) * 0.05)
    model.save_pretrained(out_dir)
    return model


def oracle_logits(model, tokens: list[int]) -> torch.Tensor:
    """Full-forward logits [len(tokens), V] from the oracle (no cache)."""
    with torch.no_grad():
        return model(input_ids=torch.tensor([tokens])).logits[0].float()
