"""Continuous batching: intake, one forward per step, finishing, outputs.

One `step()` runs one forward: a prefill batch when there is prefill work that fits, else a
decode batch over every running request. A request owns one request row and the pages that
hold its tokens from admission until it finishes, is aborted or is retracted; all three return
them at once.

    waiting --admit (row + pages for the chunk)--> prefilling --last chunk--> running
       ^                                                                        |
       +------------- retract (decode out of pages: state freed, recomputed) ---+

The engine's two verbs each live in one place: admission.admit (a request gets its memory) and
commit.commit (sampled tokens join a request, stops are checked). The halves own their queues:
PrefillManager (prefill_batch.py) the waiting and chunk-prefilling requests, DecodeManager
(decode_batch.py) the running ones; this file composes them. Req, SchedulerConfig and the role's
hooks: request.py; when a request stops: stop_conditions.py.

The overlap scheduler (SGLang's; on unless --disable-overlap-schedule). A step is launched
(forward and sampling queued on the device) and processed (its tokens committed: stops,
outputs) in two halves, and one step stays in flight: step() schedules and launches step N+1,
then processes step N, whose device work ran meanwhile, while the device runs N+1. A request
whose token of step N is still on the device is `pending`; N+1 reads that token there (FUTURE
in its input, ModelRunner.next_tokens). Hazards:
- a request that finishes when step N is processed is already in step N+1: its extra token is
  discarded (commit_sampled), and its row and pages are freed only after N+1 completed
  (admission.release defers to settle()). A request whose pending token ends it by length is
  left out of N+1 (decode_batch._ends_pending), so max_tokens costs no extra step;
- retraction frees a running request's memory at once: it happens only with nothing in flight;
- what cannot be sampled before the previous token reaches the host (logprobs, penalties,
  min_new_tokens, grammars, seeded draws: sampler.overlap_safe) runs sync: the step in flight
  is processed first, the new one right after its launch. So do EAGLE's prefill steps (the
  draft's extend reads the first token on the host), its decode steps under TP or near a
  snapshot grid position (DecodeManager.spec_overlaps), and every step with
  --disable-overlap-schedule: today's order. An overlapped EAGLE step accepts on the device;
  the host learns each request's token count when processing it (decode_batch.py).
"""

from __future__ import annotations

import logging
import os
import time

from serving.engine.admission import Admission, snapshot_grid
from serving.engine.batch_log import BatchLog
from serving.engine.commit import Commit, Launched
from serving.engine.decode_batch import DecodeBatch, DecodeManager
from serving.engine.prefill_batch import PrefillBatch, PrefillManager
from serving.engine.request import Req, RoleHooks, SchedulerConfig
from serving.engine.stop_conditions import StopConditions
from serving.executor.model_runner import ModelRunner
from serving.executor.sampler import Sampler, overlap_safe
from serving.memory.pool import MemoryPool
from serving.memory.radix_cache import RadixCache
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
        hooks: RoleHooks | None = None,
        spec: Eagle | None = None,
    ) -> None:
        self.runner, self.pool, self.sampler, self.cfg = runner, pool, sampler, config
        self.spec = spec
        self.hooks = hooks or RoleHooks()
        self.eos = eos_token_ids
        self.stats = SchedulerStats(
            total_rows=pool.plan.rows,
            total_pages=pool.plan.pages,
            page_size=pool.plan.page_size,
            spec_num_steps=0 if spec is None else spec.steps,
        )
        cache = None
        if config.prefix_cache:
            cache = RadixCache(pool, snapshot_grid(pool.plan.page_size, pool.config.index_kpool))
        elif config.page_cache:  # PD decode: pages only, states come from prefill
            cache = RadixCache(pool, pool.plan.page_size, snapshots=False)
        self.admission = Admission(
            pool, self.stats, cache, config.track_interval, pool.config.vocab_size
        )
        self.cache = cache
        self.stats.total_state_slots = pool.plan.state_slots
        stops = StopConditions(eos_token_ids, config.context_length, detokenize)
        self.commit = Commit(sampler, stops, self.stats, self.admission, self.hooks, self._unqueue)
        self.prefill = PrefillManager(config, runner, self.admission, self.commit, self.hooks, spec)
        self.decode = DecodeManager(runner, self.admission, self.commit, self.stats, spec)
        self.batch_log = BatchLog(config, self.stats, runner, spec, self.hooks)
        self.inflight: Launched | None = None  # launched, not processed yet (overlap)

    @property
    def running(self) -> list[Req]:
        return self.decode.running

    # ---- intake ----
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
        pixels = any(im.pixel_values is not None for im in request.images)  # None: PD decode's
        if pixels and self.prefill.images is None:
            return "this worker runs no vision tower (a text-only model)"
        return None

    def add(self, request: GenerateRequest) -> None:
        problem = self.admission_problem(request)
        if problem is not None:
            return self.fail_request(request, problem, 400)
        req = Req.of(request, self.eos)
        if request.sampling.max_new_tokens == 0 and req.input_scored >= len(req.input_ids):
            self.commit.finish(req, FinishReason.length())
        else:
            self.stats.prompt_tokens_total += len(req.input_ids)
            self.prefill.waiting.append(req)

    def fail_request(self, request: GenerateRequest | Req, message: str, status: int) -> None:
        """Answer, with an error, a request the scheduler does not hold (Commit.fail)."""
        self.commit.fail(request, message, status)

    # ---- the PD roles' intake and handoff (workers/) ----
    def intake(self, request: GenerateRequest) -> Req | None:
        """A request whose prompt another worker prefills (PD decode): its Req, or None once
        it is refused (it can never run here: 400; no room to wait: 503)."""
        problem = self.admission_problem(request)
        if problem is not None:
            return self.fail_request(request, problem, 400)
        full = self.queue_full()
        if full is not None:
            return self.fail_request(request, full, 503)
        return Req.of(request, self.eos)

    def preallocate(self, reqs: list[Req]) -> int:
        """Admit requests from intake(), FIFO: each a row and the pages of its whole prompt,
        which another worker writes (admit's reserve policy holds); returns how many were (the
        first that does not fit now, and those behind it, take nothing). With a page cache, the
        prompt's cached whole pages are mapped (locked; req.decode_cached_tokens) and only the
        rest is new. Their row resets and page maps launch as one batch (admission.batched).
        The role holds them (RoleHooks.owned) until adopt() or free()."""
        done = 0
        with self.admission.batched():
            for req in reqs:
                n = len(req.input_ids)
                if (
                    self.admission.admit(req, n, len(self.running), prefilled_elsewhere=True)
                    is None
                ):
                    break
                done += 1
        return done

    def adopt(
        self,
        req: Req,
        first_token: int,
        logprobs: list[TokenLogprob] | None,
        cached_tokens: int,
        input_logprobs: list[TokenLogprob] | None,
    ) -> None:
        """Take a preallocated request whose prompt's KV is written, with what prefill sent
        beside it: the first token sampled there (and its logprobs), prefill's prefix-cache hit
        (for meta_info and usage) and the prompt's logprobs. It decodes from here on, like any
        running request."""
        req.cached, req.cached_tokens = len(req.input_ids), cached_tokens
        if req.return_logprob:  # prefill scored the prompt; a re-prefill scores nothing
            req.input_logprobs, req.input_scored = input_logprobs or [], len(req.input_ids)
        self.stats.prompt_tokens_total += len(req.input_ids)
        req.started()
        req.adopted = True
        req.stages["decode_queue_time"] = req.queue_time or 0.0
        self.commit.commit(req, [first_token], logprobs)
        if req.finish_reason is None:
            self.decode.running.append(req)

    def finish_scored(self, req: Req, input_logprobs: list[TokenLogprob] | None) -> None:
        """Answer a scoring-only request from intake() (max_new_tokens 0; no memory) with the
        prompt logprobs another worker scored, and no token."""
        req.input_logprobs, req.input_scored = input_logprobs or [], len(req.input_ids)
        self.commit.finish(req, FinishReason.length())

    def free(self, req: Req) -> None:
        """Free, unanswered, the memory a role holds for a request that never ran here (PD
        decode: a preallocation that failed, or whose quarantine ended)."""
        self.admission.release(req)

    def release_held(
        self,
        req: Req,
        error: str | None = None,
        status: int = 500,
        logprobs: list[TokenLogprob] | None = None,
    ) -> None:
        """The role is done with a finished request it held (RoleHooks.finished): release it
        as finish() would have, its last output its last token again (logprobs: that token's),
        or the error."""
        if error is not None:
            req.finish_reason = FinishReason.abort(error, status)
            return self.commit.release(req, [])
        self.commit.release(req, req.output_ids[-1:], logprobs)

    @property
    def queued(self) -> int:
        return self.prefill.queued + self.hooks.queued

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
                self.commit.finish(req, FinishReason.abort(reason, status))
                return

    def _live(self) -> list[Req]:
        prefilling = self.prefill.prefilling
        return list(self.prefill.waiting) + self.running + ([prefilling] if prefilling else [])

    def _unqueue(self, req: Req) -> None:
        if req in self.running:
            self.running.remove(req)
            self.prefill.hold_admission = False
        self.prefill.remove(req)

    @property
    def has_work(self) -> bool:
        return bool(self.prefill.queued or self.running or self.inflight)

    @property
    def pending_outputs(self) -> bool:
        return bool(self.commit.outputs)

    # ---- one forward ----
    def step(self) -> list[SequenceOutput]:
        """Launch the next step, then process the one in flight (overlap), or both in order."""
        running = len(self.running)
        launched, batch = self._launch()
        self._drain()
        if launched is not None and launched.sync:
            self._process(launched)
        else:
            self.inflight = launched
        self.refresh_stats()
        # a line describes the batch launched now; its token counts and throughput count
        # committed tokens (under overlap a batch's tokens are committed one step later)
        if isinstance(batch, PrefillBatch):
            self.batch_log.prefill(batch.plan, running, len(self.prefill.waiting))
        elif batch is not None and batch.reqs:
            self.batch_log.decode(len(batch.reqs), len(self.prefill.waiting))
        if CHECK_INVARIANTS:
            self.check_invariants()
        out, self.commit.outputs = self.commit.outputs, []
        self.batch_log.finished(out)
        return out

    def _launch(self) -> tuple[Launched | None, PrefillBatch | DecodeBatch | None]:
        """The step launched (None: nothing to run) and the batch it runs."""
        batch = self.prefill.schedule(len(self.running))
        if batch is not None:
            # a drain here commits nothing of the batch: its requests are new or mid-prompt
            sync = self.spec is not None or self._sync([req for req, _ in batch.plan])
            if sync:
                self._drain()
            launched = self.prefill.launch(batch, sync)
            self.running.extend(launched.started)
            return launched, batch
        if not self.running:
            return None, None
        sync = self._sync(self.running) or (
            self.spec is not None and not self.decode.spec_overlaps(self.running)
        )
        if sync:
            self._drain()
        step = self.decode.schedule(retract=self.inflight is None)
        if step is None:  # out of pages: retract only once the step in flight is done
            self._drain()
            step = self.decode.schedule()
        for victim in step.retracted:
            self.prefill.requeue(victim)
        return (self.decode.launch(step, sync) if step.reqs else None), step

    def _sync(self, reqs: list[Req]) -> bool:
        """Whether the next step over reqs must not overlap the one in flight."""
        return not self.cfg.overlap or any(
            r.return_logprob or not overlap_safe(r.sampling) for r in reqs
        )

    def _drain(self) -> None:
        if self.inflight is not None:
            launched, self.inflight = self.inflight, None
            self._process(launched)

    def _process(self, launched: Launched) -> None:
        if launched.event is not None:
            started = time.perf_counter()
            launched.event.synchronize()  # the device finished the step
            launched.waited = time.perf_counter() - started
        manager = self.prefill if launched.kind == "prefill" else self.decode
        manager.process(launched)
        self.admission.settle()

    # ---- the prefix cache ----
    def flush_cache(self) -> str | None:
        """Empty the prefix cache; refused (the reason) while any request is live, as SGLang
        does (a live request locks its cached prefix)."""
        if self.has_work or self.hooks.queued or self.hooks.owned():
            return "requests are running or waiting; the cache was not flushed"
        self.admission.flush()
        self.refresh_stats()
        return None

    # ---- observability ----
    def refresh_stats(self) -> None:
        s = self.stats
        s.running = len(self.running)
        s.queued = self.queued
        s.used_rows = self.pool.rows.num_used
        s.peak_used_rows = max(s.peak_used_rows, max(self.pool.rows.used, default=0))
        # pages the cache holds and no request locks are free to take: not "used"
        evictable = self.cache.evictable_pages if self.cache is not None else 0
        s.used_pages = self.pool.pages.num_used - evictable
        s.cached_pages = self.cache.pages_held if self.cache is not None else 0
        s.cached_states = self.cache.states_held if self.cache is not None else 0
        if (images := self.prefill.images) is not None:
            s.images_encoded_total = images.encoded_images
            s.image_embeddings_held = len(images.held)
        self.hooks.report(s)

    def check_invariants(self) -> None:
        live = self._live()
        holders = live + self.hooks.owned() + self.admission.deferred
        owners = {r.rid: (r.row, self.admission.owned_pages(r)) for r in holders}
        slots = {r.rid: [r.track_slot] for r in holders if r.track_slot is not None}
        if self.cache is not None:
            pages, states = self.cache.owned()
            owners["prefix cache"] = (None, pages)
            slots["prefix cache"] = states
        self.pool.check(owners, slots)
        for r in live:
            assert r.finish_reason is None, f"{r.rid} finished but still queued"
        if self.prefill.images is not None:
            leaked = [r.rid for r in self.prefill.images.held if r not in live]
            assert not leaked, f"image embeddings held for requests that ended: {leaked}"
