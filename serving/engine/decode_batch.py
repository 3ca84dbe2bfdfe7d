"""The decode half of a scheduler step: grow every running request by the tokens one step
writes (retracting the newest other request when pages run out), then one decode forward, or an
EAGLE draft + verify step, over all of them."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from serving.engine.request import Req
from serving.executor.model_runner import StepInput
from serving.protocol import FinishReason
from serving.speculative.eagle import Proposal

if TYPE_CHECKING:
    from serving.engine.scheduler import Scheduler

log = logging.getLogger(__name__)


def run_decode(s: Scheduler) -> None:
    for req in list(s.running):
        if req not in s.running:
            continue  # retracted for an earlier request of this loop
        while req.finish_reason is None and not s.pool.grow(
            req.row, req.pages, req.cached + s.tokens_per_decode
        ):
            if not _retract_one(s, keep=req):
                reason = FinishReason.abort("out of KV cache memory while decoding", 503)
                s.finish(req, reason)
    batch = [r for r in s.running if r.finish_reason is None]
    if not batch:
        return
    if s.spec is not None:
        return _run_speculative(s, batch)
    out = s.runner.forward([StepInput(r.row, r.cached, [r.fill_ids[-1]]) for r in batch])
    for r in batch:
        r.cached += 1
    s.sample_and_advance(batch, out.logits)


def _run_speculative(s: Scheduler, batch: list[Req]) -> None:
    proposals = [Proposal(r.row, r.cached, r.fill_ids[-1]) for r in batch]
    want = [r.top_logprobs_num if r.return_logprob else -1 for r in batch]
    committed, logprobs = s.spec.step(proposals, [r.sampling for r in batch], want)
    for req, tokens, lps in zip(batch, committed, logprobs):
        s.stats.spec_verify_steps += 1
        s.stats.spec_committed_tokens += len(tokens)
        req.cached += len(tokens)
        for j, tok in enumerate(tokens):
            req.output_ids.append(tok)
            s.stats.generation_tokens_total += 1
            lp = [lps[j]] if lps is not None else None
            req.last_logprob = lp[0] if lp else None
            reason = s.stops.reason(req, tok)
            if reason is not None:
                s.finish(req, reason, new_tokens=[tok], logprobs=lp)
                break
            s.outputs.append(s.output_of(req, [tok], lp))


def _retract_one(s: Scheduler, keep: Req) -> bool:
    """Free the newest other running request; it is recomputed from its tokens later."""
    for victim in reversed(s.running):
        if victim is keep or victim.finish_reason is not None:
            continue
        s.running.remove(victim)
        s.release(victim)
        victim.cached = 0
        s.waiting.appendleft(victim)
        s.hold_admission = True
        s.stats.retractions += 1
        log.info("retracted %s (%d tokens) to free KV pages", victim.rid, len(victim.fill_ids))
        return True
    return False
