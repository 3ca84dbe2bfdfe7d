"""Offline greedy generation on one process: the smallest end-to-end use of the model.

    python -m serving.generate --model-path DIR --prompt "Hello" --max-new-tokens 16

This drives the same model and caches the server uses, without the scheduler.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field

import torch

from serving.config import ModelConfig
from serving.forward_batch import ForwardBatch
from serving.memory.allocator import FreeList, PageAllocator
from serving.memory.cache import ModelCache, allocate_model_cache, reset_request_state
from serving.models.glm5_next import ForwardOutput, Glm5NextForCausalLM


@dataclass
class Sequence:
    row: int
    tokens: list[int]
    cached: int = 0  # tokens whose KV and state are in the cache
    pages: list[int] = field(default_factory=list)


class StepRunner:
    """Owns the caches of one model; runs extend / decode steps for a set of sequences."""

    def __init__(
        self,
        model: Glm5NextForCausalLM,
        max_requests: int = 8,
        max_context: int = 4096,
        page_size: int = 16,
        device: str = "cpu",
    ) -> None:
        config = model.config
        self.model, self.config, self.device = model, config, device
        self.page_size = page_size
        self.rows = FreeList(max_requests, "row")
        self.pages = PageAllocator(max_requests * -(-max_context // page_size), page_size)
        req_to_token = torch.zeros(max_requests + 1, max_context, dtype=torch.int64, device=device)
        self.cache: ModelCache = allocate_model_cache(
            config, req_to_token, self.pages.num_slots, model.dtype, device
        )

    def add(self, prompt: list[int]) -> Sequence:
        rows = self.rows.alloc(1)
        if rows is None:
            raise RuntimeError("no free request row")
        reset_request_state(self.cache, torch.tensor(rows, device=self.device))
        return Sequence(row=rows[0], tokens=list(prompt))

    def release(self, seq: Sequence) -> None:
        self.pages.free(seq.pages)
        self.rows.free([seq.row])
        seq.pages.clear()

    def _reserve(self, seq: Sequence, upto: int) -> None:
        need = self.pages.pages_for(upto) - len(seq.pages)
        if need > 0:
            new = self.pages.alloc(need)
            if new is None:
                raise RuntimeError("out of KV pages")
            for p in new:
                first = len(seq.pages) * self.page_size
                slots = torch.arange(self.page_size, device=self.device) + p * self.page_size
                self.cache.req_to_token[seq.row, first : first + self.page_size] = slots
                seq.pages.append(p)

    def step(self, seqs: list[Sequence], lens: list[int], logits: str = "last") -> ForwardOutput:
        """Feed the next `lens[i]` uncached tokens of each sequence."""
        ids: list[int] = []
        for seq, n in zip(seqs, lens):
            self._reserve(seq, seq.cached + n)
            ids += seq.tokens[seq.cached : seq.cached + n]
        batch = ForwardBatch.build(
            ids,
            [s.row for s in seqs],
            [s.cached for s in seqs],
            lens,
            self.cache.req_to_token,
            logits=logits,
        )
        out = self.model(batch, self.cache)
        for seq, n in zip(seqs, lens):
            seq.cached += n
        return out

    def greedy(self, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
        """Greedy continuation of every prompt (prefill together, then decode together)."""
        seqs = [self.add(p) for p in prompts]
        try:
            out = self.step(seqs, [len(s.tokens) for s in seqs])
            for _ in range(max_new_tokens):
                for seq, tok in zip(seqs, out.logits.argmax(-1).tolist()):
                    seq.tokens.append(tok)
                if _ == max_new_tokens - 1:
                    break
                out = self.step(seqs, [1] * len(seqs))
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
    dtype = resolve_dtype(args.dtype, args.model_path)
    model, _ = load_weights(args.model_path, config, dtype, args.device)
    tok = Tokenizer.from_file(f"{args.model_path}/tokenizer.json")
    ids = tok.encode(args.prompt).ids
    out = StepRunner(model, max_requests=1, device=args.device).greedy([ids], args.max_new_tokens)[
        0
    ]
    print(tok.decode(out, skip_special_tokens=False))


if __name__ == "__main__":
    main()
