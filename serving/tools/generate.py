"""Offline greedy generation on one process: the smallest end-to-end use of the model.

    python -m serving.tools.generate --model-path DIR --prompt "Hello" --max-new-tokens 16

This drives the same model, pools and runner the server uses, without the scheduler.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field

import torch

from serving.config import ModelConfig
from serving.executor.model_runner import ModelRunner, StepInput
from serving.memory.pool import MemoryPool, PoolPlan
from serving.models.glm5_next import ForwardOutput, Glm5NextForCausalLM


@dataclass
class Sequence:
    row: int
    tokens: list[int]
    cached: int = 0  # tokens whose KV and state are in the cache
    pages: list[int] = field(default_factory=list)


class StepRunner:
    """Runs extend / decode steps for a set of sequences over a private MemoryPool."""

    def __init__(
        self,
        model: Glm5NextForCausalLM,
        max_requests: int = 8,
        max_context: int = 4096,
        page_size: int = 16,
        device: str = "cpu",
    ) -> None:
        pages = max_requests * -(-max_context // page_size)
        plan = PoolPlan(
            rows=max_requests, pages=pages, page_size=page_size, max_context=max_context
        )
        self.pool = MemoryPool(model.config, plan, model.dtype, device)
        self.runner = ModelRunner(model, self.pool)

    def add(self, prompt: list[int]) -> Sequence:
        row = self.pool.alloc_row()
        if row is None:
            raise RuntimeError("no free request row")
        return Sequence(row=row, tokens=list(prompt))

    def release(self, seq: Sequence) -> None:
        self.pool.free_pages(seq.pages)
        self.pool.free_row(seq.row)

    def step(self, seqs: list[Sequence], lens: list[int], logits: str = "last") -> ForwardOutput:
        """Feed the next `lens[i]` uncached tokens of each sequence."""
        items = []
        for seq, n in zip(seqs, lens):
            if not self.pool.grow(seq.row, seq.pages, seq.cached + n):
                raise RuntimeError("out of KV pages")
            items.append(StepInput(seq.row, seq.cached, seq.tokens[seq.cached : seq.cached + n]))
        out = self.runner.forward(items, logits)
        for seq, n in zip(seqs, lens):
            seq.cached += n
        return out

    def greedy(self, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
        """Greedy continuation of every prompt (prefill together, then decode together)."""
        seqs = [self.add(p) for p in prompts]
        try:
            lens = [len(s.tokens) for s in seqs]
            for _ in range(max_new_tokens):
                out = self.step(seqs, lens)
                for seq, tok in zip(seqs, out.logits.argmax(-1).tolist()):
                    seq.tokens.append(tok)
                lens = [1] * len(seqs)
            return [s.tokens[len(p) :] for s, p in zip(seqs, prompts)]
        finally:
            for s in seqs:
                self.release(s)


def main() -> None:
    from tokenizers import Tokenizer

    from serving.models.loader import load_weights, resolve_dtype

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model-path", required=True)
    ap.add_argument(
        "--prompt", default="List three things to check when an HTTP service returns 503."
    )
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args()
    config = ModelConfig.from_pretrained(args.model_path)
    dtype = resolve_dtype(args.dtype, args.model_path, args.device)
    model, _ = load_weights(args.model_path, config, dtype, args.device)
    tok = Tokenizer.from_file(f"{args.model_path}/tokenizer.json")
    ids = tok.encode(args.prompt).ids
    out = StepRunner(model, max_requests=1, device=args.device).greedy([ids], args.max_new_tokens)[
        0
    ]
    print(tok.decode(out, skip_special_tokens=False))


if __name__ == "__main__":
    main()
