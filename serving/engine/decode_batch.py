"""The decode half of the engine: it owns the running requests.

schedule(): grow every running request by the tokens one step writes (evicting cached pages,
then retracting the newest other request when pages run out; the retracted ones go back to the
prefill queue). run(): one decode forward, or an EAGLE draft + verify step, over all of them;
snapshot the KDA state of each request that crossed a grid position (admission.track, or from
EAGLE's verify history); commit what it sampled; hand the prefix cache a snapshot every
--mamba-track-interval tokens.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from serving.engine.admission import Admission
from serving.engine.commit import Commit
from serving.engine.request import Req
from serving.executor.model_runner import ModelRunner, StepInput
from serving.protocol import FinishReason, SchedulerStats
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

    def schedule(self) -> DecodeBatch:
        retracted: list[Req] = []
        for req in list(self.running):
            if req not in self.running:
                continue  # retracted for an earlier request of this loop
            while req.finish_reason is None and not self.admission.grow(
                req, req.cached + self.tokens_per_step
            ):
                victim = self._retract_one(keep=req)
                if victim is None:
                    reason = FinishReason.abort("out of KV cache memory while decoding", 503)
                    self.commit.finish(req, reason)
                else:
                    retracted.append(victim)
        return DecodeBatch([r for r in self.running if r.finish_reason is None], retracted)

    def run(self, batch: DecodeBatch) -> None:
        reqs = batch.reqs
        if not reqs:
            return
        committed = self.stats.generation_tokens_total
        if self.spec is not None:
            self._run_speculative(reqs)
        else:
            out = self.runner.forward([StepInput(r.row, r.cached, [r.fill_ids[-1]]) for r in reqs])
            before = [r.cached for r in reqs]
            for r in reqs:
                r.cached += 1
            self.admission.track(reqs, before)
            self.commit.sample(reqs, out.logits)
            self._checkpoint(reqs)
        self.stats.decode_tokens_total += self.stats.generation_tokens_total - committed

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
            self.stats.spec_verify_steps += 1
            self.stats.spec_committed_tokens += len(tokens)
            req.cached += len(tokens)
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
        """Free the newest other running request; it is recomputed from its tokens later."""
        for victim in reversed(self.running):
            if victim is keep or victim.finish_reason is not None:
                continue
            self.running.remove(victim)
            self.admission.release(victim)
            victim.cached = 0
            self.stats.retractions += 1
            log.info("retracted %s (%d tokens) to free KV pages", victim.rid, len(victim.fill_ids))
            return victim
        return None
