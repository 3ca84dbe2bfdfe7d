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
"""

from __future__ import annotations

import json
import logging
import re
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from kernels.fp8 import dequantize
from serving.config import ModelConfig
from serving.distributed import ParallelState, split, state
from serving.layers.linear import StackedProjections, stack_projections
from serving.models.fp8_choice import LinearChoice, choose_linears, linear_shape
from serving.models.fp8_weights import (
    SCALE_SUFFIX,
    ScaleSlice,
    TensorInfo,
    check_holdable,
    fp8_weights,
    read_header,
    scale_slice,
)
from serving.models.glm5_next import Glm5NextForCausalLM
from serving.models.nextn import NextNDraft

log = logging.getLogger(__name__)

_SKIPPED = re.compile(r"^model\.visual\.|^visual\.")
# DeepSeek-style NextN copies of the shared embedding / head: the draft uses the target's.
_NEXTN_COPIES = re.compile(r"\.(embed_tokens\.weight|shared_head\.head\.weight)$")
_RENAMES = (
    (re.compile(r"\.hc_attn_(fn|base|scale)$"), r".attn_hc.\1"),
    (re.compile(r"\.hc_ffn_(fn|base|scale)$"), r".ffn_hc.\1"),
    (re.compile(r"\.self_attn\.o_norm\.weight$"), ".self_attn.o_norm"),
    (re.compile(r"\.indexer\.k_norm\.(weight|bias)$"), r".indexer.k_norm_\1"),
    (re.compile(r"\.shared_head\.norm\.weight$"), ".shared_head_norm.weight"),
)
_EXPERT = re.compile(r"\.mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
_CONV = re.compile(r"\.self_attn\.([qkv])_conv1d\.weight$")


class CheckpointError(ValueError):
    """The checkpoint does not match the model config; the message names the tensor."""


@dataclass(frozen=True)
class Target:
    """Where one checkpoint tensor goes: a parameter, or one expert's rows of a stacked one
    (and, held in FP8, their block scales: `scale_rows` of `<param>_scale_inv`)."""

    param: str
    expert: int | None = None
    rows: slice | None = None
    scale_rows: slice | None = None

    def view(self, data: torch.Tensor) -> torch.Tensor:
        if self.expert is not None:
            data = data[self.expert]
        return data if self.rows is None else data[self.rows]

    def scale_view(self, data: torch.Tensor) -> torch.Tensor:
        if self.expert is not None:
            data = data[self.expert]
        return data if self.scale_rows is None else data[self.scale_rows]


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


def checkpoint_files(model_dir: str | Path) -> list[Path]:
    model_dir = Path(model_dir)
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = sorted({model_dir / f for f in weight_map.values()})
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise CheckpointError(f"index lists shards that do not exist: {missing}")
        return files
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"no *.safetensors files in {model_dir}")
    return files


def iter_tensors(model_dir: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    for path in checkpoint_files(model_dir):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


# Pages of a memory-mapped shard that reads touched stay in this process's RSS until the file is
# closed, and a column slice (row-parallel weights) touches every page of its tensor. So a shard
# is reopened after each window of this many tensor bytes: a rank's peak host memory is its own
# parameters plus about one window, not plus the whole file. (The header is parsed again per
# window: ~1 ms, 80 times for a 5 GB shard.)
MAPPED_WINDOW = 64 << 20


def _iter_slices(model_dir: str | Path):
    """(name, read) per checkpoint tensor; read(shard, padded) returns the whole tensor (shard
    None) or piece `rank` of `size` along `dim` for shard = (dim, size, rank), reading only that
    piece. padded: pieces are ceil(n / size) long and the last ones come back short (or empty),
    where the parameter ends in padding rows. Call each read before asking for the next tensor
    (its file may be closed after)."""
    for path in checkpoint_files(model_dir):
        with safe_open(str(path), framework="pt") as f:
            names = list(f.keys())
        at = 0
        while at < len(names):
            touched = [0]  # bytes of the tensors read through this mapping
            with safe_open(str(path), framework="pt") as f:
                while at < len(names) and touched[0] < MAPPED_WINDOW:
                    name = names[at]
                    at += 1

                    def read(spec, pad=False, f=f, name=name, touched=touched) -> torch.Tensor:
                        if spec is None:
                            t = f.get_tensor(name)
                            touched[0] += t.numel() * t.element_size()
                            return t
                        dim, size, rank = spec
                        sl = f.get_slice(name)
                        shape = sl.get_shape()
                        index = [slice(None)] * len(shape)
                        if pad:
                            share = -(-shape[dim] // size)
                            stop = min((rank + 1) * share, shape[dim])
                            index[dim] = slice(min(rank * share, stop), stop)
                        elif shape[dim] % size:
                            raise CheckpointError(
                                f"{name!r}: dim {dim} of {tuple(shape)} does not split over "
                                f"{size} ranks"
                            )
                        else:
                            index[dim] = split(shape[dim], size, rank)
                        t = sl[tuple(index)]
                        touched[0] += t.numel() * t.element_size() * size
                        return t

                    yield name, read


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


def _map_name(
    name: str, config: ModelConfig, load_draft: bool, ps: ParallelState | None = None
) -> tuple[str, Target] | None:
    """Checkpoint name -> ("target"|"draft", Target), or None when skipped on purpose (also:
    another EP rank's expert). Rows and expert ids of the Target are this rank's."""
    ps = ps or ParallelState()
    if _SKIPPED.search(name):
        return None
    if name == "lm_head.weight":
        return "target", Target("lm_head.weight")
    for prefix in ("model.language_model.", "model."):
        if name.startswith(prefix):
            local = name[len(prefix) :]
            break
    else:
        raise CheckpointError(f"unexpected tensor {name!r} (not under model. or lm_head)")
    if local == "embed_tokens.weight":
        return "target", Target("embed_tokens")
    m = re.match(r"layers\.(\d+)\.(.*)$", local)
    if m is None:
        return "target", Target(local)
    layer, rest = int(m.group(1)), "." + m.group(2)
    role = "target"
    if layer >= config.num_hidden_layers:
        if layer > config.num_hidden_layers or config.num_nextn_predict_layers == 0:
            raise CheckpointError(f"tensor {name!r} is beyond the model's layers")
        if not load_draft or _NEXTN_COPIES.search(rest):
            return None
        role, prefix_out = "draft", ""
    else:
        prefix_out = f"layers.{layer}"
    for pattern, repl in _RENAMES:
        rest = pattern.sub(repl, rest)
    if em := _EXPERT.search(rest):
        expert, kind = int(em.group(1)), em.group(2)
        mine = split(config.n_routed_experts, ps.ep_size, ps.ep_rank)
        if not mine.start <= expert < mine.stop:
            return None
        expert -= mine.start
        base = rest[: em.start()] + ".mlp."
        if kind == "down_proj":
            return role, _target(f"{prefix_out}{base}w2", expert)
        half = 0 if kind == "gate_proj" else 1
        inter = config.moe_intermediate_size // ps.moe_tp_size
        rows = slice(half * inter, (half + 1) * inter)
        nb = -(-inter // 128)  # block rows of each half's scales
        return role, _target(
            f"{prefix_out}{base}w13", expert, rows, slice(half * nb, (half + 1) * nb)
        )
    if cm := _CONV.search(rest):
        part = "qkv".index(cm.group(1))
        qkv = config.kda_qkv_dim // ps.tp_size
        param = f"{prefix_out}{rest[: cm.start()]}.self_attn.conv_weight"
        return role, _target(param, rows=slice(part * qkv, (part + 1) * qkv))
    return role, _target(prefix_out + rest)


def _target(
    param: str,
    expert: int | None = None,
    rows: slice | None = None,
    scale_rows: slice | None = None,
) -> Target:
    return Target(param.lstrip("."), expert, rows, scale_rows)


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
    scales = _read_scales(files, header, config, load_draft, ps, params)
    filled: dict[tuple[str, str], int] = {}
    read_bytes = sum(t.numel() * t.element_size() for t, _ in scales.values())
    for name, read in _iter_slices(model_dir):
        if name.endswith(SCALE_SUFFIX):
            continue  # read with its weight (_read_scales)
        mapped = _map_name(name, config, load_draft, ps)
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
                tensor = _dequantize(tensor, scale, where)
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


def log_fp8_linear_backends(roots, dtype: torch.dtype, device) -> None:
    """Decide now (kernels/triton/fp8.py probes each weight shape once) and log which GEMM the
    FP8 linears use above the skinny GEMM's token rows: torch._scaled_mm (cuBLASLt block
    scales) or the Triton GEMM; the parts' shapes and their stacks' (after stack_projections)."""
    from kernels.triton.fp8 import linear_backends

    modules = [m for root in roots if root is not None for m in root.modules()]
    shapes = [
        tuple(m.weight.shape)
        for m in modules
        if getattr(m, "weight_scale_inv", None) is not None and m.weight.dim() == 2
    ]
    for stack in (v for m in modules for v in vars(m).values()):
        if isinstance(stack, StackedProjections):
            shapes += [tuple(g.weight.shape) for g in stack.gemms if g.scale is not None]
    chosen = linear_backends(shapes, dtype, device)
    by_backend: dict[str, list[str]] = {}
    for (n, k), backend in chosen.items():
        by_backend.setdefault(backend, []).append(f"{n}x{k}")
    log.info(
        "FP8 linears (%d weights, %d shapes): %s",
        len(shapes),
        len(chosen),
        "; ".join(f"{b} for {', '.join(s)}" for b, s in sorted(by_backend.items())) or "none",
    )


def _fill(name: str, role: str, param: str, tensor: torch.Tensor, dst: torch.Tensor) -> None:
    if tuple(tensor.shape) != tuple(dst.shape):
        raise CheckpointError(
            f"shape mismatch for {name!r}: checkpoint {tuple(tensor.shape)}, "
            f"model expects {tuple(dst.shape)} ({role}.{param})"
        )
    dst.copy_(tensor.to(dst.dtype))


def _dequantize(w8: torch.Tensor, scale: torch.Tensor, where: ScaleSlice) -> torch.Tensor:
    """float32 weights of a share read with the scale blocks that cover it."""
    if where.dim == 0:
        return dequantize(w8, scale, where.offset)
    return dequantize(w8.T, scale.T, where.offset).T


def hold_fp8_modules(
    selected: list[tuple[str, str, torch.nn.Module]],
    dense_shapes: frozenset[tuple[int, int]] = frozenset(),
) -> None:
    """hold_fp8() on every module fp8_modules() selected but the projections whose weight shape
    is in dense_shapes (fp8_choice: FP8 not faster there)."""
    fp8 = _selected(selected)
    for _, _, module in selected:
        if linear_shape(module, fp8) not in dense_shapes:
            module.hold_fp8()


def _selected(selected: list[tuple[str, str, torch.nn.Module]]):
    """fp8_choice.linear_shape's predicate: the parts of a stack that fp8_modules selected."""
    ids = {id(module) for _, _, module in selected}
    return lambda part: id(part) in ids


def fp8_modules(
    modules: dict[str, torch.nn.Module],
    header: dict[str, TensorInfo] | None,
    fp8: set[str],
    config: ModelConfig,
    load_draft: bool,
    ps: ParallelState,
    keep_bf16: frozenset[str],
) -> list[tuple[str, str, torch.nn.Module]]:
    """(role, path, module) of every module with a `kind` not in keep_bf16 whose checkpoint
    tensors (this rank's) are all FP8; refuses shares whose scale blocks are not their own.
    header None (a config-only FP8 checkpoint: the memory plan, a simulated rank): every module
    with a `kind` not in keep_bf16."""
    tensors: dict[tuple[str, str], list[tuple[str, Target]]] = {}
    for name in header or ():
        if (
            name.endswith(SCALE_SUFFIX)
            or (mapped := _map_name(name, config, load_draft, ps)) is None
        ):
            continue
        role, target = mapped
        tensors.setdefault((role, target.param.rpartition(".")[0]), []).append((name, target))
    out = []
    for role, root in modules.items():
        params = dict(root.named_parameters())
        for path, module in root.named_modules():
            kind = getattr(module, "kind", None)
            if kind is None or kind in keep_bf16:
                continue
            if header is not None:
                mine = tensors.get((role, path), [])
                if not mine or any(name not in fp8 for name, _ in mine):
                    continue
                for name, target in mine:
                    shard = getattr(params.get(target.param), "shard", None)
                    check_holdable(name, header[name].shape, shard, kind)
            out.append((role, path, module))
    return out


def choose_and_hold(
    held: list[tuple[str, str, torch.nn.Module]], dtype: torch.dtype, device, policy: str
) -> LinearChoice:
    """fp8_choice's decision for these modules (fp8_modules' list), then hold_fp8() on each
    but the projections it sends to the dense path."""
    shapes: dict[tuple[int, int], list[str]] = {}
    fp8 = _selected(held)
    for role, path, module in held:
        shape = linear_shape(module, fp8)
        if shape is not None:
            shapes.setdefault(shape, []).append(f"{role}.{path}" if role == "draft" else path)
    choice = choose_linears(shapes, dtype, device, policy)
    hold_fp8_modules(held, choice.dense_shapes)
    return choice


def _read_scales(
    files: list[Path],
    header: dict[str, TensorInfo],
    config: ModelConfig,
    load_draft: bool,
    ps: ParallelState,
    params: dict[str, dict[str, torch.nn.Parameter]],
) -> dict[str, tuple[torch.Tensor, ScaleSlice]]:
    """This rank's scale blocks of every FP8 weight it loads, float32, by weight name."""
    out = {}
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                if not name.endswith(SCALE_SUFFIX):
                    continue
                weight = name[: -len(SCALE_SUFFIX)]
                mapped = _map_name(weight, config, load_draft, ps)
                if mapped is None or (param := params[mapped[0]].get(mapped[1].param)) is None:
                    continue  # skipped on purpose, or the weight's own error comes next
                where = scale_slice(header[weight].shape, getattr(param, "shard", None))
                out[weight] = (f.get_slice(name)[where.index()].float(), where)
    return out


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
