"""commit: the one place sampled tokens join a request (tokens, logprobs, stop checks), and
finish: the one place a request ends (queues, role hook, then release: memory, the last output;
a request the role holds is released when the role is done with it).

Plain decode, EAGLE's verify and PD decode's first token (sampled by prefill) all commit
through here, so a token is appended, counted and checked for stops the same way everywhere.

Under the overlap scheduler a step's tokens are drawn when it is launched (draw_step: on the
device, the copy to the host under way) and committed when it is processed (commit_sampled),
after the next step was launched. Hazard: a request may have finished (a stop, an abort) in
between; its token from that step is then discarded, never appended.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from serving.engine.admission import Admission
from serving.engine.request import Req, RoleHooks
from serving.engine.stop_conditions import StopConditions
from serving.executor.sampler import SampledTokens, Sampler
from serving.protocol import (
    FinishReason,
    GenerateRequest,
    SchedulerStats,
    SequenceOutput,
    TokenLogprob,
)


@dataclass
class Sampled:
    """One token drawn per request of `reqs`: on the host (`host`: token and logprob entry), or
    still on the device (`device`)."""

    reqs: list[Req]
    host: list[tuple[int, list[TokenLogprob] | None]] | None = None
    device: SampledTokens | None = None

    def results(self) -> list[tuple[int, list[TokenLogprob] | None]]:
        """Waits for the device's copy when there is one."""
        if self.host is None:
            self.host = [(tok, None) for tok in self.device.tolist()]
        return self.host


@dataclass
class Launched:
    """A step whose forward is launched and whose tokens are not committed yet. `reqs`: every
    request in it (each counted in req.in_flight until processed); sync: processed right after
    its launch (nothing overlaps it). kind names the manager that processes it; event
    (ModelRunner.mark_step) is reached when the device has finished the step. spec: an
    overlapped EAGLE step, whose `sampled.device` holds each request's committed tokens
    (Eagle.launch)."""

    kind: str
    reqs: list[Req]
    sampled: Sampled
    sync: bool
    event: object = None
    ends: list[int] = field(default_factory=list)  # prefill: each request's end of chunk
    started: list[Req] = field(default_factory=list)  # prefill: requests that start decoding
    spec: bool = False
    waited: float = 0.0  # seconds the host waited for `event` before processing
    phases: object = None  # prefill: its StepPhases record while they are recorded


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

    def draw_step(self, reqs: list[Req], logits: torch.Tensor, sync: bool) -> Sampled:
        """A step's tokens: drawn on the host at once (sync), or left on the device (every
        request overlap-safe, no logprobs wanted: the scheduler checks)."""
        if sync or not reqs:
            return Sampled(reqs, host=self.draw(reqs, logits))
        return Sampled(reqs, device=self.sampler.sample_async(logits, [r.sampling for r in reqs]))

    def commit_sampled(self, sampled: Sampled) -> None:
        """Commit a processed step's tokens; a request that finished since its launch drops
        its token (the extra step's output)."""
        on_device = sampled.device is not None  # each such token was counted in req.pending
        for req, (tok, lp) in zip(sampled.reqs, sampled.results()):
            req.pending -= on_device
            if req.finish_reason is None:
                self.commit(req, [tok], lp)

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
        if not self.hooks.finished(req):
            self.release(req, new_tokens or [], logprobs)

    def release(self, req: Req, tokens: list[int], logprobs=None) -> None:
        """A finished request's end: its memory back, its last output out. finish() runs it,
        unless the role holds the request (RoleHooks.finished); the role's release_held() then
        does, once it is done with it."""
        self.admission.release(req)
        self.outputs.append(self.output_of(req, tokens, logprobs))

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
        if req.finish_reason is not None:
            req.finishing()
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
            decode_cached_tokens=req.decode_cached_tokens,
            logprobs=logprobs,
            stage_times=dict(req.stages) if req.finish_reason is not None else None,
        )
