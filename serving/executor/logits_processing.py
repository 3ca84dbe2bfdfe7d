"""From a batch's raw logits to each row's sampling distribution, the sampler's arithmetic:
penalties, logit_bias and min_new_tokens bans (adjusted_logits), then temperature, top-k,
top-p and min-p (filtered_probs). Row-wise tensor ops in vocabulary order, parameters per row;
row indices and per-row values go to the device without a host sync."""

from __future__ import annotations

from collections.abc import Sequence
from itertools import chain

import torch

from serving.executor.sampling_state import SamplingState
from serving.forward_batch import to_device, upload
from serving.sampling_params import SamplingParams


def apply_penalties(
    logits: torch.Tensor,
    prompt_ids: Sequence[Sequence[int]],
    output_ids: Sequence[Sequence[int]],
    repetition: Sequence[float],
    frequency: Sequence[float],
    presence: Sequence[float],
) -> torch.Tensor:
    """`logits` [B, V] penalised (out of place); every other argument has one entry per row.

    repetition (HF/vLLM): a token seen in the prompt or the output has its logit divided by the
    penalty when positive, multiplied when not. frequency / presence subtract f * count and
    p * (count > 0), counting output tokens only.
    """
    vocab = logits.shape[1]
    device = logits.device
    repeats = any(r != 1.0 for r in repetition)
    additive = any(f != 0.0 for f in frequency) or any(p != 0.0 for p in presence)
    if not (repeats or additive):
        return logits
    counts = _token_counts(output_ids, vocab, device)
    if repeats:
        seen = counts + _token_counts(prompt_ids, vocab, device)
        rep = column(repetition, logits.dtype, device)
        penalised = torch.where(logits > 0, logits / rep, logits * rep)
        logits = torch.where(seen > 0, penalised, logits)
    if additive:
        logits = (
            logits
            - column(frequency, logits.dtype, device) * counts
            - column(presence, logits.dtype, device) * (counts > 0)
        )
    return logits


def adjusted_logits(raw: torch.Tensor, states: Sequence[SamplingState]) -> torch.Tensor:
    """Penalties, then logit_bias, then min_new_tokens bans; returns `raw` itself (never
    modified) if none apply. EAGLE's verify samples through here too, so a draft is accepted
    only where the biased distribution picks it."""
    penalised = [i for i, s in enumerate(states) if has_penalties(s.params)]
    ban_rows, ban_cols = _min_tokens_bans(states, raw.shape[1])
    bias_rows, bias_cols, bias_values = [], [], []
    for i, s in enumerate(states):
        for token_id, bias in s.params.logit_bias.items():
            bias_rows.append(i)
            bias_cols.append(token_id)
            bias_values.append(bias)
    if not penalised and not ban_rows and not bias_rows:
        return raw
    out = raw.clone()
    if penalised:
        params = [states[i].params for i in penalised]
        index = row_index(penalised, raw.device)
        out[index] = apply_penalties(
            out[index],
            [states[i].prompt_ids for i in penalised],
            [states[i].output_ids for i in penalised],
            [p.repetition_penalty for p in params],
            [p.frequency_penalty for p in params],
            [p.presence_penalty for p in params],
        )
    if bias_rows:
        index = to_device([bias_rows, bias_cols], torch.long, raw.device)
        out.index_put_(
            (index[0], index[1]),
            to_device(bias_values, out.dtype, raw.device),
            accumulate=True,
        )
    if ban_rows:
        index = to_device([ban_rows, ban_cols], torch.long, raw.device)
        # a device value: `out[i, j] = float("-inf")` would copy it from the host, blocking
        out.index_put_((index[0], index[1]), out.new_full((), float("-inf")))
    return out


def has_penalties(p: SamplingParams) -> bool:
    return p.repetition_penalty != 1.0 or p.frequency_penalty != 0.0 or p.presence_penalty != 0.0


def _min_tokens_bans(states: Sequence[SamplingState], vocab: int) -> tuple[list[int], list[int]]:
    """(rows, ids) to forbid before min_new_tokens: stop tokens, and eos unless ignore_eos."""
    rows: list[int] = []
    cols: list[int] = []
    for i, s in enumerate(states):
        if len(s.output_ids) >= s.params.min_new_tokens:
            continue
        # stop_token_ids may lie outside the vocabulary (accepted, as SGLang): never indexed.
        banned = {t for t in s.params.stop_token_ids if 0 <= t < vocab}
        if not s.params.ignore_eos:
            banned |= s.eos_token_ids
        rows += [i] * len(banned)
        cols += banned
    return rows, cols


def _token_counts(ids: Sequence[Sequence[int]], vocab: int, device: torch.device) -> torch.Tensor:
    """[len(ids), vocab] float32 occurrence counts, built with one scatter on the device."""
    lengths = torch.tensor([len(row) for row in ids], dtype=torch.long)
    flat = torch.tensor(list(chain.from_iterable(ids)), dtype=torch.long)
    row_of = torch.repeat_interleave(torch.arange(len(ids)), lengths)  # on the host: no sync
    counts = torch.zeros(len(ids), vocab, dtype=torch.float32, device=device)
    counts.index_put_(
        (upload(row_of, device), upload(flat, device)),
        torch.ones(flat.numel(), dtype=torch.float32, device=device),
        accumulate=True,
    )
    return counts


def filtered_probs(
    logits: torch.Tensor,
    temperature: Sequence[float],
    top_k: Sequence[int],
    top_p: Sequence[float],
    min_p: Sequence[float],
) -> torch.Tensor:
    """Renormalised sampling distribution in vocabulary order: temperature, top_k, top_p, min_p."""
    logits = logits / column(temperature, logits.dtype, logits.device)
    if any(k != -1 for k in top_k) or any(p < 1.0 for p in top_p):
        logits = _mask_top_k_top_p(logits, top_k, top_p)
    if any(m > 0.0 for m in min_p):
        logits = _mask_min_p(logits, min_p)
    return torch.softmax(logits, dim=-1)


def _mask_top_k_top_p(
    logits: torch.Tensor, top_k: Sequence[int], top_p: Sequence[float]
) -> torch.Tensor:
    """Keep the k largest, then the smallest prefix of those (renormalised) reaching top_p."""
    vocab = logits.shape[1]
    device = logits.device
    # Stable sort: equal logits keep id order, so truncation at a tie is deterministic.
    ordered, order = logits.sort(dim=-1, descending=True, stable=True)
    k = to_device([vocab if k == -1 else min(k, vocab) for k in top_k], torch.int64, device)
    p = column(top_p, logits.dtype, device)
    position = torch.arange(vocab, device=device).unsqueeze(0)
    beyond_k = position >= k.unsqueeze(1)
    probs = torch.softmax(ordered.masked_fill(beyond_k, float("-inf")), dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs
    # p < 1 guard: a cumulative sum rounding past 1.0 must not cut an untruncated row.
    drop = beyond_k | ((mass_before >= p) & (p < 1.0))
    drop[:, 0] = False
    return logits.masked_fill(torch.empty_like(drop).scatter_(1, order, drop), float("-inf"))


def _mask_min_p(logits: torch.Tensor, min_p: Sequence[float]) -> torch.Tensor:
    """Drop tokens with prob < min_p * max_prob, i.e. logit < max_logit + log(min_p)."""
    floor = logits.max(dim=-1, keepdim=True).values + torch.log(
        column(min_p, logits.dtype, logits.device)
    )
    return logits.masked_fill(logits < floor, float("-inf"))


def row_index(rows: list[int], device: torch.device) -> torch.Tensor:
    """Row indices as a device tensor: indexing a CUDA tensor with a Python list copies the
    list with a blocking copy (a sync)."""
    return to_device(rows, torch.int64, device)


def column(values: Sequence[float], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return to_device(values, dtype, device).unsqueeze(1)
