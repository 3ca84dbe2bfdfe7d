"""Write a deterministic GLM-5.3-Flash-style checkpoint with random weights.

    python -m serving.tools.tiny_model DIR              # tiny default, runs fast on 2 CPU cores
    python -m serving.tools.tiny_model DIR --preset bench --device cuda   # 3B GPU benchmark config
    python -m serving.tools.tiny_model DIR --preset real     # GLM-5.3-Flash's config.json only
    python -m serving.tools.tiny_model DIR --preset real --fp8   # ... as published: block FP8
    python -m serving.tools.tiny_model DIR --vision     # with a tiny vision tower (random)

The checkpoint is what transformers' glm5_next save_pretrained writes (nested text_config,
original tensor names) plus the NextN layer at layers.{num_hidden_layers}, a byte-level BPE
tokenizer.json with GLM's special tokens, chat_template.jinja and generation_config.json.
--fp8: the checkpoint in block FP8 (serving/tools/quantize_fp8.py; config-only presets get just
the quantization_config).
--vision: a vision tower too (transformers' glm5_next_vision config, `model.visual.*` tensors,
kept in the checkpoint's dtype even with --fp8), the tokenizer's image tokens and a
preprocessor_config.json for Glm5NextImageProcessor; the real preset gets GLM-5.3-Flash's
tower shape (transformers' defaults at the text width).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from serving.config import DSA, KDA, ModelConfig
from serving.models.glm5_next import Glm5NextForCausalLM
from serving.models.loader import export_checkpoint
from serving.models.nextn import NextNDraft
from serving.models.random_init import random_vision, random_weights
from serving.tools.tokenizer_build import write_tokenizer_files

TINY_VOCAB = 1024

# GLM-5.3-Flash's 45 layers: 34 KDA + 11 DSA, 3 dense MLPs then 42 MoE
REAL_LAYERS: dict[str, Any] = dict(
    num_hidden_layers=45,
    layer_types=[DSA if i % 4 == 3 else KDA for i in range(45)],
    indexer_types=["full"] * 45,
    mlp_layer_types=["dense"] * 3 + ["sparse"] * 42,
)

PRESETS: dict[str, dict[str, Any]] = {
    # 4 layers: KDA, DSA (full indexer), DSA (shared indexer), KDA. index_topk 32 tokens
    # (8 pools of 4) so prompts of a few dozen tokens already select sparsely; 16 indexer heads
    # keep pool scores from tying.
    "tiny": dict(
        vocab_size=TINY_VOCAB,
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=4,
        n_routed_experts=8,
        n_shared_experts=1,
        num_experts_per_tok=2,
        n_group=1,
        topk_group=1,
        q_lora_rank=48,
        kv_lora_rank=32,
        qk_nope_head_dim=16,
        qk_rope_head_dim=0,
        v_head_dim=16,
        index_n_heads=16,
        index_head_dim=16,
        index_topk=32,
        index_kpool=4,
        linear_num_heads=4,
        linear_head_dim=16,
        layer_types=[KDA, DSA, DSA, KDA],
        indexer_types=["full", "full", "shared", "full"],
        mlp_layer_types=["dense", "sparse", "sparse", "sparse"],
        max_position_embeddings=8192,
        dtype="float32",
    ),
    # The trained small model's shape (training/train_small.py; docs/SMALL_MODEL.md): the
    # real layer pattern at 1/16 width, ~15 M parameters, 30 MB in bf16. index_topk 256 tokens
    # (16 pools of kpool 16, as the real model pools) so prompts past 256 tokens select sparsely.
    "small": dict(
        vocab_size=8192,
        hidden_size=256,
        intermediate_size=768,
        moe_intermediate_size=64,
        num_hidden_layers=8,
        num_attention_heads=4,
        num_key_value_heads=4,
        n_routed_experts=16,
        n_shared_experts=1,
        num_experts_per_tok=4,
        n_group=1,
        topk_group=1,
        q_lora_rank=128,
        kv_lora_rank=128,
        qk_nope_head_dim=64,
        qk_rope_head_dim=0,
        v_head_dim=64,
        index_n_heads=4,
        index_head_dim=64,
        index_topk=256,
        index_kpool=16,
        linear_num_heads=4,
        linear_head_dim=64,
        layer_types=[KDA, KDA, KDA, DSA, KDA, KDA, KDA, DSA],
        indexer_types=["full"] * 8,
        mlp_layer_types=["dense"] + ["sparse"] * 7,
        max_position_embeddings=4096,
        dtype="bfloat16",
    ),
    # The GPU benchmark shape: ~3B parameters, 1B active.
    "bench": dict(
        vocab_size=154880,
        hidden_size=2048,
        intermediate_size=6144,
        moe_intermediate_size=768,
        num_hidden_layers=8,
        num_attention_heads=16,
        num_key_value_heads=16,
        n_routed_experts=64,
        n_shared_experts=1,
        num_experts_per_tok=4,
        n_group=1,
        topk_group=1,
        q_lora_rank=768,
        kv_lora_rank=512,
        qk_nope_head_dim=128,
        qk_rope_head_dim=0,
        v_head_dim=128,
        index_n_heads=16,
        index_head_dim=128,
        index_topk=512,
        index_kpool=16,
        linear_num_heads=16,
        linear_head_dim=128,
        layer_types=[KDA, KDA, KDA, DSA, KDA, KDA, KDA, DSA],
        indexer_types=["full"] * 8,
        mlp_layer_types=["dense"] + ["sparse"] * 7,
        max_position_embeddings=65536,
        dtype="bfloat16",
    ),
    # transformers' Glm5NextConfig() defaults: the real GLM-5.3-Flash shape (~314 B parameters).
    # Config only (no weights): for `python -m serving.tools.plan` and start-up checks.
    "real": dict(
        vocab_size=154880,
        hidden_size=4096,
        intermediate_size=12288,
        moe_intermediate_size=2048,
        num_attention_heads=64,
        num_key_value_heads=64,
        n_routed_experts=288,
        n_shared_experts=1,
        num_experts_per_tok=8,
        n_group=1,
        topk_group=1,
        q_lora_rank=1536,
        kv_lora_rank=512,
        qk_nope_head_dim=256,
        qk_rope_head_dim=0,
        v_head_dim=256,
        index_n_heads=32,
        index_head_dim=128,
        index_topk=2048,
        index_kpool=16,
        linear_num_heads=64,
        linear_head_dim=128,
        **REAL_LAYERS,
        max_position_embeddings=1048576,
        dtype="bfloat16",
    ),
}
# the tiny widths in the real layer pattern, bf16, with heads and experts that split 8 ways (TP8 /
# EP8 as the seed's): bench.launch_count's model (launches per layer kind do not depend on widths)
PRESETS["tiny45"] = {
    **PRESETS["tiny"],
    **REAL_LAYERS,
    **dict(num_attention_heads=8, num_key_value_heads=8, linear_num_heads=8, n_routed_experts=16),
    "dtype": "bfloat16",
}
CONFIG_ONLY = {"real"}  # presets written without weights

# --vision: the tower per preset (transformers' Glm5NextVisionConfig defaults otherwise);
# out_hidden_size is always the text width. Tiny: 2 blocks of 32 wide, 2 heads of 16.
VISION_PRESETS: dict[str, dict[str, Any]] = {
    "tiny": dict(
        depth=2, hidden_size=32, num_heads=2, intermediate_size=64, projection_intermediate_size=64
    ),
    "small": dict(
        depth=4,
        hidden_size=128,
        num_heads=4,
        intermediate_size=256,
        projection_intermediate_size=512,
    ),  # fmt: skip
}
# preprocessor_config.json: Glm5NextImageProcessor with CLIP's mean and std; the tiny preset's
# images take 4 to 64 tokens (GLM-5.3-Flash's: 16 to 8,000), so tests stay short.
IMAGE_TOKEN_BUDGET = {"tiny": (4, 64)}

COMMON: dict[str, Any] = dict(
    model_type="glm5_next_text",
    hidden_act="silu",
    rms_norm_eps=1e-5,
    routed_scaling_factor=2.5,
    norm_topk_prob=True,
    swiglu_limit=10.0,
    linear_conv_kernel_dim=4,
    linear_lower_bound=-5.0,
    hc_mult=4,
    hc_eps=1e-6,
    hc_sinkhorn_iters=20,
    index_kpool_always_select_tail=True,
    attention_bias=False,
    tie_word_embeddings=False,
    num_nextn_predict_layers=1,
)


def build_config(preset: str, specials: dict[str, int], vision: bool = False) -> dict[str, Any]:
    text = {**COMMON, **PRESETS[preset]}
    dtype = text.pop("dtype")
    text["eos_token_id"] = [specials[t] for t in ("<|endoftext|>", "<|user|>", "<|observation|>")]
    text["pad_token_id"] = specials["<|endoftext|>"]
    raw = {
        "architectures": ["Glm5NextForConditionalGeneration"],
        "model_type": "glm5_next",
        "dtype": dtype,
        "tie_word_embeddings": False,
        "text_config": text,
    }
    if vision:
        raw["vision_config"] = {
            "model_type": "glm5_next_vision",
            **VISION_PRESETS.get(preset, {}),
            "out_hidden_size": text["hidden_size"],
        }
        for key, token in (
            ("image_token_id", "<|image|>"),
            ("video_token_id", "<|video|>"),
            ("image_start_token_id", "<|begin_of_image|>"),
            ("image_end_token_id", "<|end_of_image|>"),
            ("video_start_token_id", "<|begin_of_video|>"),
            ("video_end_token_id", "<|end_of_video|>"),
        ):
            raw[key] = specials[token]
    return raw


def preprocessor_config(preset: str) -> dict[str, Any]:
    """What transformers' AutoImageProcessor reads for glm5_next (serving/front/images.py's
    ImageProcessorConfig reads the same keys)."""
    low, high = IMAGE_TOKEN_BUDGET.get(preset, (16, 8000))
    return {
        "image_processor_type": "Glm5NextImageProcessor",
        "processor_class": "Glm5NextProcessor",
        "do_resize": True,
        "do_rescale": True,
        "do_normalize": True,
        "do_convert_rgb": True,
        "patch_size": 14,
        "temporal_patch_size": 2,
        "merge_size": 2,
        "min_image_tokens": low,
        "max_image_tokens": high,
        "image_mean": [0.48145466, 0.4578275, 0.40821073],
        "image_std": [0.26862954, 0.26130258, 0.27577711],
        "rescale_factor": 1 / 255,
        "resample": 3,
    }


def random_model(
    raw: dict[str, Any], device: str, seed: int = 0
) -> tuple[ModelConfig, Glm5NextForCausalLM, NextNDraft]:
    """The target and draft of config `raw` (build_config's) with write_checkpoint's weights,
    built in memory on `device`."""
    config = ModelConfig.from_dict(raw)
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[raw["dtype"]]
    target, draft = random_weights(config, dtype, device, seed)
    return config, target, draft


def write_checkpoint(
    out_dir: str | Path,
    preset: str = "tiny",
    device: str = "cpu",
    seed: int = 0,
    fp8: bool = False,
    vision: bool = False,
) -> Path:
    from serving.tools.quantize_fp8 import quantize_checkpoint, write_fp8_config

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    # a vocabulary smaller than the tiny tokenizer's gets a tokenizer of its size
    specials = write_tokenizer_files(
        out, vocab_size=min(TINY_VOCAB, PRESETS[preset]["vocab_size"]), vision=vision
    )
    raw = build_config(preset, specials, vision)
    (out / "config.json").write_text(json.dumps(raw, indent=2) + "\n")
    if vision:
        text = json.dumps(preprocessor_config(preset), indent=2) + "\n"
        (out / "preprocessor_config.json").write_text(text)
    (out / "generation_config.json").write_text(
        json.dumps(
            {
                "eos_token_id": raw["text_config"]["eos_token_id"],
                "pad_token_id": raw["text_config"]["pad_token_id"],
            },
            indent=2,
        )
        + "\n"
    )
    if preset in CONFIG_ONLY:
        if fp8:
            write_fp8_config(out)
        return out
    config, target, draft = random_model(raw, device, seed)
    tensors = export_checkpoint(config, target, draft)
    if vision:  # quantize_checkpoint leaves model.visual.* as they are
        tower = random_vision(config, target.dtype, device, seed)
        # copies: each MLP's gate and up share one storage (VisionMLP), which save_file refuses
        tensors.update(
            {
                f"model.visual.{k}": v.detach().to("cpu", copy=True)
                for k, v in tower.state_dict().items()
            }
        )
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return quantize_checkpoint(out, out) if fp8 else out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("out_dir")
    ap.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    ap.add_argument(
        "--device", default="cpu", help="build the weights here (cuda for --preset bench)"
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--fp8", action="store_true", help="block FP8, as GLM-5.3-Flash is published")
    ap.add_argument("--vision", action="store_true", help="with a vision tower (random weights)")
    args = ap.parse_args()
    path = write_checkpoint(
        args.out_dir, args.preset, args.device, args.seed, args.fp8, args.vision
    )
    kind = (" FP8" if args.fp8 else "") + (" vision" if args.vision else "")
    print(f"wrote {args.preset}{kind} checkpoint to {path}")


if __name__ == "__main__":
    main()
