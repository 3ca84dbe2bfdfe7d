"""Print one rank's memory plan from config.json alone: no GPU, no weights.

    python -m serving.tools.plan --model-path DIR --tp-size 8 --ep-size 8 \\
        --mem-fraction-static 0.70 --context-length 69632 --max-running-requests 32 \\
        --disaggregation-decode-extra-slots 64 --gpu-memory-gib 141 [--speculative-num-steps 1]

Weights per rank come from the sharded modules built on the meta device (the same code that
loads them), bytes per token and per request row from the pool's own formulas
(serving/memory/pool.py), rows = running + extra + 1 (the padding row).
"""

from __future__ import annotations

import argparse

import torch

from serving.config import ModelConfig
from serving.distributed import ParallelState, check_sizes, rank_cache_config, set_state
from serving.memory.cache import tail_slots_for
from serving.memory.pool import fit_kv_tokens, kda_state_bytes, row_bytes, token_bytes
from serving.models.glm5_next import Glm5NextForCausalLM
from serving.models.loader import resolve_dtype
from serving.models.nextn import NextNDraft

GIB = 2**30


def rank_weight_bytes(config: ModelConfig, dtype: torch.dtype, draft: bool) -> int:
    """Bytes of one rank's parameters (rank 0; every rank holds the same amount)."""
    with torch.device("meta"):
        modules = [Glm5NextForCausalLM(config, dtype)]
        if draft:
            modules.append(NextNDraft(config, dtype))
    return sum(p.numel() * p.element_size() for m in modules for p in m.parameters())


def plan(args: argparse.Namespace) -> list[str]:
    config = ModelConfig.from_pretrained(args.model_path)
    check_sizes(config, args.tp_size, args.ep_size)
    dtype = resolve_dtype(args.dtype, args.model_path)
    elem = torch.tensor([], dtype=dtype).element_size()
    steps, draft = args.speculative_num_steps, args.speculative_num_steps > 0
    context = args.context_length or config.max_position_embeddings
    rows = args.max_running_requests + args.disaggregation_decode_extra_slots
    full_weights = rank_weight_bytes(config, dtype, draft)
    set_state(ParallelState(0, args.tp_size, args.ep_size))
    try:
        weights = rank_weight_bytes(config, dtype, draft)
        tail = tail_slots_for(config, steps + 1)
        per_row = row_bytes(rank_cache_config(config), elem, tail, draft)
        per_snapshot = kda_state_bytes(rank_cache_config(config), elem)
    finally:
        set_state(ParallelState())
    per_token = token_bytes(config, elem, draft)
    total = int(args.gpu_memory_gib * GIB)
    table = (rows + 1) * context * 8
    lines = [
        f"model {args.model_path}: {full_weights / elem / 1e9:.1f} B parameters "
        f"({full_weights / GIB:.1f} GiB {str(dtype).removeprefix('torch.')}), "
        f"draft {'yes' if draft else 'no'}",
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
    ratio = args.mamba_full_memory_ratio  # the prefix cache's snapshots (plan_pool's rule)
    try:
        tokens = fit_kv_tokens(
            total,
            args.mem_fraction_static,
            weights,
            rows,
            context,
            per_row,
            int(per_token * (1 + ratio)),
        )
        tokens -= tokens % args.page_size
        lines.append(
            f"KV tokens per GPU       {tokens:8d} ({tokens * per_token / GIB:.2f} GiB; "
            f"{tokens / context:.1f} full {context}-token contexts)"
        )
        if ratio > 0:
            slots = max(2 * rows, int(ratio * tokens * per_token / per_snapshot))
            lines.append(
                f"state snapshots         {slots:8d} x {per_snapshot / 2**20:.1f} MiB "
                f"({slots * per_snapshot / GIB:.2f} GiB; --mamba-full-memory-ratio {ratio:g})"
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
    ap.add_argument("--page-size", type=int, default=64)
    ap.add_argument(
        "--mamba-full-memory-ratio",
        type=float,
        default=0.0,
        help="a worker with the prefix cache (the server's default is 0.1; 0: none, as PD decode)",
    )
    args = ap.parse_args(argv)
    try:
        print("\n".join(plan(args)))
    except ValueError as exc:
        raise SystemExit(f"error: {exc}") from None


if __name__ == "__main__":
    main()
