"""Continuous batching: admission, chunked prefill, decode, retraction, finishing.

One `step()` runs one forward: a prefill batch when there is prefill work that fits, else a
decode batch over every running request. A request owns one request row and the pages that
hold its tokens from admission until it finishes, is aborted or is retracted; all three return
them at once.

    waiting --admit (row + pages for the chunk)--> prefilling --last chunk--> running
       ^                                                                        |
       +------------- retract (decode out of pages: state freed, recomputed) ---+
"""

from __future__ import annotations

import logging
import os
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import torch

from serving.memory.pool import MemoryPool
from serving.model_runner import ModelRunner, StepInput
from serving.protocol import (
    GenerateRequest,
    SchedulerStats,
    SequenceOutput,
    TokenLogprob,
)
from serving.sampler import Sampler, SamplingState, make_generator
from serving.speculative import Eagle, Proposal

log = logging.getLogger(__name__)

# Tests set this to check the pool invariant after every step.
CHECK_INVARIANTS = os.environ.get("PDSERVE_CHECK_INVARIANTS") == "1"


class Role:
    """A worker role's plug into the batching loop. The plain worker uses this one as is;
    workers/prefill.py and workers/decode.py override what differs for PD.

    Invariant: a request the role holds (finished() returned True) keeps its row and pages
    until the role calls Scheduler.release_held(); nothing else frees them.
    """

    scheduler: Scheduler

    def attach(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler

    def submit(self, request: GenerateRequest) -> None:
        full = self.scheduler.queue_full()
        if full is not None:
            return self.scheduler.reject(self.scheduler.make_req(request), full, 503)
        self.scheduler.add(request)

    def abort(self, rid: str, reason: str) -> None:
        self.scheduler.abort(rid, reason)

    def poll(self) -> None:
        """Called before every step: advance the role's own queues."""

    def chunk_prefilled(self, req: Req) -> None:
        """req.cached tokens of req are now in the cache (after every prefill chunk)."""

    def finished(self, req: Req) -> bool:
        """req just finished; True = the role holds its memory and reports it later."""
        return False

    @property
    def busy(self) -> bool:
        """Work outside the scheduler's queues (transfers in flight)."""
        return False

    def sockets(self) -> list:
        """ZMQ sockets the process loop should wake up for."""
        return []

    def owned(self) -> list[Req]:
        """Requests outside the scheduler's queues that own rows or pages (for the invariant)."""
        return []

    @property
    def queued(self) -> int:
        """Requests the role holds that have not started running (waiting for a peer, for
        memory, for their KV); counted in num_queue_reqs and against the queue bound."""
        return 0


@dataclass
class SchedulerConfig:
    max_running_requests: int
    chunked_prefill_size: int
    max_prefill_tokens: int
    context_length: int
    max_queued_requests: int | None = None  # None: no bound


@dataclass
class Req:
    rid: str
    input_ids: list[int]
    sampling: SamplingState
    return_logprob: bool = False
    top_logprobs_num: int = 0
    row: int | None = None
    pages: list[int] = field(default_factory=list)
    cached: int = 0  # leading tokens of fill_ids whose KV/state is in the cache
    finish_reason: dict[str, Any] | None = None
    last_logprob: TokenLogprob | None = None  # of the latest sampled token, when asked for

    @property
    def output_ids(self) -> list[int]:
        return self.sampling.output_ids

    @property
    def fill_ids(self) -> list[int]:
        """Tokens the model consumes; the last sampled token is consumed by the next step."""
        return self.input_ids + self.output_ids

    @property
    def uncached(self) -> int:
        return len(self.input_ids) + len(self.output_ids) - self.cached


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
        self.detokenize = detokenize  # list[int] -> str, for stop strings
        self.waiting: deque[Req] = deque()
        self.prefilling: Req | None = None  # the one request part-way through chunked prefill
        self.running: list[Req] = []
        self.stats = SchedulerStats(
            total_rows=pool.plan.rows,
            total_pages=pool.plan.pages,
            page_size=pool.plan.page_size,
            spec_num_steps=0 if spec is None else spec.steps,
        )
        self._outputs: list[SequenceOutput] = []
        # After a retraction, admit nothing new until a running request finishes: re-admitting
        # at once would only retract again (thrash).
        self._hold_admission = False

    # ---- intake ----
    def make_req(self, request: GenerateRequest) -> Req:
        p = request.sampling
        state = SamplingState(
            params=p,
            prompt_ids=list(request.input_ids),
            output_ids=[],
            generator=make_generator(p.seed, self.pool.device),
            eos_token_ids=self.eos,
        )
        return Req(
            request.rid,
            list(request.input_ids),
            state,
            request.return_logprob,
            request.top_logprobs_num,
        )

    def admission_problem(self, req: Req) -> str | None:
        """Why `req` can never run here, or None."""
        n, p = len(req.input_ids), req.sampling.params
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
        req = self.make_req(request)
        problem = self.admission_problem(req)
        if problem is not None:
            self.reject(req, problem, 400)
        elif request.sampling.max_new_tokens == 0:
            self._finish(req, {"type": "length", "matched": None})
        else:
            self.stats.prompt_tokens_total += len(req.input_ids)
            self.waiting.append(req)

    def reject(self, req: Req, message: str, status: int = 400) -> None:
        """Finish a request that never ran (or whose handoff failed) with an error."""
        self._finish(req, {"type": "abort", "message": message, "status": status})

    def adopt(self, req: Req, first_token: int, logprobs: list[TokenLogprob] | None) -> None:
        """Take a request whose prompt is already in the cache (PD decode) and whose first token
        was sampled elsewhere; it decodes from here on, like any running request."""
        req.output_ids.append(first_token)
        self.stats.prompt_tokens_total += len(req.input_ids)
        self.stats.generation_tokens_total += 1
        reason = self._finish_reason(req, first_token)
        if reason is not None:
            self._finish(req, reason, new_tokens=[first_token], logprobs=logprobs)
        else:
            self.running.append(req)
            self._outputs.append(self._output(req, [first_token], logprobs))

    def release_held(
        self,
        req: Req,
        error: str | None = None,
        status: int = 500,
        logprobs: list[TokenLogprob] | None = None,
    ) -> None:
        """The role is done with a request it held: free its memory and report it."""
        if error is not None:
            req.finish_reason = {"type": "abort", "message": error, "status": status}
            tokens: list[int] = []
        else:
            tokens = req.output_ids[-1:]
        self._release(req)
        self._outputs.append(self._output(req, tokens, logprobs if error is None else None))

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
                self._finish(req, {"type": "abort", "message": reason, "status": status})
                return

    def _live(self) -> list[Req]:
        live = list(self.waiting) + self.running
        return live + ([self.prefilling] if self.prefilling else [])

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.prefilling)

    @property
    def pending_outputs(self) -> bool:
        return bool(self._outputs)

    # ---- one forward ----
    def step(self) -> list[SequenceOutput]:
        if self._run_prefill() is False and self.running:
            self._run_decode()
        self.refresh_stats()
        if CHECK_INVARIANTS:
            self.check_invariants()
        out, self._outputs = self._outputs, []
        return out

    def _run_prefill(self) -> bool:
        plan: list[tuple[Req, int]] = []
        budget = self.cfg.max_prefill_tokens
        if self.prefilling is not None:
            req = self.prefilling
            n = min(req.uncached, self.cfg.chunked_prefill_size, budget)
            if not self.pool.grow(req.row, req.pages, req.cached + n):
                return False  # decode frees pages as requests finish
            plan.append((req, n))
            budget -= n
        while (
            self.waiting
            and not self._hold_admission
            and budget > 0
            and self.prefilling is None
            and len(self.running) + len(plan) < self.cfg.max_running_requests
        ):
            req = self.waiting[0]
            n = min(req.uncached, self.cfg.chunked_prefill_size, budget)
            # keep one page per running request in reserve for its next decode tokens
            reserve = len(self.running) + len(plan)
            if self.pool.pages.num_free - self.pool.pages.pages_for(n + 1) < reserve:
                break
            row = self.pool.alloc_row()
            if row is None:
                break
            req.row = row
            if not self.pool.grow(row, req.pages, n):
                self.pool.free_row(row)
                req.row = None
                break
            self.waiting.popleft()
            plan.append((req, n))
            budget -= n
            if n < req.uncached:
                self.prefilling = req
        if not plan:
            return False
        out = self.runner.forward(
            [
                StepInput(req.row, req.cached, req.fill_ids[req.cached : req.cached + n])
                for req, n in plan
            ]
        )
        done: list[tuple[Req, int]] = []
        for i, (req, n) in enumerate(plan):
            req.cached += n
            self.role.chunk_prefilled(req)
            if req.uncached == 0:
                done.append((req, i))
                if self.prefilling is req:
                    self.prefilling = None
        if done:
            self._sample_and_advance([r for r, _ in done], out.logits[[i for _, i in done]])
            self.running.extend(r for r, _ in done if r.finish_reason is None)
        if self.spec is not None:
            self._extend_draft(plan, out.hidden)
        return True

    def _extend_draft(self, plan: list[tuple[Req, int]], hidden: torch.Tensor) -> None:
        """Run the draft over the chunk just prefilled (its next tokens are known now: the
        prompt, or for the last chunk the token just sampled). Released requests are skipped."""
        offsets = [0]
        for _, n in plan:
            offsets.append(offsets[-1] + n)
        keep = [i for i, (req, _) in enumerate(plan) if req.row is not None]
        if not keep:
            return
        reqs = [plan[i][0] for i in keep]
        starts = [req.cached - plan[i][1] for req, i in zip(reqs, keep)]
        tokens = [req.fill_ids[s + 1 : req.cached + 1] for req, s in zip(reqs, starts)]
        index = torch.cat([torch.arange(offsets[i], offsets[i + 1]) for i in keep])
        self.spec.extend_draft(
            [r.row for r in reqs], starts, tokens, hidden[index.to(hidden.device)]
        )

    def _run_decode(self) -> None:
        for req in list(self.running):
            if req not in self.running:
                continue  # retracted for an earlier request of this loop
            while req.finish_reason is None and not self.pool.grow(
                req.row, req.pages, req.cached + self.tokens_per_decode
            ):
                if not self._retract_one(keep=req):
                    self._finish(
                        req,
                        {
                            "type": "abort",
                            "status": 503,
                            "message": "out of KV cache memory while decoding",
                        },
                    )
        batch = [r for r in self.running if r.finish_reason is None]
        if not batch:
            return
        if self.spec is not None:
            return self._run_speculative(batch)
        out = self.runner.forward([StepInput(r.row, r.cached, [r.fill_ids[-1]]) for r in batch])
        for r in batch:
            r.cached += 1
        self._sample_and_advance(batch, out.logits)

    def _run_speculative(self, batch: list[Req]) -> None:
        proposals = [Proposal(r.row, r.cached, r.fill_ids[-1]) for r in batch]
        want = [r.top_logprobs_num if r.return_logprob else -1 for r in batch]
        committed, logprobs = self.spec.step(proposals, [r.sampling for r in batch], want)
        for req, tokens, lps in zip(batch, committed, logprobs):
            self.stats.spec_verify_steps += 1
            self.stats.spec_committed_tokens += len(tokens)
            req.cached += len(tokens)
            for j, tok in enumerate(tokens):
                req.output_ids.append(tok)
                self.stats.generation_tokens_total += 1
                lp = [lps[j]] if lps is not None else None
                req.last_logprob = lp[0] if lp else None
                reason = self._finish_reason(req, tok)
                if reason is not None:
                    self._finish(req, reason, new_tokens=[tok], logprobs=lp)
                    break
                self._outputs.append(self._output(req, [tok], lp))

    def _retract_one(self, keep: Req) -> bool:
        """Free the newest other running request; it is recomputed from its tokens later."""
        for victim in reversed(self.running):
            if victim is keep or victim.finish_reason is not None:
                continue
            self.running.remove(victim)
            self._release(victim)
            victim.cached = 0
            self.waiting.appendleft(victim)
            self._hold_admission = True
            self.stats.retractions += 1
            log.info("retracted %s (%d tokens) to free KV pages", victim.rid, len(victim.fill_ids))
            return True
        return False

    # ---- results ----
    def _sample_and_advance(self, reqs: list[Req], logits: torch.Tensor) -> None:
        want = [r.top_logprobs_num if r.return_logprob else -1 for r in reqs]
        top = [max(w, 0) for w in want] if any(w >= 0 for w in want) else None
        tokens, logprobs = self.sampler.sample(logits, [r.sampling for r in reqs], top)
        for i, (req, tok) in enumerate(zip(reqs, tokens)):
            req.output_ids.append(tok)
            self.stats.generation_tokens_total += 1
            lp = [logprobs[i]] if logprobs is not None and want[i] >= 0 else None
            req.last_logprob = lp[0] if lp else None
            reason = self._finish_reason(req, tok)
            if reason is not None:
                self._finish(req, reason, new_tokens=[tok], logprobs=lp)
            else:
                self._outputs.append(self._output(req, [tok], lp))

    def _finish_reason(self, req: Req, tok: int) -> dict[str, Any] | None:
        p = req.sampling.params
        if tok in p.stop_token_ids or (tok in self.eos and not p.ignore_eos):
            return {"type": "stop", "matched": tok}
        if p.stop and self.detokenize is not None:
            window = max(len(s) for s in p.stop) + 8
            tail = self.detokenize(req.output_ids[-window:])
            for s in p.stop:
                if s in tail:
                    return {"type": "stop", "matched": s}
        if (grammar_reason := req.sampling.grammar_finish_reason()) is not None:
            return grammar_reason
        if len(req.output_ids) >= p.max_new_tokens:
            return {"type": "length", "matched": None}
        if len(req.fill_ids) >= self.cfg.context_length:
            return {"type": "length", "matched": None}
        return None

    def _output(self, req: Req, tokens: list[int], logprobs=None) -> SequenceOutput:
        return SequenceOutput(
            rid=req.rid,
            new_token_ids=tokens,
            finished=req.finish_reason is not None,
            finish_reason=req.finish_reason,
            prompt_tokens=len(req.input_ids),
            completion_tokens=len(req.output_ids),
            logprobs=logprobs,
        )

    def _finish(
        self,
        req: Req,
        reason: dict[str, Any],
        new_tokens: list[int] | None = None,
        logprobs: list[TokenLogprob] | None = None,
    ) -> None:
        req.finish_reason = reason
        if req in self.running:
            self.running.remove(req)
            self._hold_admission = False
        if req in self.waiting:
            self.waiting.remove(req)
        if self.prefilling is req:
            self.prefilling = None
        if self.role.finished(req):
            return
        self._release(req)
        self._outputs.append(self._output(req, new_tokens or [], logprobs))

    def _release(self, req: Req) -> None:
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
