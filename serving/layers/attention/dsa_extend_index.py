"""A ragged extend's index tensors for DSA's indexer (serving/layers/attention/dsa.py's extend
path): built once per forward on the host from the batch's lens, one upload, shared by every DSA
layer of the forward."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from serving.forward_batch import ForwardBatch, to_device


@dataclass
class ExtendIndex:
    """A ragged extend's index tensors for the indexer, derived once per forward from the batch
    (host lists, one upload) and shared by every DSA layer of it.

    Closing pools (pools whose last member is among the batch's new tokens), NP of them:
      pool_rows [NP]            request row
      pool_slots [NP]           pooled-key row each is written to
      members_new [NP, kpool]   whether a member is a new token (else it is in the ring)
      members_token [NP, kpool] the new token's index in the batch (clamped to 0 where not)
      members_ring [NP, kpool]  the member's ring slot
    Ring writes (each request's last `ring` new positions: the open pool among them), NW:
      ring_rows, ring_slots, ring_tokens [NW]
    query_rows [T]: each token's request row; max_pools: pools of the longest request."""

    pool_rows: torch.Tensor
    pool_slots: torch.Tensor
    members_new: torch.Tensor
    members_token: torch.Tensor
    members_ring: torch.Tensor
    ring_rows: torch.Tensor
    ring_slots: torch.Tensor
    ring_tokens: torch.Tensor
    query_rows: torch.Tensor
    num_pools: int
    max_pools: int

    @classmethod
    def of(cls, batch: ForwardBatch, kpool: int, ring: int) -> ExtendIndex:
        key = ("dsa_extend", kpool, ring)
        index = batch.derived.get(key)
        if index is None:
            index = batch.derived[key] = cls.build(batch, kpool, ring)
        return index

    @classmethod
    def build(cls, batch: ForwardBatch, kp: int, ring: int) -> ExtendIndex:
        # per closing pool: its first position, its request's row, first new position and that
        # token's index in the batch; per ring write: row, slot, token index
        pool_starts, pool_rows, pool_first, pool_token0 = [], [], [], []
        ring_rows, ring_slots, ring_tokens = [], [], []
        offset = 0
        for start, n, row in zip(batch.starts_cpu, batch.lens_cpu, batch.rows_cpu):
            end = start + n
            first, last = start // kp, end // kp
            pool_starts += range(first * kp, last * kp, kp)
            pool_rows += [row] * (last - first)
            pool_first += [start] * (last - first)
            pool_token0 += [offset] * (last - first)
            keep = range(max(start, end - ring), end)
            ring_rows += [row] * len(keep)
            ring_slots += [p % ring for p in keep]
            ring_tokens += range(offset + keep.start - start, offset + keep.stop - start)
            offset += n
        parts = [pool_starts, pool_rows, pool_first, pool_token0, ring_rows, ring_slots]
        parts.append(ring_tokens)
        device = batch.positions.device
        ids = to_device([v for part in parts for v in part], torch.int64, device)
        starts, rows, first_pos, token0, w_rows, w_slots, w_tokens = ids.split(
            [len(p) for p in parts]
        )
        members = starts[:, None] + torch.arange(kp, device=device)  # [NP, kp] positions
        return cls(
            pool_rows=rows,
            pool_slots=batch.req_to_token[rows, starts] // kp,
            members_new=members >= first_pos[:, None],
            members_token=(members - first_pos[:, None] + token0[:, None]).clamp_(min=0),
            members_ring=members % ring,
            ring_rows=w_rows,
            ring_slots=w_slots,
            ring_tokens=w_tokens,
            query_rows=batch.req_rows[batch.token_req],
            num_pools=len(pool_starts),
            max_pools=max(1, max(s + n for s, n in zip(batch.starts_cpu, batch.lens_cpu)) // kp),
        )
