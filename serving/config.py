"""Model configuration of a GLM-5.3-Flash (`glm5_next`) checkpoint: the text model and, when
config.json has a `vision_config`, the vision tower (VisionConfig) and its image token ids.

`ModelConfig.from_dict` accepts what transformers writes for `glm5_next` (fields nested under
`text_config`) and flat text-only configs. Everything the model cannot serve is refused here,
at load time, with the offending field named.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

KDA = "linear_attention"
DSA = "deepseek_sparse_attention"
LAYER_TYPES = (KDA, DSA)
MLP_TYPES = ("dense", "sparse")
INDEXER_TYPES = ("full", "shared")


# The layer kinds that can run in block FP8: the names --fp8-keep-bf16 takes.
FP8_KINDS = ("kda", "mla", "indexer", "dense_mlp", "shared_expert", "moe")


class ConfigError(ValueError):
    """A checkpoint config this server cannot serve; the message names the field."""


def parse_fp8_kinds(text: str | None) -> frozenset[str]:
    """--fp8-keep-bf16: comma-separated FP8_KINDS, or "all"."""
    kinds = {k.strip() for k in (text or "").split(",") if k.strip()}
    if kinds == {"all"}:
        return frozenset(FP8_KINDS)
    unknown = kinds - set(FP8_KINDS)
    if unknown:
        raise ConfigError(
            f"--fp8-keep-bf16 {text}: unknown kinds {sorted(unknown)} (choose from "
            f"{', '.join(FP8_KINDS)}, or all)"
        )
    return frozenset(kinds)


@dataclass(frozen=True)
class Fp8Config:
    """`quantization_config` of a block-FP8 checkpoint (GLM-5, DeepSeek-V3): e4m3 weights with
    one float32 scale per 128 x 128 block, activations quantized online per token group.
    scale_fmt "ue8m0": the scales are powers of two (stored as float32 or float8_e8m0fnu)."""

    weight_block_size: tuple[int, int] = (128, 128)
    scale_fmt: str | None = None

    @classmethod
    def from_dict(cls, q: Any) -> Fp8Config:
        if not isinstance(q, dict):
            raise ConfigError(f"quantization_config must be an object, got {q!r}")
        method = q.get("quant_method")
        if method != "fp8":
            raise ConfigError(
                f"quantization_config.quant_method={method!r} is not supported (only 'fp8': "
                "block-scaled e4m3 weights, as GLM-5 and DeepSeek-V3 publish them)"
            )
        checks = (
            ("fmt", q.get("fmt", "e4m3"), ("e4m3",)),
            ("activation_scheme", q.get("activation_scheme", "dynamic"), ("dynamic",)),
            ("scale_fmt", q.get("scale_fmt"), (None, "ue8m0")),
        )
        for name, value, allowed in checks:
            if value not in allowed:
                raise ConfigError(
                    f"quantization_config.{name}={value!r} is not supported (expected one of "
                    f"{allowed})"
                )
        block = q.get("weight_block_size")
        if block is None or list(block) != [128, 128]:
            raise ConfigError(
                f"quantization_config.weight_block_size={block!r} is not supported (only "
                "[128, 128]; per-tensor or per-channel FP8 is not built)"
            )
        return cls((128, 128), q.get("scale_fmt"))


@dataclass(frozen=True)
class VisionConfig:
    """transformers' Glm5NextVisionConfig (the `vision_config` of config.json), its defaults;
    serving/models/vision.py builds the tower from it."""

    depth: int = 24
    hidden_size: int = 1024
    num_heads: int = 16
    intermediate_size: int = 4096
    in_channels: int = 3
    patch_size: int = 14
    temporal_patch_size: int = 2
    spatial_merge_size: int = 2
    out_hidden_size: int = 1536
    projection_intermediate_size: int = 10240
    swiglu_limit: float = 10.0
    rms_norm_eps: float = 1e-5
    attention_bias: bool = True
    rope_theta: float = 10000.0

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> VisionConfig:
        """From config.json's vision_config; what the tower does not implement is refused,
        naming the field."""
        if raw.get("hidden_act", "silu") != "silu":
            raise ConfigError(f"vision_config.hidden_act={raw['hidden_act']!r}: only silu")
        rope = raw.get("rope_parameters") or {}
        if rope.get("rope_type", "axial") != "axial":
            raise ConfigError(f"vision_config.rope_parameters.rope_type={rope['rope_type']!r}")
        values = {k: raw[k] for k in cls.__dataclass_fields__ if k in raw}
        values["rope_theta"] = rope.get("rope_theta", raw.get("rope_theta", cls.rope_theta))
        for key in ("patch_size", "temporal_patch_size"):
            if not isinstance(values.get(key, 0), int):
                raise ConfigError(f"vision_config.{key}={values[key]!r}: only one int")
        config = cls(**values)
        if config.hidden_size % (4 * config.num_heads):  # 2-D RoPE: four quarters per head
            raise ConfigError(
                f"vision_config: hidden_size {config.hidden_size} is not num_heads "
                f"{config.num_heads} x a head width that is a multiple of 4"
            )
        if raw.get("head_dim") not in (None, config.head_dim):
            raise ConfigError(f"vision_config.head_dim={raw['head_dim']} is not hidden / heads")
        return config

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads


# transformers' Glm5NextConfig defaults (GLM-5.3-Flash's ids), for a config.json without them
IMAGE_TOKEN_IDS = {"image_token_id": 154854, "video_start_token_id": 154832}


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    layer_types: tuple[str, ...]
    mlp_layer_types: tuple[str, ...]
    indexer_types: tuple[str, ...]
    # dense MLP / MoE
    intermediate_size: int
    moe_intermediate_size: int
    n_routed_experts: int
    n_shared_experts: int
    num_experts_per_tok: int
    n_group: int
    topk_group: int
    norm_topk_prob: bool
    routed_scaling_factor: float
    swiglu_limit: float
    # MLA (NoPE)
    num_attention_heads: int
    q_lora_rank: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    v_head_dim: int
    # DSA indexer with kpool compression
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    index_kpool: int
    index_kpool_always_select_tail: bool
    # KDA
    linear_num_heads: int
    linear_head_dim: int
    linear_conv_kernel_dim: int
    linear_lower_bound: float | None
    # mHC
    hc_mult: int
    hc_eps: float
    hc_sinkhorn_iters: int
    rms_norm_eps: float = 1e-5
    max_position_embeddings: int = 1048576
    num_nextn_predict_layers: int = 0
    eos_token_ids: tuple[int, ...] = ()
    pad_token_id: int | None = None
    quantization: Fp8Config | None = None  # block-FP8 checkpoint (quantization_config)
    # the vision tower (None: a text-only checkpoint) and the ids the image path needs: each
    # image's <|image|> run, and <|begin_of_video|> (after it transformers reads images as video)
    vision: VisionConfig | None = None
    image_token_id: int | None = None
    video_start_token_id: int | None = None
    extra: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        self._validate()

    # ---- derived ----
    @property
    def kda_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == KDA]

    @property
    def dsa_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == DSA]

    @property
    def indexer_layers(self) -> list[int]:
        """DSA layers that run their own indexer (and so own index keys and a compression tail)."""
        return [i for i in self.dsa_layers if self.indexer_types[i] == "full"]

    @property
    def draft_layer_types(self) -> dict[int, str]:
        """The NextN draft's one layer: a DSA layer with its own indexer, numbered after the
        target's layers (its index in the checkpoint and in the draft's caches)."""
        return {self.num_hidden_layers: DSA}

    @property
    def index_select_pools(self) -> int:
        return self.index_topk // self.index_kpool

    @property
    def index_width(self) -> int:
        """Width of a top-k row: selected pools expanded to tokens, plus the open tail."""
        tail = self.index_kpool - 1 if self.index_kpool_always_select_tail else 0
        return self.index_topk + tail

    @property
    def kda_qkv_dim(self) -> int:
        return self.linear_num_heads * self.linear_head_dim

    # ---- construction ----
    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> ModelConfig:
        text = dict(raw.get("text_config") or raw)
        for key in ("num_nextn_predict_layers", "eos_token_id", "pad_token_id"):
            if key not in text and key in raw:
                text[key] = raw[key]
        n = _req(text, "num_hidden_layers", int)
        layer_types = text.get("layer_types") or [KDA if i % 4 != 3 else DSA for i in range(n)]
        layer_types = [DSA if t == "full_attention" else t for t in layer_types]
        mlp_types = text.get("mlp_layer_types") or (
            ["dense"] * min(3, n) + ["sparse"] * max(0, n - 3)
        )
        indexer_types = text.get("indexer_types")
        if indexer_types is None:
            pattern = text.get("index_topk_pattern")
            if pattern is not None:
                indexer_types = [{"F": "full", "S": "shared"}.get(c, c) for c in pattern]
            else:
                freq = max(int(text.get("index_topk_freq", 1)), 1)
                offset = int(text.get("index_skip_topk_offset", 2))
                indexer_types = [
                    "full" if max(i - offset + 1, 0) % freq == 0 else "shared" for i in range(n)
                ]
        linear = text.get("linear_attn_config") or {}
        lower_bound = linear.get("gate_lower_bound", text.get("linear_lower_bound", -5.0))
        if lower_bound is None and linear.get("safe_gate", False):
            lower_bound = -5.0
        if int(text.get("qk_rope_head_dim", 0) or 0) != 0:
            raise ConfigError(
                f"qk_rope_head_dim={text['qk_rope_head_dim']}: only NoPE DSA layers "
                "(qk_rope_head_dim=0) are supported"
            )
        if text.get("q_lora_rank") is None:
            raise ConfigError("q_lora_rank is required for DSA layers")
        quant = raw.get("quantization_config", text.get("quantization_config"))
        eos = text.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        known = {f.name for f in fields(cls)}
        vision = raw.get("vision_config") if "text_config" in raw else None
        if vision and int(vision.get("out_hidden_size", 0)) != int(text.get("hidden_size", 0)):
            # a tower that cannot feed this text model: transformers builds one by default for
            # every glm5_next, so a text-only training (the shipped small model) saves it
            log.warning(
                "vision_config.out_hidden_size=%s is not the text hidden_size %s: the vision "
                "tower is not served (text only)",
                vision.get("out_hidden_size"),
                text.get("hidden_size"),
            )
            vision = None
        ids = {k: int(raw.get(k, v)) for k, v in IMAGE_TOKEN_IDS.items()} if vision else {}
        return cls(
            vocab_size=_req(text, "vocab_size", int),
            hidden_size=_req(text, "hidden_size", int),
            num_hidden_layers=n,
            layer_types=tuple(layer_types),
            mlp_layer_types=tuple(mlp_types),
            indexer_types=tuple(indexer_types),
            intermediate_size=int(text.get("intermediate_size", 12288)),
            moe_intermediate_size=int(text.get("moe_intermediate_size", 2048)),
            n_routed_experts=int(text.get("n_routed_experts", 288)),
            n_shared_experts=int(text.get("n_shared_experts", 1)),
            num_experts_per_tok=int(text.get("num_experts_per_tok", 8)),
            n_group=int(text.get("n_group", 1) or 1),
            topk_group=int(text.get("topk_group", 1) or 1),
            norm_topk_prob=bool(text.get("norm_topk_prob", True)),
            routed_scaling_factor=float(text.get("routed_scaling_factor", 2.5)),
            swiglu_limit=float(text.get("swiglu_limit", 10.0)),
            num_attention_heads=int(text.get("num_attention_heads", 64)),
            q_lora_rank=int(text["q_lora_rank"]),
            kv_lora_rank=int(text.get("kv_lora_rank", 512)),
            qk_nope_head_dim=int(text.get("qk_nope_head_dim", 256)),
            v_head_dim=int(text.get("v_head_dim", 256)),
            index_n_heads=int(text.get("index_n_heads", 32)),
            index_head_dim=int(text.get("index_head_dim", 128)),
            index_topk=int(text.get("index_topk", 2048)),
            index_kpool=int(text.get("index_kpool", 16)),
            index_kpool_always_select_tail=bool(text.get("index_kpool_always_select_tail", True)),
            linear_num_heads=int(linear.get("num_heads", text.get("linear_num_heads", 64))),
            linear_head_dim=int(linear.get("head_dim", text.get("linear_head_dim", 128))),
            linear_conv_kernel_dim=int(
                linear.get("short_conv_kernel_size", text.get("linear_conv_kernel_dim", 4))
            ),
            linear_lower_bound=None if lower_bound is None else float(lower_bound),
            hc_mult=int(text.get("hc_mult", 4)),
            hc_eps=float(text.get("hc_eps", 1e-6)),
            hc_sinkhorn_iters=int(text.get("hc_sinkhorn_iters", 20)),
            rms_norm_eps=float(text.get("rms_norm_eps", 1e-5)),
            max_position_embeddings=int(text.get("max_position_embeddings", 1048576)),
            num_nextn_predict_layers=int(text.get("num_nextn_predict_layers", 0) or 0),
            eos_token_ids=eos_ids,
            pad_token_id=text.get("pad_token_id"),
            quantization=None if quant is None else Fp8Config.from_dict(quant),
            vision=VisionConfig.from_dict(vision) if vision else None,
            **ids,
            extra={k: v for k, v in text.items() if k not in known},
        )

    @classmethod
    def from_pretrained(cls, model_dir: str | Path) -> ModelConfig:
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise ConfigError(f"no config.json in {model_dir}")
        return cls.from_dict(json.loads(path.read_text()))

    def _validate(self) -> None:
        n = self.num_hidden_layers
        for name in ("layer_types", "mlp_layer_types", "indexer_types"):
            if len(getattr(self, name)) != n:
                raise ConfigError(
                    f"{name} has {len(getattr(self, name))} entries, num_hidden_layers is {n}"
                )
        for name, allowed in (
            ("layer_types", LAYER_TYPES),
            ("mlp_layer_types", MLP_TYPES),
            ("indexer_types", INDEXER_TYPES),
        ):
            for i, value in enumerate(getattr(self, name)):
                if value not in allowed:
                    raise ConfigError(
                        f"{name}[{i}]={value!r} is not supported (expected one of {allowed})"
                    )
        if self.index_kpool < 1:
            raise ConfigError(f"index_kpool must be >= 1, got {self.index_kpool}")
        if self.index_topk % self.index_kpool != 0:
            raise ConfigError(
                f"index_topk ({self.index_topk}) must be divisible by "
                f"index_kpool ({self.index_kpool})"
            )
        if self.n_routed_experts % self.n_group != 0:
            raise ConfigError(
                f"n_routed_experts ({self.n_routed_experts}) must be divisible by "
                f"n_group ({self.n_group})"
            )
        if not 1 <= self.topk_group <= self.n_group:
            raise ConfigError(
                f"topk_group={self.topk_group} must be in [1, n_group={self.n_group}]"
            )
        if self.num_experts_per_tok > self.n_routed_experts:
            raise ConfigError(
                f"num_experts_per_tok ({self.num_experts_per_tok}) exceeds "
                f"n_routed_experts ({self.n_routed_experts})"
            )
        experts_per_group = self.n_routed_experts // self.n_group
        if self.n_group > 1 and experts_per_group < 2:
            raise ConfigError(
                "n_group > 1 needs at least 2 experts per group (group score = top-2)"
            )
        # A shared layer reuses the selection of the nearest earlier full DSA layer.
        seen_full = False
        for i in self.dsa_layers:
            if self.indexer_types[i] == "full":
                seen_full = True
            elif not seen_full:
                raise ConfigError(
                    f"indexer_types[{i}]='shared' but no earlier DSA layer runs a full indexer"
                )
        if self.num_nextn_predict_layers not in (0, 1):
            raise ConfigError(
                f"num_nextn_predict_layers={self.num_nextn_predict_layers}: only 0 or 1 supported"
            )
        if self.hc_mult < 1:
            raise ConfigError(f"hc_mult must be >= 1, got {self.hc_mult}")


def _req(d: dict[str, Any], key: str, typ: type) -> Any:
    if key not in d or d[key] is None:
        raise ConfigError(f"config is missing required field {key!r}")
    try:
        return typ(d[key])
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"config field {key!r}={d[key]!r} is not a valid {typ.__name__}") from exc
