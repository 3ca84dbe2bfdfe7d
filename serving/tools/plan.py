"""Print one rank's memory plan from config.json alone: no GPU, no weights.

    python -m serving.tools.plan --model-path DIR --tp-size 8 --ep-size 8 \\
        --mem-fraction-static 0.70 --context-length 69632 --max-running-requests 32 \\
        --disaggregation-decode-extra-slots 64 --gpu-memory-gib 141 [--speculative-num-steps 1]

Weights per rank come from the sharded modules built on the meta device (the same code that
loads them), bytes per token and per request row from the pool's own formulas
(serving/memory/pool.py), rows = running + extra + 1 (the padding row).

Block-FP8 checkpoints are planned as a CUDA rank loads them: the modules whose checkpoint
tensors are FP8 (read from the safetensors headers) hold 1-byte weights plus float32 scales,
minus the kinds in --fp8-keep-bf16. A config-only checkpoint with `quantization_config`
(`tiny_model --preset real --fp8`) counts every module with FP8 kernels as FP8.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

import torch

from serving.config import ModelConfig, parse_fp8_kinds
from serving.distributed import ParallelState, check_sizes, rank_cache_config, set_state, state
from serving.memory.cache import tail_slots_for
from serving.memory.pool import fit_kv_tokens, row_bytes, token_bytes
from serving.models.fp8_weights import TensorInfo, fp8_weights, read_header
from serving.models.glm5_next import Glm5NextForCausalLM
from serving.models.loader import hold_fp8_modules, resolve_dtype
from serving.models.nextn import NextNDraft

GIB = 2**30


@dataclass(frozen=True)
class Fp8Plan:
    """What decides which modules hold FP8: the checkpoint's headers (None: config only)."""

    header: dict[str, TensorInfo] | None
    fp8: frozenset[str]
    keep_bf16: frozenset[str]


def fp8_plan(model_path: str, config: ModelConfig, keep_bf16: frozenset[str]) -> Fp8Plan | None:
    files = sorted(Path(model_path).glob("*.safetensors"))
    if files:
        header = {}
        for path in files:
            header.update(read_header(path))
        fp8 = fp8_weights(header)
        return Fp8Plan(header, frozenset(fp8), keep_bf16) if fp8 else None
    if config.quantization is not None:
        return Fp8Plan(None, frozenset(), keep_bf16)
    return None


def rank_weights(
    config: ModelConfig, dtype: torch.dtype, draft: bool, fp8: Fp8Plan | None = None
) -> tuple[int, int]:
    """(bytes, parameters) of this rank's modules (every rank holds the same amount)."""
    with torch.device("meta"):
        modules = {"target": Glm5NextForCausalLM(config, dtype)}
        if draft:
            modules["draft"] = NextNDraft(config, dtype)
    if fp8 is not None:
        hold_fp8_modules(modules, fp8.header, set(fp8.fp8), config, draft, state(), fp8.keep_bf16)
    params = [p for m in modules.values() for p in m.parameters()]
    return sum(p.numel() * p.element_size() for p in params), sum(p.numel() for p in params)


def plan(args: argparse.Namespace) -> list[str]:
    config = ModelConfig.from_pretrained(args.model_path)
    check_sizes(config, args.tp_size, args.ep_size)
    dtype = resolve_dtype(args.dtype, args.model_path)
    elem = torch.tensor([], dtype=dtype).element_size()
    steps, draft = args.speculative_num_steps, args.speculative_num_steps > 0
    context = args.context_length or config.max_position_embeddings
    rows = args.max_running_requests + args.disaggregation_decode_extra_slots
    fp8 = fp8_plan(args.model_path, config, parse_fp8_kinds(args.fp8_keep_bf16))
    full_weights, full_params = rank_weights(config, dtype, draft, fp8)
    set_state(ParallelState(0, args.tp_size, args.ep_size))
    try:
        weights, _ = rank_weights(config, dtype, draft, fp8)
        tail = tail_slots_for(config, steps + 1)
        per_row = row_bytes(rank_cache_config(config), elem, tail, draft)
    finally:
        set_state(ParallelState())
    per_token = token_bytes(config, elem, draft)
    total = int(args.gpu_memory_gib * GIB)
    table = (rows + 1) * context * 8
    stored = str(dtype).removeprefix("torch.")
    if fp8 is not None:
        stored = f"block FP8 + {stored}" + (
            f", {','.join(sorted(fp8.keep_bf16))} kept in {stored}" if fp8.keep_bf16 else ""
        )
    lines = [
        f"model {args.model_path}: {full_params / 1e9:.1f} B parameters "
        f"({full_weights / GIB:.1f} GiB {stored}), draft {'yes' if draft else 'no'}",
        f"ranks {max(args.tp_size, args.ep_size)} (tp {args.tp_size}, ep {args.ep_size}); "
        f"device {args.gpu_memory_gib:g} GiB x {args.mem_fraction_static} = "
        f"{total * args.mem_fraction_static / GIB:.1f} GiB static",
        f"weights per rank        {weights / GIB:8.2f} GiB",
        f"request rows            {rows + 1:8d} (running {args.max_running_requests} + extra "
        f"{args.disaggregation_decode_extra_slots} + 1 padding)",
        f"bytes per request row   {per_row:8d} ({(rows + 1) * per_row / GIB:.2f} GiB for all rows)",
        f"request table           {table / GIB:8.2f} GiB ({context} positions x 8 B per row)",
        f"bytes per KV token      {per_token:8d} (MLA latents + pooled index keys, replicated)",
    ]
    try:
        tokens = fit_kv_tokens(
            total, args.mem_fraction_static, weights, rows, context, per_row, per_token
        )
        tokens -= tokens % args.page_size
        lines.append(
            f"KV tokens per GPU       {tokens:8d} ({tokens * per_token / GIB:.2f} GiB; "
            f"{tokens / context:.1f} full {context}-token contexts)"
        )
    except ValueError as exc:
        lines.append(f"does not fit: {exc}")
    return lines


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model-path", required=True)
    ap.add_argument("--tp-size", type=int, default=1)
    ap.add_argument("--ep-size", type=int, default=1)
    ap.add_argument("--mem-fraction-static", type=float, default=0.8)
    ap.add_argument("--context-length", type=int, default=None)
    ap.add_argument("--max-running-requests", type=int, default=32)
    ap.add_argument("--disaggregation-decode-extra-slots", type=int, default=0)
    ap.add_argument("--gpu-memory-gib", type=float, default=141.0)
    ap.add_argument("--speculative-num-steps", type=int, default=0)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--fp8-keep-bf16", default=None, help="as the server's flag")
    ap.add_argument("--page-size", type=int, default=64)
    args = ap.parse_args(argv)
    try:
        print("\n".join(plan(args)))
    except ValueError as exc:
        raise SystemExit(f"error: {exc}") from None


if __name__ == "__main__":
    main()
