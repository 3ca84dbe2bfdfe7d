"""The decode half of the engine: it owns the running requests.

schedule(): grow every running request by the tokens one step writes (evicting cached pages,
then retracting the newest other request when pages run out; the retracted ones go back to the
prefill queue). launch(): one decode forward, or an EAGLE draft + verify step, over all of
them; snapshot the KDA state of each request that crossed a grid position (admission.track, or
from EAGLE's verify history); draw the tokens. process() (under the overlap scheduler after the
next step was launched): commit them; hand the prefix cache a snapshot every
--mamba-track-interval tokens.

An overlapped EAGLE step (Eagle.launch) accepts on the device, so the host learns how many
tokens a request gained only when the step is processed: until then req.cached stays at the
committed tokens and the step in flight may have written up to N+1 positions past it. Hazards:
the next step grows a request for both steps' positions (2(N+1) past req.cached), and a step
that might cross a snapshot grid position runs sync (spec_overlaps), where the offer is exact.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from serving.engine.admission import Admission
from serving.engine.commit import Commit, Launched, Sampled
from serving.engine.request import Req
from serving.executor.model_runner import ModelRunner, StepInput
from serving.forward_batch import FUTURE
from serving.protocol import FinishReason, SchedulerStats
from serving.speculative.accept import accepted_tokens
from serving.speculative.eagle import Eagle, Proposal

log = logging.getLogger(__name__)


@dataclass
class DecodeBatch:
    reqs: list[Req]
    retracted: list[Req] = field(default_factory=list)  # newest first: requeue in this order


class DecodeManager:
    def __init__(
        self,
        runner: ModelRunner,
        admission: Admission,
        commit: Commit,
        stats: SchedulerStats,
        spec: Eagle | None,
    ) -> None:
        self.runner, self.admission, self.commit, self.stats = runner, admission, commit, stats
        self.spec = spec
        # positions a decode step writes: 1, or y + N drafts when speculating
        self.tokens_per_step = 1 if spec is None else spec.steps + 1
        self.running: list[Req] = []

    def schedule(self, retract: bool = True) -> DecodeBatch | None:
        """Grow every request the step decodes; None when one needs a retraction and `retract`
        is False (a step is in flight: retract only after it completed, see scheduler.py)."""
        retracted: list[Req] = []
        with self.admission.batched():  # the step's page maps (requests in step cross together)
            for req in list(self.running):
                if req not in self.running or self._ends_pending(req):
                    continue  # retracted for an earlier request of this loop / done when committed
                while req.finish_reason is None and not self.admission.grow(
                    req, req.cached + self._ahead(req)
                ):
                    if not retract:
                        return None
                    victim = self._retract_one(keep=req)
                    if victim is None:
                        reason = FinishReason.abort("out of KV cache memory while decoding", 503)
                        self.commit.finish(req, reason)
                    else:
                        retracted.append(victim)
        reqs = [r for r in self.running if r.finish_reason is None and not self._ends_pending(r)]
        return DecodeBatch(reqs, retracted)

    def _ahead(self, req: Req) -> int:
        """Positions past req.cached the next step may write: with an overlapped EAGLE step in
        flight (a pending token), its own N+1 as well."""
        return self.tokens_per_step * (2 if self.spec is not None and req.pending else 1)

    def spec_overlaps(self, reqs: list[Req]) -> bool:
        """Whether an EAGLE step over reqs may run overlapped: one rank, every row overlap_safe
        without logprobs (the scheduler checks that for any step), and no request's accepted run
        able to reach a snapshot grid position (the offer needs its exact position)."""
        return (
            self.spec is not None
            and self.spec.accepts_on_device
            and not any(self.admission.may_cross_grid(r, r.cached + self._ahead(r)) for r in reqs)
        )

    def _ends_pending(self, req: Req) -> bool:
        """Its pending tokens will end it by length: decoding past it would be wasted, and on a
        PD prefill worker (max_new_tokens 1) would change the row's state before it is shipped
        (hazard)."""
        return req.pending > 0 and self.commit.stops.ends_by_length(req, req.pending)

    def launch(self, batch: DecodeBatch, sync: bool) -> Launched:
        """One decode forward (a request whose last token is pending reads it on the device:
        FUTURE) and its tokens drawn; or EAGLE's step, overlapped (Eagle.launch) or, when
        `sync`, run whole here (acceptance and commit on the host)."""
        reqs = batch.reqs
        if self.spec is not None and not sync:
            return self._launch_speculative(reqs)
        if self.spec is not None:
            committed = self.stats.generation_tokens_total
            self._run_speculative(reqs)
            self.stats.decode_tokens_total += self.stats.generation_tokens_total - committed
            return Launched("decode", [], Sampled([], host=[]), True)
        out = self.runner.forward(
            [StepInput(r.row, r.cached, [FUTURE if r.pending else r.fill_ids[-1]]) for r in reqs]
        )
        before = [r.cached for r in reqs]
        for r in reqs:
            r.cached += 1
            r.in_flight += 1
        # The snapshot of a request that crossed a grid position is taken now, before the next
        # step changes its state. With a stop found only when this step's predecessor is
        # processed, it covers the stop token itself: still committed tokens only.
        self.admission.track(reqs, before)
        sampled = self.commit.draw_step(reqs, out.logits, sync)
        if sampled.device is not None:
            self.runner.publish([r.row for r in reqs], sampled.device.device)
            for r in reqs:
                r.pending += 1
        return Launched("decode", reqs, sampled, sync, self.runner.mark_step())

    def _launch_speculative(self, reqs: list[Req]) -> Launched:
        """An overlapped EAGLE step: a request whose previous step is in flight (pending) reads
        its y and n on the device."""
        host = torch.tensor(
            [
                [FUTURE if r.pending else r.fill_ids[-1] for r in reqs],
                [FUTURE if r.pending else r.cached for r in reqs],
                [r.row for r in reqs],
            ],
            dtype=torch.int64,
        )
        max_seq_len = max(r.cached + self._ahead(r) for r in reqs)
        out = self.spec.launch(
            host, [r.sampling for r in reqs], max_seq_len, self.runner.next_tokens
        )
        for r in reqs:
            r.in_flight += 1
            r.pending += 1  # at least one token
        return Launched(
            "decode", reqs, Sampled(reqs, device=out), False, self.runner.mark_step(), spec=True
        )

    def process(self, launched: Launched) -> None:
        """After the step completed: commit its tokens, hand the cache due snapshots."""
        reqs = launched.reqs
        committed = self.stats.generation_tokens_total
        for r in reqs:
            r.in_flight -= 1
        if launched.spec:
            for req, tokens in zip(reqs, accepted_tokens(launched.sampled.device)):
                req.pending -= 1
                if req.finish_reason is None:  # else: the extra step of a finished request
                    self._verified(req, tokens)
                    self.commit.commit(req, tokens)
        else:
            self.commit.commit_sampled(launched.sampled)
        self._checkpoint(reqs)
        self.stats.decode_tokens_total += self.stats.generation_tokens_total - committed

    def _verified(self, req: Req, tokens: list[int]) -> None:
        """An EAGLE step's committed tokens (1..N+1) are in req's cache now."""
        self.stats.spec_verify_steps += 1
        self.stats.spec_committed_tokens += len(tokens)
        req.cached += len(tokens)

    def _run_speculative(self, reqs: list[Req]) -> None:
        proposals = [Proposal(r.row, r.cached, r.fill_ids[-1]) for r in reqs]
        want = [r.top_logprobs_num if r.return_logprob else -1 for r in reqs]
        offers = {b: self.admission.offer(r, self.spec.steps) for b, r in enumerate(reqs)}
        offers = {b: o for b, o in offers.items() if o is not None}
        committed, logprobs = self.spec.step(
            proposals,
            [r.sampling for r in reqs],
            want,
            [(b, j, slot) for b, (j, slot) in offers.items()],
        )
        for b, (req, tokens) in enumerate(zip(reqs, committed)):
            self._verified(req, tokens)
            if b in offers:
                self.admission.tracked(req, req.cached - len(tokens))
        for req, tokens, lps in zip(reqs, committed, logprobs):
            self.commit.commit(req, tokens, lps)
        self._checkpoint(reqs)

    def _checkpoint(self, reqs: list[Req]) -> None:
        for req in reqs:
            if req.finish_reason is None:
                self.admission.checkpoint(req)

    def _retract_one(self, keep: Req) -> Req | None:
        """Free the newest other running request; it is recomputed from its tokens later. A PD
        decode request with images is never one: decode has their token counts, not their pixels."""
        for victim in reversed(self.running):
            if victim is keep or victim.finish_reason is not None:
                continue
            if any(im.pixel_values is None for im in victim.images):
                continue
            assert not victim.in_flight, "retraction only with no step in flight"
            self.running.remove(victim)
            self.admission.release(victim)
            victim.cached = 0
            self.stats.retractions += 1
            log.info("retracted %s (%d tokens) to free KV pages", victim.rid, len(victim.fill_ids))
            return victim
        return None
