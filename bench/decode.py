"""Time per output token after a long prompt: ours (CUDA graphs on/off) beside transformers.

    python -m bench.decode --model-path DIR [--batch-sizes 1 16] [--prompt-len 512]

Both run the same checkpoint in the same process. transformers is timed with its own
glm5_next (eager attention, its cache) stepping one token at a time; ours with the engine's
pools and runner. Prints a table and, with --json, writes the numbers.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from serving.config import ModelConfig
from serving.executor.model_runner import ModelRunner, StepInput
from serving.memory.pool import MemoryPool, PoolPlan
from serving.models.loader import load_weights, resolve_dtype


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def prompts(batch: int, length: int, vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(1234)
    return torch.randint(0, min(vocab, 1000), (batch, length), generator=g).tolist()


def ours(model, device: str, batch: list[list[int]], steps: int, graphs: bool):
    """Returns (ms per decode step, generated tokens)."""
    length = len(batch[0])
    ctx = length + steps + 16
    plan = PoolPlan(
        rows=len(batch), pages=len(batch) * -(-ctx // 64), page_size=64, max_context=ctx
    )
    pool = MemoryPool(model.config, plan, model.dtype, device)
    runner = ModelRunner(model, pool)
    if graphs:
        runner.enable_decode_graphs(len(batch))
    rows = [pool.alloc_row() for _ in batch]
    pages: list[list[int]] = [[] for _ in batch]
    for r, p in zip(rows, pages):
        assert pool.grow(r, p, ctx)
    out = runner.forward([StepInput(r, 0, ids) for r, ids in zip(rows, batch)])
    tokens = [out.logits.argmax(-1).tolist()]
    _sync()
    times = []
    for step in range(steps):
        t0 = time.perf_counter()
        out = runner.forward(
            [StepInput(r, length + step, [tok]) for r, tok in zip(rows, tokens[-1])]
        )
        nxt = out.logits.argmax(-1).tolist()  # host sync, as the scheduler does
        times.append(time.perf_counter() - t0)
        tokens.append(nxt)
    warm = times[2:] if len(times) > 4 else times
    return 1000 * sorted(warm)[len(warm) // 2], [list(t) for t in zip(*tokens)]


def transformers_baseline(model_path: str, dtype, device: str, batch, steps: int):
    from transformers import Glm5NextForConditionalGeneration

    hf = Glm5NextForConditionalGeneration.from_pretrained(model_path, dtype=dtype).to(device)
    hf.eval()
    ids = torch.tensor(batch, device=device)
    times, tokens = [], []
    with torch.no_grad():
        out = hf(input_ids=ids, use_cache=True)
        past, nxt = out.past_key_values, out.logits[:, -1].argmax(-1)
        tokens.append(nxt.tolist())
        for _ in range(steps):
            _sync()
            t0 = time.perf_counter()
            out = hf(input_ids=nxt[:, None], past_key_values=past, use_cache=True)
            past, nxt = out.past_key_values, out.logits[:, -1].argmax(-1)
            tokens.append(nxt.tolist())
            times.append(time.perf_counter() - t0)
    del hf
    torch.cuda.empty_cache() if torch.cuda.is_available() else None
    warm = times[1:] if len(times) > 2 else times
    return 1000 * sorted(warm)[len(warm) // 2], [list(t) for t in zip(*tokens)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model-path", required=True)
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--hf-steps", type=int, default=8)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--no-baseline", action="store_true")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    config = ModelConfig.from_pretrained(args.model_path)
    dtype = resolve_dtype(args.dtype, args.model_path)
    rows = []
    for bs in args.batch_sizes:
        batch = prompts(bs, args.prompt_len, config.vocab_size)
        row = {"batch": bs, "prompt_len": args.prompt_len, "device": device, "dtype": str(dtype)}
        if not args.no_baseline:
            row["transformers_ms"], hf_tokens = transformers_baseline(
                args.model_path, dtype, device, batch, args.hf_steps
            )
        model, _ = load_weights(args.model_path, config, dtype, device)
        row["eager_ms"], eager_tokens = ours(model, device, batch, args.steps, graphs=False)
        if device == "cuda":
            row["graph_ms"], graph_tokens = ours(model, device, batch, args.steps, graphs=True)
            row["graph_tokens_equal_eager"] = graph_tokens == eager_tokens
        if not args.no_baseline:
            n = min(len(hf_tokens[0]), len(eager_tokens[0]))
            row["tokens_equal_transformers"] = [t[:n] for t in hf_tokens] == [
                t[:n] for t in eager_tokens
            ]
            best = row.get("graph_ms", row["eager_ms"])
            row["speedup_vs_transformers"] = row["transformers_ms"] / best
        del model
        rows.append(row)
        print(json.dumps(row), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
