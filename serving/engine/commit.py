"""commit: the one place sampled tokens join a request (tokens, logprobs, stop checks), and
finish: the one place a request ends (queues, role hook, memory, the last output).

Plain decode, EAGLE's verify and PD decode's first token (sampled by prefill) all commit
through here, so a token is appended, counted and checked for stops the same way everywhere.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from serving.engine.admission import Admission
from serving.engine.request import Req, RoleHooks
from serving.engine.stop_conditions import StopConditions
from serving.executor.sampler import Sampler
from serving.protocol import (
    FinishReason,
    GenerateRequest,
    SchedulerStats,
    SequenceOutput,
    TokenLogprob,
)


class Commit:
    def __init__(
        self,
        sampler: Sampler,
        stops: StopConditions,
        stats: SchedulerStats,
        admission: Admission,
        hooks: RoleHooks,
        unqueue: Callable[[Req], None],
    ) -> None:
        self.sampler, self.stops, self.stats = sampler, stops, stats
        self.admission, self.hooks = admission, hooks
        self.unqueue = unqueue  # takes a finished request out of the scheduler's queues
        self.outputs: list[SequenceOutput] = []

    def sample(self, reqs: list[Req], logits: torch.Tensor) -> None:
        """Sample one token per request from its logits row and commit it."""
        for req, (tok, lp) in zip(reqs, self.draw(reqs, logits)):
            self.commit(req, [tok], lp)

    def draw(
        self, reqs: list[Req], logits: torch.Tensor
    ) -> list[tuple[int, list[TokenLogprob] | None]]:
        """Sample one token per request (and its logprob entry, when asked for) without
        committing it."""
        if not reqs:
            return []
        want = [r.top_logprobs_num if r.return_logprob else -1 for r in reqs]
        top = [max(w, 0) for w in want] if any(w >= 0 for w in want) else None
        tokens, logprobs = self.sampler.sample(logits, [r.sampling for r in reqs], top)
        return [
            (tok, [logprobs[i]] if logprobs is not None and want[i] >= 0 else None)
            for i, tok in enumerate(tokens)
        ]

    def commit(
        self, req: Req, tokens: list[int], logprobs: list[TokenLogprob] | None = None
    ) -> None:
        """Append `tokens` (with their logprobs, when asked for) one by one; the first that
        stops the request finishes it and the rest are dropped."""
        if tokens:
            req.tokens_joined()
        for j, tok in enumerate(tokens):
            req.output_ids.append(tok)
            self.stats.generation_tokens_total += 1
            lp = [logprobs[j]] if logprobs is not None else None
            req.last_logprob = lp[0] if lp else None
            reason = self.stops.reason(req, tok)
            if reason is not None:
                self.finish(req, reason, new_tokens=[tok], logprobs=lp)
                return
            self.outputs.append(self.output_of(req, [tok], lp))

    def finish(
        self,
        req: Req,
        reason: FinishReason,
        new_tokens: list[int] | None = None,
        logprobs: list[TokenLogprob] | None = None,
    ) -> None:
        req.finish_reason = reason
        self.unqueue(req)
        if self.hooks.finished(req):
            return
        self.admission.release(req)
        self.outputs.append(self.output_of(req, new_tokens or [], logprobs))

    def fail(self, request: GenerateRequest | Req, message: str, status: int) -> None:
        """Answer, with an error, a request the scheduler does not hold: refused before it got a
        row, or failed by a role that has already settled its memory. Only the answer is sent;
        no role hook runs."""
        self.outputs.append(
            SequenceOutput(
                rid=request.rid,
                new_token_ids=[],
                finished=True,
                finish_reason=FinishReason.abort(message, status),
                prompt_tokens=len(request.input_ids),
            )
        )

    def output_of(self, req: Req, tokens: list[int], logprobs=None) -> SequenceOutput:
        scored = queue_time = None
        if req.input_logprobs and not req.input_logprobs_sent:
            scored, req.input_logprobs_sent = req.input_logprobs, True
        if req.queue_time is not None and not req.queue_time_sent:
            queue_time, req.queue_time_sent = req.queue_time, True
        return SequenceOutput(
            input_logprobs=scored,
            queue_time=queue_time,
            rid=req.rid,
            new_token_ids=tokens,
            finished=req.finish_reason is not None,
            finish_reason=req.finish_reason,
            prompt_tokens=len(req.input_ids),
            completion_tokens=len(req.output_ids),
            cached_tokens=req.cached_tokens or 0,
            logprobs=logprobs,
            stage_times=dict(req.stages) if req.finish_reason is not None else None,
        )
