"""Load a glm5_next checkpoint (config.json + safetensors) into our modules.

Accepts what transformers 5.17 `save_pretrained` writes for glm5_next (the original checkpoint
naming: `model.language_model.layers.N.hc_attn_fn`, split `q_conv1d/k_conv1d/v_conv1d`,
per-expert `mlp.experts.E.gate_proj.weight`) and flat text-only checkpoints (`model.layers...`).
The NextN layer sits at `layers.{num_hidden_layers}`.

Every parameter must be filled exactly; an unknown tensor, a missing one or a shape mismatch is
an error that names it. Vision-tower tensors are skipped (this is the text path).

Under TP/EP each rank reads only its own slices (safe_open + get_slice): a parameter marked with
`shard` (serving/layers/linear.py) gets its piece of the checkpoint tensor, routed experts of
other EP ranks are never read. No rank materialises the whole checkpoint.

Block-FP8 checkpoints (serving/models/fp8_weights.py): an FP8 tensor's share is read with the
scale blocks that cover it. With `fp8_execution` (default: on CUDA) every module that has FP8
kernels (a `kind`, not in `keep_bf16`) and whose tensors are all FP8 holds them as they are,
but the projections whose FP8 GEMM is not faster than the dense one on this device
(serving/models/fp8_choice.py); everything else, and every module on the CPU, gets them
dequantized once, here.

Its parts: checkpoint_reader.py (the files and this rank's slices), weight_names.py (which
parameter each tensor fills), fp8_loading.py (FP8 held or dequantized); this module fills the
modules from them and exports ours back under the checkpoint's names.
"""

from __future__ import annotations

import json
import logging
import re
import shutil
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from serving.config import ModelConfig
from serving.distributed import state
from serving.layers.stacked_projections import stack_projections
from serving.models.checkpoint_reader import CheckpointError, checkpoint_files, iter_slices
from serving.models.fp8_loading import (
    choose_and_hold,
    dequantize_share,
    fp8_modules,
    log_fp8_linear_backends,
    read_scales,
)
from serving.models.fp8_weights import SCALE_SUFFIX, TensorInfo, fp8_weights, read_header
from serving.models.glm5_next import Glm5NextForCausalLM
from serving.models.nextn import NextNDraft
from serving.models.weight_names import map_name

log = logging.getLogger(__name__)


def resolve_dtype(name: str, model_dir: str | Path, device: str | None = None) -> torch.dtype:
    """--dtype: auto (the checkpoint's own dtype, bfloat16 if unstated; float32 when `device` is
    the CPU, which has no fast bf16 matmul on most x86 machines), bfloat16, float32."""
    table = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}
    if name == "auto" and device is not None and torch.device(device).type == "cpu":
        return torch.float32
    if name == "auto":
        raw = json.loads((Path(model_dir) / "config.json").read_text())
        text = raw.get("text_config") or {}
        name = raw.get("dtype") or raw.get("torch_dtype") or text.get("dtype") or "bfloat16"
    if name not in table:
        raise CheckpointError(f"--dtype {name!r} is not supported (auto, bfloat16, float32)")
    return table[name]


def rewrite_checkpoint(model_dir: str | Path, out_dir: str | Path, new: dict[str, torch.Tensor]):
    """Copy model_dir to out_dir (may be the same) with the `new` tensors replaced, each stored
    in the dtype of the tensor it replaces; shards that hold none of them are left as they are."""
    src, out = Path(model_dir), Path(out_dir)
    shards = {}
    for path in checkpoint_files(src):
        with safe_open(str(path), framework="pt") as f:
            shards[path] = list(f.keys())
    missing = set(new) - {n for names in shards.values() for n in names}
    if missing:
        raise CheckpointError(f"not in {model_dir}: {sorted(missing)}")
    if out.resolve() != src.resolve():
        shutil.copytree(src, out, dirs_exist_ok=True)
    for path, names in shards.items():
        if not any(n in new for n in names):
            continue
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata()
            tensors = {n: f.get_tensor(n) for n in names}
        for n in set(names) & set(new):
            tensors[n] = new[n].to(tensors[n].dtype)
        save_file(
            {k: v.contiguous() for k, v in tensors.items()},
            str(out / path.name),
            metadata=meta or {"format": "pt"},
        )


def load_weights(
    model_dir: str | Path,
    config: ModelConfig,
    dtype: torch.dtype,
    device: torch.device | str = "cpu",
    load_draft: bool = False,
    fp8_execution: bool | None = None,
    keep_bf16: frozenset[str] = frozenset(),
    fp8_linears: str = "timed",
) -> tuple[Glm5NextForCausalLM, NextNDraft | None]:
    """Build the target (and the NextN draft if asked) and fill them from the checkpoint.
    fp8_execution (default: device is CUDA): FP8 tensors stay FP8 in the modules that have FP8
    kernels, except the layer kinds in keep_bf16 and (fp8_linears "timed", on CUDA) the
    projection shapes where FP8 is not faster (serving/models/fp8_choice.py); otherwise they
    are dequantized to `dtype`. The target's `fp8_choice` records that decision (None: no FP8
    held)."""
    files = checkpoint_files(model_dir)
    header: dict[str, TensorInfo] = {}
    for path in files:
        header.update(read_header(path))
    fp8 = fp8_weights(header)
    modules: dict[str, torch.nn.Module] = {"target": Glm5NextForCausalLM(config, dtype)}
    if load_draft:
        if config.num_nextn_predict_layers == 0:
            raise CheckpointError("a NextN draft was requested but num_nextn_predict_layers is 0")
        modules["draft"] = NextNDraft(config, dtype)
    ps = state()
    if fp8_execution is None:
        fp8_execution = torch.device(device).type == "cuda"
    choice = None
    if fp8 and fp8_execution:
        holders = fp8_modules(modules, header, fp8, config, load_draft, ps, keep_bf16)
        choice = choose_and_hold(holders, dtype, device, fp8_linears)
    params = {role: dict(module.named_parameters()) for role, module in modules.items()}
    scales = read_scales(files, header, config, load_draft, ps, params)
    filled: dict[tuple[str, str], int] = {}
    read_bytes = sum(t.numel() * t.element_size() for t, _ in scales.values())
    for name, read in iter_slices(model_dir):
        if name.endswith(SCALE_SUFFIX):
            continue  # read with its weight (_read_scales)
        mapped = map_name(name, config, load_draft, ps)
        if mapped is None:
            continue
        role, target = mapped
        param = params[role].get(target.param)
        if param is None:
            raise CheckpointError(f"unknown tensor {name!r} (no parameter {role}.{target.param})")
        shard = getattr(param, "shard", None)
        pad = getattr(param, "padded", False)
        tensor = read(shard, pad)
        read_bytes += tensor.numel() * tensor.element_size()
        dst = target.view(param.data)
        if name in fp8:
            scale, where = scales[name]
            held = params[role].get(target.param + SCALE_SUFFIX)
            if held is None:
                tensor = dequantize_share(tensor, scale, where)
            else:
                _fill(name, role, target.param + SCALE_SUFFIX, scale, target.scale_view(held.data))
                key = (role, target.param + SCALE_SUFFIX)
                filled[key] = filled.get(key, 0) + scale.numel()
        if target.param.endswith("conv_weight") and tensor.dim() == 3:
            tensor = tensor.squeeze(1)  # depthwise conv1d weights are stored [C, 1, K]
        if pad and shard is not None and tensor.shape[shard[0]] < dst.shape[shard[0]]:
            dim, real = shard[0], tensor.shape[shard[0]]
            dst.narrow(dim, real, dst.shape[dim] - real).zero_()  # padding rows: zero
            dst = dst.narrow(dim, 0, real)
            filled[(role, target.param)] = filled.get((role, target.param), 0) + (
                param.numel() - dst.numel()
            )
        _fill(name, role, target.param, tensor, dst)
        key = (role, target.param)
        filled[key] = filled.get(key, 0) + dst.numel()
    missing = [
        f"{role}.{pname}"
        for role, table in params.items()
        for pname, p in table.items()
        if filled.get((role, pname), 0) != p.numel()
    ]
    if missing:
        raise CheckpointError(
            f"checkpoint tensors missing (or given twice) for: {', '.join(sorted(missing))}"
        )
    total = sum(f.stat().st_size for f in files)
    log.info(
        "rank %d: read %.1f MiB of the checkpoint's %.1f MiB%s",
        ps.rank,
        read_bytes / 2**20,
        total / 2**20,
        f"; {len(fp8)} FP8 tensors, {'held in FP8' if fp8_execution else 'dequantized'}"
        if fp8
        else "",
    )
    target_model = modules["target"].to(device).eval()
    target_model.checkpoint_bytes_read = read_bytes  # type: ignore[assignment]
    target_model.fp8_choice = choice  # type: ignore[assignment]
    draft = modules.get("draft")
    if draft is not None:
        draft = draft.to(device).eval()
    stack_projections(target_model, draft)  # after .to(device): it would replace the views
    if fp8 and fp8_execution and torch.device(device).type == "cuda":
        log_fp8_linear_backends([target_model, draft], dtype, device)
    return target_model, draft


def _fill(name: str, role: str, param: str, tensor: torch.Tensor, dst: torch.Tensor) -> None:
    if tuple(tensor.shape) != tuple(dst.shape):
        raise CheckpointError(
            f"shape mismatch for {name!r}: checkpoint {tuple(tensor.shape)}, "
            f"model expects {tuple(dst.shape)} ({role}.{param})"
        )
    dst.copy_(tensor.to(dst.dtype))


_EXPORT_RENAMES = (
    (re.compile(r"\.attn_hc\.(fn|base|scale)$"), r".hc_attn_\1"),
    (re.compile(r"\.ffn_hc\.(fn|base|scale)$"), r".hc_ffn_\1"),
    (re.compile(r"\.self_attn\.o_norm$"), ".self_attn.o_norm.weight"),
    (re.compile(r"\.indexer\.k_norm_(weight|bias)$"), r".indexer.k_norm.\1"),
    (re.compile(r"(^|\.)shared_head_norm\.weight$"), r"\1shared_head.norm.weight"),
)


def export_checkpoint(
    config: ModelConfig, target: Glm5NextForCausalLM, draft: NextNDraft | None
) -> dict[str, torch.Tensor]:
    """The inverse of load_weights: our parameters under the glm5_next checkpoint names."""
    out = export_module("", target)
    if draft is not None:
        out.update(export_module(f"layers.{config.num_hidden_layers}.", draft))
    return out


def export_module(layer_prefix: str, module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """One module's parameters under checkpoint names: the target ("") or the NextN draft
    (`layers.{num_hidden_layers}.`)."""
    prefix = "model.language_model."
    out: dict[str, torch.Tensor] = {}
    for pname, p in module.named_parameters():
        name = layer_prefix + pname
        t = p.detach().cpu().contiguous()
        if name == "lm_head.weight":
            out[name] = t
            continue
        if name == "embed_tokens":
            out[prefix + "embed_tokens.weight"] = t
            continue
        for pattern, repl in _EXPORT_RENAMES:
            name = pattern.sub(repl, name)
        if name.endswith(".self_attn.conv_weight"):
            base = name[: -len("conv_weight")]
            for part, chunk in zip("qkv", t.chunk(3)):
                out[f"{prefix}{base}{part}_conv1d.weight"] = chunk.unsqueeze(1).contiguous()
        elif name.endswith(".mlp.w13"):
            base = name[: -len("w13")]
            for e in range(t.shape[0]):
                gate, up = t[e].chunk(2)
                out[f"{prefix}{base}experts.{e}.gate_proj.weight"] = gate.contiguous()
                out[f"{prefix}{base}experts.{e}.up_proj.weight"] = up.contiguous()
        elif name.endswith(".mlp.w2"):
            base = name[: -len("w2")]
            for e in range(t.shape[0]):
                out[f"{prefix}{base}experts.{e}.down_proj.weight"] = t[e].contiguous()
        else:
            out[prefix + name] = t
    return out
