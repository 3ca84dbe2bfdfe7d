"""EAGLE's acceptance (step 3 of serving/speculative/eagle.py): every verify position sampled as
plain decoding would sample it, drafts accepted while they equal the token sampled at their
position; the first mismatch, or the token after the last draft, is the bonus.

It runs in one of two places, and both are needed:
- on the host (Eagle.step): anything plain sampling does works here, since each position is
  sampled with the drafts before it as its output so far (penalties, grammars, seeded draws,
  logprobs), and the host learns the accepted run before the roll-back, which under TP it sends
  to the followers (only rank 0 samples);
- on the device (Eagle.launch): for overlap_safe rows on one rank, so the step needs no host
  sync and the overlap scheduler can launch the next one behind it; the run is the length of
  the drafts' matching prefix, and the host reads the tokens when the step is processed.
"""

from __future__ import annotations

import torch

from serving.executor.sampler import SampledTokens, Sampler, SamplingState
from serving.protocol import TokenLogprob


def accept_on_host(
    sampler: Sampler,
    logits: torch.Tensor,
    chains: list[list[int]],
    states: list[SamplingState],
    want: list[int],
) -> tuple[list[list[int]], list[int], list[list[TokenLogprob] | None]]:
    """Per request: the committed tokens (accepted drafts + the bonus), the index of the bonus
    and, when wanted (want[b] >= 0: that many top logprobs), the logprob entries of the
    committed tokens. logits: [B * (N+1), V] (the verify's, request by request)."""
    n = len(chains[0]) + 1 if chains else 1
    virtual = [
        SamplingState(s.params, s.prompt_ids, s.output_ids + chain[:j], s.eos_token_ids)
        for s, chain in zip(states, chains)
        for j in range(n)
    ]
    top = [max(w, 0) for w in want for _ in range(n)] if any(w >= 0 for w in want) else None
    tokens, logprobs = sampler.sample(logits, virtual, top)
    committed, last, entries = [], [], []
    for b, chain in enumerate(chains):
        sampled = tokens[b * n : (b + 1) * n]
        a = 0
        while a < n - 1 and sampled[a] == chain[a]:
            a += 1
        committed.append(chain[:a] + [sampled[a]])
        last.append(a)
        wanted = logprobs is not None and want[b] >= 0
        entries.append(logprobs[b * n : b * n + a + 1] if wanted else None)
    return committed, last, entries


def accept_on_device(
    sampler: Sampler, logits: torch.Tensor, chains: torch.Tensor, states: list[SamplingState]
) -> tuple[torch.Tensor, torch.Tensor]:
    """(every position's sampled token [B, N+1], the index of each request's bonus [B]), on the
    device, no host sync. chains: [B, N] on the device; states: overlap_safe (nothing reads
    the outputs, so the drafts before a position do not change its draw)."""
    num, n = chains.shape[0], chains.shape[1] + 1
    every = [s for s in states for _ in range(n)]
    sampled = sampler.sample_on_device(logits, every).view(num, n)
    matches = (sampled[:, : n - 1] == chains).to(torch.int64)
    return sampled, matches.cumprod(dim=1).sum(dim=1)


def accepted_tokens(out: SampledTokens) -> list[list[int]]:
    """An overlapped step's committed tokens per request (waits for its copy to the host)."""
    return [row[: row[-1] + 1] for row in out.tolist()]
