"""Turn a bf16 / float32 checkpoint into a block-FP8 one, as GLM-5 and DeepSeek-V3 publish theirs.

    python -m serving.tools.quantize_fp8 SRC DST [--ue8m0]

Quantized (float8_e4m3fn + float32 `weight_scale_inv` per 128 x 128 block, kernels/fp8.py): the
attention projections (KDA q/k/v/o, f_a/f_b, g_a/g_b, b; MLA q_a/q_b, kv_a, kv_b, o), the
indexer's wq_b and wk, the dense MLP, the shared and the routed experts, in the target's layers
and the NextN layer's alike. Everything else is copied as it is: norms, the router gate and its
float32 correction bias, embeddings, lm_head, the indexer's weights_proj, k_norm and kpool
gate/ape, the NextN layer's enorm/hnorm/eh_proj/shared_head norm, KDA's conv, gates and A_log,
mHC. config.json gets `quantization_config`; the other files (tokenizer, template) are copied.
Shards map one to one; the index, if any, names the new scale tensors. SRC may equal DST.
--ue8m0: scales rounded up to powers of two (`scale_fmt: "ue8m0"`).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from kernels.fp8 import quantize_weight
from serving.layers.stacked_projections import stack_projections
from serving.models.fp8_choice import linear_shape
from serving.models.fp8_weights import SCALE_SUFFIX
from serving.models.loader import checkpoint_files
from serving.models.vision_loader import VISION_PREFIX

# the tower's mlp.*_proj names match this too: it stays in the checkpoint's dtype (GLM-5.3-Flash
# ships it in bf16 beside FP8 text weights)
QUANTIZED = re.compile(
    r"\.self_attn\.(q|k|v|o|f_a|f_b|g_a|g_b|b|q_a|q_b|kv_a|kv_b)_proj(_with_mqa)?\.weight$"
    r"|\.self_attn\.indexer\.(wq_b|wk)\.weight$"
    r"|\.mlp\.(shared_experts\.|experts\.\d+\.)?(gate|up|down)_proj\.weight$"
)


def quantization_config(ue8m0: bool = False) -> dict:
    q = {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": [128, 128],
    }
    if ue8m0:
        q["scale_fmt"] = "ue8m0"
    return q


def quantize_checkpoint(src: str | Path, dst: str | Path, ue8m0: bool = False) -> Path:
    src, dst = Path(src), Path(dst)
    files = checkpoint_files(src)
    dst.mkdir(parents=True, exist_ok=True)
    if dst.resolve() != src.resolve():
        for path in src.iterdir():
            if path.is_file() and path.suffix != ".safetensors":
                shutil.copy2(path, dst / path.name)
    weight_map: dict[str, str] = {}
    for path in files:
        out: dict[str, torch.Tensor] = {}
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {"format": "pt"}
            for name in f.keys():
                tensor = f.get_tensor(name)
                if name.endswith(SCALE_SUFFIX) or tensor.dtype == torch.float8_e4m3fn:
                    raise SystemExit(f"error: {src} is already quantized ({name})")
                if QUANTIZED.search(name) and not name.startswith(VISION_PREFIX):
                    if tensor.dim() != 2:
                        raise SystemExit(
                            f"error: {name}: expected a 2-D weight, got {tensor.shape}"
                        )
                    tensor, scale = quantize_weight(tensor, ue8m0)
                    out[name + SCALE_SUFFIX] = scale
                out[name] = tensor
        weight_map.update({n: path.name for n in out})
        tmp = dst / (path.name + ".tmp")
        save_file(out, str(tmp), metadata=meta)
        os.replace(tmp, dst / path.name)
    index = src / "model.safetensors.index.json"
    if index.is_file():
        raw = json.loads(index.read_text())
        sizes = sum((dst / f).stat().st_size for f in set(weight_map.values()))
        raw["weight_map"] = dict(sorted(weight_map.items()))
        raw.setdefault("metadata", {})["total_size"] = sizes
        (dst / index.name).write_text(json.dumps(raw, indent=2) + "\n")
    write_fp8_config(dst, ue8m0)
    return dst


def quantize_model(
    model: torch.nn.Module, dense_shapes: frozenset[tuple[int, int]] = frozenset()
) -> torch.nn.Module:
    """In memory, what quantize_checkpoint then a CUDA load give (for benchmarks on random
    weights): every module with FP8 kernels (a `kind`) holds block-FP8 weights quantized from
    its own, the routed experts' gate and up halves apart; but the projections whose weight
    shape is in dense_shapes (serving/models/fp8_choice.py: FP8 not faster) stay as they are,
    as the loader dequantizes them. kv_b stays as it is: the loader dequantizes it anyway. The
    projections are stacked again at the end, FP8 parts with FP8 parts, as after a load (a
    copy.deepcopy of a model leaves its stacks stale, running their parts one by one)."""
    for module in model.modules():
        if getattr(module, "kind", None) is None or linear_shape(module) in dense_shapes:
            continue
        if module.kind == "moe":
            w13, w2 = module.w13.data, module.w2.data
            module.hold_fp8()
            inter = w13.shape[1] // 2
            (g8, gs), (u8, us) = quantize_weight(w13[:, :inter]), quantize_weight(w13[:, inter:])
            module.w13.data.copy_(torch.cat([g8, u8], dim=1))
            module.w13_scale_inv.data.copy_(torch.cat([gs, us], dim=1))
            w8, scale = quantize_weight(w2)
            module.w2.data.copy_(w8)
            module.w2_scale_inv.data.copy_(scale)
        else:
            w = module.weight.data
            module.hold_fp8()
            w8, scale = quantize_weight(w)
            module.weight.data.copy_(w8)
            module.weight_scale_inv.data.copy_(scale)
    stack_projections(model)
    return model


def write_fp8_config(model_dir: Path, ue8m0: bool = False) -> None:
    """Add quantization_config to model_dir/config.json (top level, as GLM's)."""
    path = model_dir / "config.json"
    raw = json.loads(path.read_text())
    raw["quantization_config"] = quantization_config(ue8m0)
    path.write_text(json.dumps(raw, indent=2) + "\n")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("src")
    ap.add_argument("dst")
    ap.add_argument("--ue8m0", action="store_true", help="power-of-two scales (scale_fmt ue8m0)")
    args = ap.parse_args(argv)
    out = quantize_checkpoint(args.src, args.dst, args.ue8m0)
    print(f"wrote the block-FP8 checkpoint to {out}")


if __name__ == "__main__":
    main()
