"""Batched token sampling: penalties, logit_bias, min_new_tokens, then greedy or
temperature-top_k-top_p-min_p (the arithmetic in logits_processing.py), grammar masks, seeded
draws, logprobs.

Per-row parameters may differ inside one batch. Every row's sampling distribution is computed
with row-wise tensor ops in vocabulary order. A seeded row's draw for output position k comes
from a generator seeded with draw_seed(seed, k) and nothing else, so its tokens depend neither
on the other rows of the batch nor on where the earlier draws ran: PD decode continues prefill's
first token, EAGLE's verify samples every draft position (accepted or not), and both give the
tokens a single plain worker gives.
"""

from __future__ import annotations

import torch

from serving.executor.constrained import SequenceGrammar, has_constraint, load_tokenizer
from serving.executor.logits_processing import (
    adjusted_logits,
    filtered_probs,
    has_penalties,
    row_index,
)
from serving.executor.sampling_state import SamplingState
from serving.forward_batch import upload
from serving.protocol import TokenLogprob

_MASK64 = 2**64 - 1


def draw_seed(seed: int, position: int) -> int:
    """The generator seed for a request's draw at output position `position`: output
    position + 1 of splitmix64 started at `seed` (well mixed, so seed + i for the i-th of n
    samples and position k never collide in practice), folded into torch's [0, 2^63)."""
    z = (seed + (position + 1) * 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) >> 1


class Sampler:
    """`tokenizer_file` (the checkpoint's tokenizer.json) enables constrained decoding."""

    def __init__(
        self,
        vocab_size: int,
        device: torch.device | str,
        seed: int = 0,
        tokenizer_file: str | None = None,
    ):
        self.vocab_size = vocab_size
        self.device = torch.device(device)
        self._generator = torch.Generator(device=self.device).manual_seed(seed)
        self._seeded = torch.Generator(device=self.device)  # re-seeded before each seeded draw
        self._tokenizer_file = tokenizer_file

    def sample(
        self,
        logits: torch.Tensor,
        states: list[SamplingState],
        top_logprobs: list[int] | None = None,
    ) -> tuple[list[int], list[TokenLogprob] | None]:
        """logits: [B, V] float32 (B == len(states)), row i belongs to states[i].
        Returns the sampled token ids (host ints) and, when top_logprobs is given (per-row number
        of top alternatives, 0 = only the chosen token's logprob; None = no logprobs at all),
        one TokenLogprob per row."""
        if logits.dim() != 2 or logits.shape[0] != len(states):
            raise ValueError(f"logits {tuple(logits.shape)} do not match {len(states)} states")
        if logits.shape[1] < self.vocab_size:
            raise ValueError(f"logits have {logits.shape[1]} columns < vocab {self.vocab_size}")
        if top_logprobs is not None and len(top_logprobs) != len(states):
            raise ValueError(f"{len(top_logprobs)} top_logprobs entries for {len(states)} rows")
        raw, tokens, grammars = self._tokens(logits, states)
        token_ids = tokens.tolist()
        for i, grammar in grammars.items():
            grammar.advance(token_ids[i])
        if top_logprobs is None:
            return token_ids, None
        return token_ids, _logprobs(raw, tokens, token_ids, top_logprobs)

    def sample_async(self, logits: torch.Tensor, states: list[SamplingState]) -> SampledTokens:
        """sample() without waiting for the device: the tokens stay there (for the next step's
        inputs) and their copy to the host is under way. Only for rows that are overlap_safe:
        nothing here may read a token still on its way."""
        return SampledTokens(self.sample_on_device(logits, states))

    def sample_on_device(self, logits: torch.Tensor, states: list[SamplingState]) -> torch.Tensor:
        """sample_async's tokens, [B] on the device, no copy to the host started."""
        if logits.dim() != 2 or logits.shape[0] != len(states):
            raise ValueError(f"logits {tuple(logits.shape)} do not match {len(states)} states")
        unsafe = [i for i, s in enumerate(states) if not overlap_safe(s)]
        if unsafe:
            raise ValueError(f"rows {unsafe} need their previous tokens on the host to sample")
        return self._tokens(logits, states)[1]

    def _tokens(
        self, logits: torch.Tensor, states: list[SamplingState]
    ) -> tuple[torch.Tensor, torch.Tensor, dict[int, SequenceGrammar]]:
        """(raw logits, sampled token ids on the device, the grammars still to advance)."""
        # Columns past the vocabulary (a padded lm_head) must never be sampled.
        raw = logits[:, : self.vocab_size].float()
        adjusted = adjusted_logits(raw, states)
        grammars = self._grammars(states)
        if grammars:
            adjusted = self._mask_grammars(raw, adjusted, grammars)
        tokens = adjusted.argmax(dim=-1)  # first maximum: ties go to the lowest id
        sampled = [i for i, s in enumerate(states) if not s.params.is_greedy]
        if sampled:
            index = row_index(sampled, logits.device)
            tokens[index] = self._draw(adjusted[index], [states[i] for i in sampled])
        return raw, tokens, grammars

    def _grammars(self, states: list[SamplingState]) -> dict[int, SequenceGrammar]:
        """Row -> grammar of every constrained row, created on first use and caught up."""
        grammars = {}
        for i, s in enumerate(states):
            if not has_constraint(s.params):
                continue
            if s.grammar is None:
                tokenizer = None
                if self._tokenizer_file is not None:
                    eos = tuple(sorted(s.eos_token_ids))
                    tokenizer = load_tokenizer(self._tokenizer_file, eos, self.vocab_size)
                s.grammar = SequenceGrammar.compile(tokenizer, s.params)
            s.grammar.catch_up(s.output_ids)
            grammars[i] = s.grammar
        return grammars

    def _mask_grammars(
        self, raw: torch.Tensor, adjusted: torch.Tensor, grammars: dict[int, SequenceGrammar]
    ) -> torch.Tensor:
        """-inf outside each grammar's allowed tokens (out of place; `raw` is never modified).
        A row left with nothing (min_new_tokens banning the only way out) keeps the grammar's
        tokens at their raw logits: the grammar wins."""
        masks = {i: g.allowed() for i, g in grammars.items()}
        rows = [i for i, mask in masks.items() if mask is not None]
        if not rows:
            return adjusted
        allowed = torch.stack([_unpack_bits(masks[i], self.vocab_size) for i in rows])
        allowed = upload(allowed, raw.device)
        index = row_index(rows, raw.device)
        masked = adjusted[index].masked_fill(~allowed, float("-inf"))
        dead = torch.isneginf(masked).all(dim=-1, keepdim=True)
        masked = torch.where(dead, raw[index].masked_fill(~allowed, float("-inf")), masked)
        out = adjusted.clone() if adjusted is raw else adjusted
        out[index] = masked
        return out

    def _draw(self, logits: torch.Tensor, states: list[SamplingState]) -> torch.Tensor:
        """One token id per row of `logits` (rows of non-greedy states)."""
        params = [s.params for s in states]
        probs = filtered_probs(
            logits,
            [p.temperature for p in params],
            [p.top_k for p in params],
            [p.top_p for p in params],
            [p.min_p for p in params],
        )
        picks = torch.empty(len(states), dtype=torch.long, device=logits.device)
        shared = [j for j, p in enumerate(params) if p.seed is None]
        if shared:
            index = row_index(shared, logits.device)
            picks[index] = _multinomial(probs[index], self._generator)
        for j, s in enumerate(states):
            if s.params.seed is not None:
                self._seeded.manual_seed(draw_seed(s.params.seed, len(s.output_ids)))
                picks[j : j + 1] = _multinomial(probs[j : j + 1], self._seeded)
        return picks


def overlap_safe(state: SamplingState) -> bool:
    """Whether a row can be sampled while its previous token is still on the device (the
    overlap scheduler): nothing of the sampling reads the output so far. Penalties count it,
    min_new_tokens and a seed's draw position count its length, a grammar advances over it."""
    p = state.params
    return (
        not has_penalties(p)
        and p.min_new_tokens == 0
        and not has_constraint(p)
        and (p.seed is None or p.is_greedy)
    )


class SampledTokens:
    """Sampled token ids on the device, their copy to the host started at once: on CUDA into
    pinned memory behind an event, so tolist() waits for this step alone, not for whatever was
    queued after it."""

    def __init__(self, tokens: torch.Tensor) -> None:
        self.device = tokens
        self.event = None
        if tokens.is_cuda:
            self.host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
            self.host.copy_(tokens, non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record()
        else:
            self.host = tokens

    def tolist(self) -> list[int]:
        if self.event is not None:
            self.event.synchronize()
        return self.host.tolist()


def _multinomial(probs: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """One draw per row of probs [N, V]: torch.multinomial(probs, 1)'s own one-sample path
    (argmax of p / q, q ~ Exp(1) from `generator`), so the same tokens from the same generator
    state, without its two checks of the distribution, which read it back to the host (a sync
    per draw). Every row here has a positive entry: temperature, top-k, top-p and min-p each
    keep the row's most likely token."""
    q = torch.empty_like(probs).exponential_(1, generator=generator)
    return probs.div(q).argmax(dim=-1)


def _unpack_bits(bitmask: bytes, size: int) -> torch.Tensor:
    """[size] bool from one bit per entry, little-endian within each byte; missing bits are 0."""
    packed = torch.frombuffer(bytearray(bitmask), dtype=torch.uint8)
    bits = (packed.unsqueeze(-1) >> torch.arange(8, dtype=torch.uint8)) & 1
    out = torch.zeros(size, dtype=torch.bool)
    n = min(size, bits.numel())
    out[:n] = bits.flatten()[:n].bool()
    return out


def score_tokens(logits: torch.Tensor, token_ids: list[int], top_n: int) -> list[TokenLogprob]:
    """Logprobs of given tokens (a prompt's), row i scoring token_ids[i] under logits[i]."""
    tokens = torch.tensor(token_ids, dtype=torch.long, device=logits.device)
    return _logprobs(logits.float(), tokens, token_ids, [top_n] * len(token_ids))


def _logprobs(
    raw: torch.Tensor, tokens: torch.Tensor, token_ids: list[int], top_n: list[int]
) -> list[TokenLogprob]:
    """Logprobs of the raw model distribution (before penalties and temperature)."""
    logprobs = torch.log_softmax(raw, dim=-1)
    chosen = logprobs.gather(1, tokens.unsqueeze(1)).squeeze(1).tolist()
    tops: list[list[tuple[int, float]]] = [[] for _ in token_ids]
    wanted = [i for i, n in enumerate(top_n) if n > 0]
    if wanted:
        values, ids = logprobs[wanted].topk(min(max(top_n), raw.shape[1]), dim=-1)
        for i, row_values, row_ids in zip(wanted, values.tolist(), ids.tolist()):
            tops[i] = list(zip(row_ids[: top_n[i]], row_values[: top_n[i]]))
    return [TokenLogprob(t, lp, top) for t, lp, top in zip(token_ids, chosen, tops)]
