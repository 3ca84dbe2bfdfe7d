"""Print one rank's memory plan from config.json alone: no GPU, no weights.

    python -m serving.tools.plan --model-path DIR --tp-size 8 --ep-size 8 \\
        --mem-fraction-static 0.70 --context-length 69632 --max-running-requests 32 \\
        --disaggregation-decode-extra-slots 64 --gpu-memory-gib 141 [--speculative-num-steps 1]

The plan itself is serving/models/rank_plan.py (a worker logs the same plan at start-up beside
what it built). A checkpoint with a vision tower: its weights and its activations are counted:
with the tower's CUDA graphs (the server's default on CUDA) what they hold for the largest
image (--max-image-tokens) and a capture's warm-up, else one step's eager peak
(--chunked-prefill-size + --max-image-tokens image tokens). Block-FP8 checkpoints are read from
their headers, as a CUDA rank holds them (--fp8-keep-bf16 as the server's flag).
"""

from __future__ import annotations

import argparse

from serving.config import ModelConfig, parse_fp8_kinds
from serving.models.loader import resolve_dtype
from serving.models.rank_plan import GIB, fp8_plan, predict_rank
from serving.models.vision import step_image_tokens


def plan(args: argparse.Namespace) -> list[str]:
    config = ModelConfig.from_pretrained(args.model_path)
    rank = predict_rank(
        config,
        tp_size=args.tp_size,
        ep_size=args.ep_size,
        dtype=resolve_dtype(args.dtype, args.model_path),
        context=args.context_length or config.max_position_embeddings,
        running=args.max_running_requests,
        extra=args.disaggregation_decode_extra_slots,
        speculative_steps=args.speculative_num_steps,
        page_size=args.page_size,
        mem_fraction_static=args.mem_fraction_static,
        total_memory=int(args.gpu_memory_gib * GIB),
        fp8=fp8_plan(args.model_path, config, parse_fp8_kinds(args.fp8_keep_bf16)),
        snapshot_ratio=args.mamba_full_memory_ratio,
        vision_tokens=step_image_tokens(args.chunked_prefill_size, args.max_image_tokens),
        vision_graph_tokens=0
        if args.cuda_graph_backend_vision == "disabled"
        else args.max_image_tokens,
    )
    return rank.lines(args.model_path)


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
    ap.add_argument(
        "--mamba-full-memory-ratio",
        type=float,
        default=0.0,
        help="a worker with the prefix cache (the server's default is 0.1; 0: none, as PD decode)",
    )
    ap.add_argument("--chunked-prefill-size", type=int, default=8192, help="as the server's")
    ap.add_argument(
        "--max-image-tokens", type=int, default=8000, help="a vision checkpoint: as the server's"
    )
    ap.add_argument(
        "--cuda-graph-backend-vision",
        choices=["auto", "disabled", "full"],
        default="auto",
        help="as the server's (a GPU plan: auto is full); its graphs' memory is held for good",
    )
    args = ap.parse_args(argv)
    try:
        print("\n".join(plan(args)))
    except ValueError as exc:
        raise SystemExit(f"error: {exc}") from None


if __name__ == "__main__":
    main()
