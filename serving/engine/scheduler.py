"""Continuous batching: admission, chunked prefill, decode, retraction, finishing.

One `step()` runs one forward: a prefill batch when there is prefill work that fits, else a
decode batch over every running request. A request owns one request row and the pages that
hold its tokens from admission until it finishes, is aborted or is retracted; all three return
them at once.

    waiting --admit (row + pages for the chunk)--> prefilling --last chunk--> running
       ^                                                                        |
       +------------- retract (decode out of pages: state freed, recomputed) ---+

The step's two halves are prefill_batch.run_prefill and decode_batch.run_decode; this file holds
intake, finishing and the outputs. Req, SchedulerConfig and the Role plug: request.py; when a
request stops: stop_conditions.py.
"""

from __future__ import annotations

import logging
import os
from collections import deque

import torch

from serving.engine.decode_batch import run_decode
from serving.engine.prefill_batch import run_prefill
from serving.engine.request import Req, Role, SchedulerConfig
from serving.engine.stop_conditions import StopConditions
from serving.executor.model_runner import ModelRunner
from serving.executor.sampler import Sampler, SamplingState
from serving.memory.pool import MemoryPool
from serving.protocol import (
    FinishReason,
    GenerateRequest,
    SchedulerStats,
    SequenceOutput,
    TokenLogprob,
)
from serving.speculative.eagle import Eagle

log = logging.getLogger(__name__)

# Tests set this to check the pool invariant after every step.
CHECK_INVARIANTS = os.environ.get("PDSERVE_CHECK_INVARIANTS") == "1"


class Scheduler:
    def __init__(
        self,
        runner: ModelRunner,
        pool: MemoryPool,
        sampler: Sampler,
        config: SchedulerConfig,
        eos_token_ids: frozenset[int],
        detokenize=None,
        role: Role | None = None,
        spec: Eagle | None = None,
    ) -> None:
        self.runner, self.pool, self.sampler, self.cfg = runner, pool, sampler, config
        self.spec = spec
        # positions a decode step writes: 1, or y + N drafts when speculating
        self.tokens_per_decode = 1 if spec is None else spec.steps + 1
        self.role = role or Role()
        self.role.attach(self)
        self.eos = eos_token_ids
        self.stops = StopConditions(eos_token_ids, config.context_length, detokenize)
        self.waiting: deque[Req] = deque()
        self.prefilling: Req | None = None  # the one request part-way through chunked prefill
        self.running: list[Req] = []
        self.stats = SchedulerStats(
            total_rows=pool.plan.rows,
            total_pages=pool.plan.pages,
            page_size=pool.plan.page_size,
            spec_num_steps=0 if spec is None else spec.steps,
        )
        self.outputs: list[SequenceOutput] = []
        # After a retraction, admit nothing new until a running request finishes: re-admitting
        # at once would only retract again (thrash).
        self.hold_admission = False

    # ---- intake ----
    def make_req(self, request: GenerateRequest) -> Req:
        p = request.sampling
        state = SamplingState(
            params=p,
            prompt_ids=list(request.input_ids),
            output_ids=[],
            eos_token_ids=self.eos,
        )
        req = Req(
            request.rid,
            list(request.input_ids),
            state,
            request.return_logprob,
            request.top_logprobs_num,
        )
        start = request.logprob_start_len if request.return_logprob else -1
        req.input_scored = len(req.input_ids) if start < 0 else start
        if start == 0 and req.input_ids:  # nothing predicts the first token: no logprob
            req.input_logprobs.append(TokenLogprob(req.input_ids[0], None))
            req.input_scored = 1
        return req

    def admission_problem(self, request: GenerateRequest) -> str | None:
        """Why `request` can never run here, or None."""
        n, p = len(request.input_ids), request.sampling
        if n == 0:
            return "empty prompt"
        if n + max(p.max_new_tokens, 1) > self.cfg.context_length:
            return (
                f"prompt ({n} tokens) plus max_tokens ({p.max_new_tokens}) exceeds the context "
                f"length ({self.cfg.context_length})"
            )
        if self.pool.pages.pages_for(n + 1) > self.pool.plan.pages:
            tokens = self.pool.plan.pages * self.pool.plan.page_size
            return f"prompt ({n} tokens) does not fit in the KV pool ({tokens} tokens)"
        return None

    def add(self, request: GenerateRequest) -> None:
        problem = self.admission_problem(request)
        if problem is not None:
            return self.fail_request(request, problem, 400)
        req = self.make_req(request)
        if request.sampling.max_new_tokens == 0 and req.input_scored >= len(req.input_ids):
            self.finish(req, FinishReason.length())
        else:
            self.stats.prompt_tokens_total += len(req.input_ids)
            self.waiting.append(req)

    def fail_request(self, request: GenerateRequest | Req, message: str, status: int) -> None:
        """Answer, with an error, a request the scheduler does not hold: refused before it got a
        row, or failed by a role that has already settled its memory. Only the answer is sent;
        no role hook runs."""
        reason = FinishReason.abort(message, status)
        self.outputs.append(
            SequenceOutput(
                rid=request.rid,
                new_token_ids=[],
                finished=True,
                finish_reason=reason,
                prompt_tokens=len(request.input_ids),
            )
        )

    def adopt(self, req: Req, first_token: int, logprobs: list[TokenLogprob] | None) -> None:
        """Take a request whose prompt is already in the cache (PD decode) and whose first token
        was sampled elsewhere; it decodes from here on, like any running request."""
        req.output_ids.append(first_token)
        self.stats.prompt_tokens_total += len(req.input_ids)
        self.stats.generation_tokens_total += 1
        reason = self.stops.reason(req, first_token)
        if reason is not None:
            self.finish(req, reason, new_tokens=[first_token], logprobs=logprobs)
        else:
            self.running.append(req)
            self.outputs.append(self.output_of(req, [first_token], logprobs))

    def release_held(
        self,
        req: Req,
        error: str | None = None,
        status: int = 500,
        logprobs: list[TokenLogprob] | None = None,
    ) -> None:
        """The role is done with a request it held: free its memory and report it."""
        if error is not None:
            req.finish_reason = FinishReason.abort(error, status)
            tokens: list[int] = []
        else:
            tokens = req.output_ids[-1:]
        self.release(req)
        self.outputs.append(self.output_of(req, tokens, logprobs if error is None else None))

    @property
    def queued(self) -> int:
        return len(self.waiting) + int(self.prefilling is not None) + self.role.queued

    def queue_full(self) -> str | None:
        """Why a new request cannot even wait here (503 + Retry-After), or None. Refusing at
        once is the back-pressure: a request past the bound would only wait and time out."""
        limit = self.cfg.max_queued_requests
        if limit is None or self.queued < limit:
            return None
        return (
            f"the server is at capacity: {len(self.running)} requests running and "
            f"{self.queued} waiting (--max-queued-requests {limit}); retry later"
        )

    @property
    def free_running_slots(self) -> int:
        return self.cfg.max_running_requests - len(self.running)

    def abort(self, rid: str, reason: str = "aborted", status: int = 499) -> None:
        for req in self._live():
            if req.rid == rid:
                self.finish(req, FinishReason.abort(reason, status))
                return

    def _live(self) -> list[Req]:
        live = list(self.waiting) + self.running
        return live + ([self.prefilling] if self.prefilling else [])

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.prefilling)

    @property
    def pending_outputs(self) -> bool:
        return bool(self.outputs)

    # ---- one forward ----
    def step(self) -> list[SequenceOutput]:
        if not run_prefill(self) and self.running:
            run_decode(self)
        self.refresh_stats()
        if CHECK_INVARIANTS:
            self.check_invariants()
        out, self.outputs = self.outputs, []
        return out

    # ---- results ----
    def sample_and_advance(self, reqs: list[Req], logits: torch.Tensor) -> None:
        want = [r.top_logprobs_num if r.return_logprob else -1 for r in reqs]
        top = [max(w, 0) for w in want] if any(w >= 0 for w in want) else None
        tokens, logprobs = self.sampler.sample(logits, [r.sampling for r in reqs], top)
        for i, (req, tok) in enumerate(zip(reqs, tokens)):
            req.output_ids.append(tok)
            self.stats.generation_tokens_total += 1
            lp = [logprobs[i]] if logprobs is not None and want[i] >= 0 else None
            req.last_logprob = lp[0] if lp else None
            reason = self.stops.reason(req, tok)
            if reason is not None:
                self.finish(req, reason, new_tokens=[tok], logprobs=lp)
            else:
                self.outputs.append(self.output_of(req, [tok], lp))

    def output_of(self, req: Req, tokens: list[int], logprobs=None) -> SequenceOutput:
        scored = None
        if req.input_logprobs and not req.input_logprobs_sent:
            scored, req.input_logprobs_sent = req.input_logprobs, True
        return SequenceOutput(
            input_logprobs=scored,
            rid=req.rid,
            new_token_ids=tokens,
            finished=req.finish_reason is not None,
            finish_reason=req.finish_reason,
            prompt_tokens=len(req.input_ids),
            completion_tokens=len(req.output_ids),
            logprobs=logprobs,
        )

    def finish(
        self,
        req: Req,
        reason: FinishReason,
        new_tokens: list[int] | None = None,
        logprobs: list[TokenLogprob] | None = None,
    ) -> None:
        req.finish_reason = reason
        if req in self.running:
            self.running.remove(req)
            self.hold_admission = False
        if req in self.waiting:
            self.waiting.remove(req)
        if self.prefilling is req:
            self.prefilling = None
        if self.role.finished(req):
            return
        self.release(req)
        self.outputs.append(self.output_of(req, new_tokens or [], logprobs))

    def release(self, req: Req) -> None:
        if req.pages:
            self.pool.free_pages(req.pages)
        if req.row is not None:
            self.pool.free_row(req.row)
            req.row = None

    # ---- observability ----
    def refresh_stats(self) -> None:
        s = self.stats
        s.running = len(self.running)
        s.queued = self.queued
        s.used_rows = len(self.pool.rows.used)
        s.peak_used_rows = max(s.peak_used_rows, max(self.pool.rows.used, default=0))
        s.used_pages = len(self.pool.pages.used)

    def check_invariants(self) -> None:
        live = self._live()
        self.pool.check({r.rid: (r.row, r.pages) for r in live + self.role.owned()})
        for r in live:
            assert r.finish_reason is None, f"{r.rid} finished but still queued"
