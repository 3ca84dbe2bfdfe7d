"""EAGLE speculative decoding with the NextN draft: chain drafts (top-k 1), one verify forward.

Per request, between steps: y, the last committed token (position n, not yet in the target's
cache); and, on the device in request-row buffers that also travel in a PD handoff, d1, the
draft's proposal for position n+1 (pool.aux.draft_token[row]), and the draft's hidden
state at position n-1 (pool.aux.draft_hidden[row]). Keeping d1 on the device means a step never
waits for the draft: the host only reads the verify logits.

One decode step over a batch:
  1. draft steps k = 2..N at positions n+k-2: (embed(d_{k-1}), draft hidden) -> d_k
  2. verify: the target runs [y, d1..dN] at positions n..n+N in one forward
  3. accept: each position is sampled exactly as plain decoding would sample it (same penalties,
     a seeded row's draw keyed by its output position); drafts are accepted while they equal
     the sampled token; the first mismatch (or the token after dN) is the bonus. With
     deterministic drafts this is rejection sampling with a one-hot proposal, so the output
     distribution is the target's.
  4. roll back: KDA recurrent and conv states are restored to "after the last accepted token"
     from the per-position history the verify forward recorded (kda_history.py). Nothing else
     needs undoing: latents, pooled keys and tail-ring slots of rejected positions are rewritten
     before anything reads them (the ring holds kpool-1 + N+1 slots, so no live pool member is
     overwritten).
  5. the draft catches up over the accepted tokens with the target's verify hiddens -> next d1.

Steps 1-2 and 4-5 are tensor programs over uniform batches (every request N+1 tokens;
ForwardBatch.uniform) with no host sync inside, so on CUDA each is captured once per batch size
(serving/speculative/graphs.py). Step 3 (serving/speculative/accept.py, which says why there are
two) runs on the host between the two replays (step()), or, for an overlapped step (launch():
the overlap scheduler, rows whose sampling is overlap_safe, one rank), on the device: the
committed tokens are copied to the host behind the step and the next step's y and n stay on the
device (ModelRunner.next_tokens, next_positions: its inputs are FUTURE). The catch-up runs the
draft over all N+1 verify positions and keeps the output at the last accepted one: draft
latents, pooled keys and ring slots past it are rewritten before anything reads them, for the
same reason as the target's. The draft has no KDA layer, so it has nothing to roll back.

Under TP/EP every rank runs the device programs; rank 0 alone samples, and its fanout
(serving/executor/fanout.py) sends each program's host inputs first. Followers have no sampler.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from serving.executor.fanout import ONE_RANK, Fanout
from serving.executor.model_runner import ImageRows
from serving.executor.sampler import SampledTokens, Sampler, SamplingState
from serving.forward_batch import ForwardBatch, resolve_future, to_device, upload
from serving.memory.cache import request_rows
from serving.memory.pool import MemoryPool
from serving.models.glm5_next import Glm5NextForCausalLM
from serving.models.nextn import NextNDraft
from serving.protocol import TokenLogprob
from serving.speculative.accept import accept_on_device, accept_on_host
from serving.speculative.graphs import SpecGraphs, Verified
from serving.speculative.kda_history import restore_kda_states, save_kda_states_from_history


@dataclass(frozen=True)
class SpecConfig:
    num_steps: int

    @property
    def num_draft_tokens(self) -> int:
        return self.num_steps + 1


@dataclass
class PendingStep:
    """A step between verify and roll-back: the verify outputs and what the roll-back needs
    (positions and rows [B] on the device, resolved)."""

    verified: Verified
    graphs: SpecGraphs | None
    positions: torch.Tensor
    rows: torch.Tensor


@dataclass
class Proposal:
    """A request's share of a speculative step (host side)."""

    row: int
    position: int  # n: position of the last committed token y
    token: int  # y


class Eagle:
    def __init__(
        self,
        target: Glm5NextForCausalLM,
        draft: NextNDraft,
        pool: MemoryPool,
        sampler: Sampler | None,
        config: SpecConfig,
        fanout: Fanout = ONE_RANK,
    ) -> None:
        """sampler: None on a follower rank; fanout: rank 0's under TP/EP."""
        assert pool.draft is not None, "the pool needs draft caches"
        self.target, self.draft, self.pool, self.sampler = target, draft, pool, sampler
        self.steps, self.fanout = config.num_steps, fanout
        self.graphs = None  # SpecGraphs, set by enable_graphs
        # n of each row's next step, written by an overlapped step (its FUTURE positions)
        self.next_positions = torch.zeros(
            request_rows(pool.req_to_token), dtype=torch.int64, device=pool.device
        )

    @property
    def accepts_on_device(self) -> bool:
        """Whether a step may accept on the device (launch()): only with no follower ranks,
        which would have to sample alike or get rank 0's accepted runs before the roll-back."""
        return self.fanout.followers == 0

    def enable_graphs(self, max_bs: int) -> None:
        self.graphs = SpecGraphs(
            self.draft_and_verify, self.roll_back_and_catch_up, self.pool, self.steps, max_bs
        )

    # ---- the draft over known tokens (after a prefill chunk) ----
    def extend_draft(
        self,
        rows: list[int],
        starts: list[int],
        next_tokens: list[list[int]],
        target_hidden: torch.Tensor,
        images: ImageRows | None = None,
    ) -> None:
        """Draft positions starts[b].. with inputs (next token, target hidden at the position).

        target_hidden: [sum(len), H], requests back to back. images: the rows of the next
        tokens that are a prompt's image tokens (the image embeddings the target took there;
        nextn.py says why). Stores each request's proposal for the position after its last
        one, and the draft's hidden there, in its aux row."""
        self.fanout.extend_draft(rows, starts, next_tokens, target_hidden, images)
        ids = [t for toks in next_tokens for t in toks]
        batch = ForwardBatch.build(
            ids, rows, starts, [len(t) for t in next_tokens], self.pool.req_to_token
        )
        at = None if images is None else images.on(self.pool.device)
        out = self.draft(self.target, batch, target_hidden, self.pool.draft, at)
        self._stash(batch.req_rows, out.hidden[batch.logit_index], out.logits)

    def _stash(self, rows: torch.Tensor, hidden: torch.Tensor, logits: torch.Tensor) -> None:
        aux = self.pool.aux
        aux.draft_hidden[rows] = hidden.to(aux.draft_hidden.dtype)
        aux.draft_token[rows] = logits.argmax(-1)

    # ---- the two device programs of a step (graph-captured on CUDA) ----
    def draft_and_verify(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        rows: torch.Tensor,
        max_seq_len: int,
    ) -> Verified:
        """tokens (y), positions (n), rows: [B]. Steps 1 and 2 of the module doc."""
        r2t = self.pool.req_to_token
        chain = [self.pool.aux.draft_token[rows]]
        if self.steps > 1:
            hidden = self.pool.aux.draft_hidden[rows]
        for k in range(2, self.steps + 1):
            batch = ForwardBatch.uniform(chain[-1], rows, positions + k - 2, 1, r2t, max_seq_len)
            out = self.draft(self.target, batch, hidden, self.pool.draft)
            hidden = out.hidden
            chain.append(out.logits.argmax(-1))
        chains = torch.stack(chain, dim=1) if len(chain) > 1 else chain[0][:, None]
        ids = torch.cat([tokens[:, None], chains], dim=1).flatten()
        batch = ForwardBatch.uniform(ids, rows, positions, self.steps + 1, r2t, max_seq_len)
        batch.kda_history = {}
        out = self.target(batch, self.pool.target)
        return Verified(chains, out.logits, out.hidden, batch.kda_history, batch)

    def roll_back_and_catch_up(
        self,
        verified: Verified,
        rows: torch.Tensor,
        committed: torch.Tensor,
        last: torch.Tensor,
    ) -> None:
        """Steps 4 and 5. committed: [B, N+1] committed tokens, padded after last[b] (the index
        of the bonus token) with any token id. Leaves the next d1 in the aux rows."""
        n = self.steps + 1
        restore_kda_states(self.pool.target, verified, rows, last)
        batch = replace(
            verified.batch,  # rows and positions as the verify's: its token slots hold
            input_ids=committed.flatten(),
            logit_index=torch.arange(rows.shape[0], device=rows.device) * n + last,
            kda_history=None,
            derived={},
        )
        out = self.draft(self.target, batch, verified.hidden, self.pool.draft)
        self._stash(rows, out.hidden[batch.logit_index], out.logits)

    # ---- one decode step, accepted on the host ----
    def step(
        self,
        proposals: list[Proposal],
        states: list[SamplingState],
        want: list[int],
        offers: list[tuple[int, int, int]] | None = None,
    ) -> tuple[list[list[int]], list[list[TokenLogprob] | None]]:
        """Returns per request the committed tokens (1..N+1) and their logprob entries. One of
        the two step paths, with launch(): this one accepts on the host, so it serves any
        sampling, logprobs, snapshot offers and TP (accept.py says why both are needed).

        want: per request, the number of top logprobs to return (-1: no logprobs).
        offers: (batch entry b, verify position j, state slot): snapshot b's KDA states after
        position j into the slot if j was accepted (j <= the index of b's bonus token)."""
        n_steps, num = self.steps, len(proposals)
        host = torch.tensor(
            [[p.token for p in proposals], [p.position for p in proposals]]
            + [[p.row for p in proposals]],
            dtype=torch.int64,
        )
        self.fanout.verify(host)
        pending = self.verify(host)
        verified = pending.verified
        chains = verified.chains[:num].tolist()
        logits = verified.logits[: num * (n_steps + 1)]
        committed, last, logprobs = accept_on_host(self.sampler, logits, chains, states, want)
        padded = [c + [0] * (n_steps + 1 - len(c)) for c in committed]
        captures = [(b, j, slot) for b, j, slot in offers or [] if j <= last[b]]
        self.fanout.roll_back(padded, last, captures)
        self.roll_back(pending, padded, last, captures)
        return committed, logprobs

    def verify(
        self, host: torch.Tensor, max_seq_len: int | None = None, future: torch.Tensor | None = None
    ) -> PendingStep:
        """Steps 1-2 for host = [tokens y; positions n; rows] ([3, B] int64 on the host). With
        `future` (ModelRunner.next_tokens), FUTURE entries of y and n are read on the device
        from it and next_positions; max_seq_len then bounds the unknown positions."""
        num = host.shape[1]
        graphs = self.graphs if self.graphs is not None and self.graphs.fits(num) else None
        known = None if future is None else (future, self.next_positions)
        if graphs is not None:
            verified, positions, rows = graphs.draft_and_verify(host, known)
            return PendingStep(verified, graphs, positions, rows)
        inputs = upload(host, self.pool.device)
        if known is not None:
            for i, values in enumerate(known):
                resolve_future(inputs[i], inputs[2], values)
        tokens, positions, rows = inputs.unbind(0)
        seq_len = max_seq_len or int(host[1].max()) + self.steps + 1
        verified = self.draft_and_verify(tokens, positions, rows, seq_len)
        return PendingStep(verified, None, positions, rows)

    def roll_back(
        self,
        pending: PendingStep,
        padded: list[list[int]],
        last: list[int],
        captures: list[tuple[int, int, int]],
    ) -> None:
        """Steps 4-5 (the KDA roll-back, the draft's catch-up) once the committed tokens are
        known on the host, and the state snapshots the step's accepted runs crossed (from the
        verify history, which both programs leave intact)."""
        device = self.pool.device
        self._catch_up(
            pending, to_device(padded, torch.int64, device), to_device(last, torch.int64, device)
        )
        save_kda_states_from_history(self.pool.target, pending.verified.kda_history, captures)

    def _catch_up(self, pending: PendingStep, committed: torch.Tensor, last: torch.Tensor) -> None:
        if pending.graphs is not None:
            pending.graphs.roll_back_and_catch_up(committed, last)
        else:
            self.roll_back_and_catch_up(pending.verified, pending.rows, committed, last)

    # ---- one overlapped decode step, accepted on the device (nothing waits for it) ----
    def launch(
        self,
        host: torch.Tensor,
        states: list[SamplingState],
        max_seq_len: int,
        next_tokens: torch.Tensor,
    ) -> SampledTokens:
        """Steps 1-5 with step 3 on the device, for overlap_safe rows on one rank: the other of
        the two step paths, with step(); it keeps the overlap scheduler's step in flight, which
        a host acceptance would end (accept.py says why both are needed). host: as verify's,
        FUTURE where the previous step's y or n is still on the device; max_seq_len: above
        every position the step writes. Leaves each row's next y in next_tokens and its next n
        in next_positions. Returns, per request, [committed tokens padded to N+1, index of the
        bonus token], its copy to the host under way (accept.accepted_tokens reads it)."""
        assert self.accepts_on_device, "an overlapped step runs on one rank (its acceptance too)"
        n, num = self.steps + 1, host.shape[1]
        pending = self.verify(host, max_seq_len, next_tokens)
        verified = pending.verified
        logits, chains = verified.logits[: num * n], verified.chains[:num]
        sampled, last = accept_on_device(self.sampler, logits, chains, states)
        self._catch_up(pending, sampled, last)
        next_tokens[pending.rows] = sampled.gather(1, last[:, None]).squeeze(1)
        self.next_positions[pending.rows] = pending.positions + last + 1
        return SampledTokens(torch.cat([sampled, last[:, None]], dim=1))
