"""The prefill half of the engine: it owns the queue of requests that have not started (FIFO) and
the one request part-way through chunked prefill.

schedule(): continue the chunk-prefilling request, then admit waiting requests FIFO (a cached
prefix first: admission.admit) while rows, pages (one per running request kept in reserve), the
token budget and max_running_requests allow; pick each chunk's snapshot points for the prefix
cache. launch(): one forward over the plan (the KDA layers snapshot inside it), score prompt
logprobs, draw a first token for the requests whose prompt is complete, let the draft catch up
over the chunk, give the cache the chunks' KV and snapshots. process() (after the step
completed; under the overlap scheduler after the next step was launched): the role hooks, then
commit the tokens.

Order (hazard): the draft's KV of a chunk and the chunk's insertion into the cache come before
commit, because commit may finish a request and release it; a cached page must never miss its
draft KV. The cache may hold a chunk before the device computed it: every reader of the cache
runs on the device after it, in stream order.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

import torch

from serving.engine.admission import Admission
from serving.engine.commit import Commit, Launched
from serving.engine.image_prefill import ImagePrefill
from serving.engine.request import Req, RoleHooks, SchedulerConfig
from serving.engine.step_phases import StepPhases, forward_watch, timed
from serving.executor.model_runner import ImageRun, ModelRunner, StepInput, image_rows
from serving.executor.sampler import score_tokens
from serving.forward_batch import to_device, upload
from serving.protocol import FinishReason
from serving.speculative.eagle import Eagle


@dataclass
class PrefillBatch:
    plan: list[tuple[Req, int]]  # (request, tokens of this chunk)
    saves: list[list[tuple[int, int]]]  # per request: (tokens into the chunk, state slot)
    phases: StepPhases | None = None  # recorded while PrefillManager.phases is a list


class PrefillManager:
    def __init__(
        self,
        cfg: SchedulerConfig,
        runner: ModelRunner,
        admission: Admission,
        commit: Commit,
        hooks: RoleHooks,
        spec: Eagle | None,
    ) -> None:
        self.cfg, self.runner, self.admission, self.commit = cfg, runner, admission, commit
        self.hooks, self.spec = hooks, spec
        lookahead = int(spec is not None)  # the draft reads each position's next embedding
        self.images = (
            None
            if runner.vision is None
            else ImagePrefill(runner.vision, lookahead, runner.vision_graphs)
        )
        self.waiting: deque[Req] = deque()
        self.prefilling: Req | None = None  # the one request part-way through chunked prefill
        # After a retraction, admit nothing new until a running request finishes: re-admitting
        # at once would only retract again (thrash).
        self.hold_admission = False
        # Each prefill step's StepPhases, appended once processed (the prefix-cache bench sets
        # a list and empties it); None: nothing recorded.
        self.phases: list[StepPhases] | None = None

    @property
    def queued(self) -> int:
        return len(self.waiting) + int(self.prefilling is not None)

    def requeue(self, req: Req) -> None:
        """A retracted request: first in line, recomputed from its tokens so far."""
        self.waiting.appendleft(req)
        self.hold_admission = True

    def remove(self, req: Req) -> None:
        if req in self.waiting:
            self.waiting.remove(req)
        if self.prefilling is req:
            self.prefilling = None
        if self.images is not None:
            self.images.free(req)

    def schedule(self, running: int) -> PrefillBatch | None:
        """The next prefill batch, its memory allocated; None when nothing fits (`running`:
        requests decoding now)."""
        record = StepPhases() if self.phases is not None else None
        continuing, matched = self.prefilling, self.admission.match_s
        started = time.perf_counter()
        with self.admission.batched():  # one batch of device work for every admission
            plan = self._plan(running)
            if not plan:
                return None
            planned = time.perf_counter()
            saves = [self.admission.plan_save(req, n) for req, n in plan]
            saved = time.perf_counter()
        if record is not None:
            match = self.admission.match_s - matched
            record.add("match", match)
            record.add("admit", planned - started - match)
            record.add("plan_save", saved - planned)
            record.add("pool_apply", time.perf_counter() - saved)
            admitted = [req for req, _ in plan if req is not continuing]
            record.rids = [req.rid for req in admitted]
            record.hits = sum(1 for req in admitted if req.cached)
            record.cached_tokens = sum(req.cached for req in admitted)
            record.new_tokens = sum(n for _, n in plan)
        return PrefillBatch(plan, saves, record)

    def _plan(self, running: int) -> list[tuple[Req, int]]:
        """The chunk-prefilling request's next chunk, then waiting requests FIFO, admitted."""
        plan: list[tuple[Req, int]] = []
        budget = self.cfg.max_prefill_tokens
        if self.prefilling is not None:
            req = self.prefilling
            n = min(req.uncached, self.cfg.chunked_prefill_size, budget)
            if not self.admission.grow(req, req.cached + n):
                return []  # decode frees pages as requests finish
            plan.append((req, n))
            budget -= n
        while (
            self.waiting
            and not self.hold_admission
            and budget > 0
            and self.prefilling is None
            and running + len(plan) < self.cfg.max_running_requests
        ):
            req = self.waiting[0]
            # the requests planned so far decode beside it too (admit's reserve policy)
            n = self.admission.admit(
                req, min(self.cfg.chunked_prefill_size, budget), running + len(plan)
            )
            if n is None:
                break
            self.waiting.popleft()
            req.started()
            plan.append((req, n))
            budget -= n
            if n < req.uncached:
                self.prefilling = req
        return plan

    def launch(self, batch: PrefillBatch, sync: bool) -> Launched:
        """One forward over the batch, the first tokens drawn (on the device unless `sync`:
        the scheduler decides), the draft extended and the chunks cached; Launched.started
        are the requests that start decoding (their first token may still be pending)."""
        record, launch_start = batch.phases, time.perf_counter()
        plan = batch.plan
        targets = [req.prompt_targets(n) for req, n in plan]
        every = [bool(t) for t in targets]  # all of a chunk's logits, to score its prompt
        forward_start = time.perf_counter()
        runs = self.images.runs(plan) if self.images is not None else []
        with forward_watch(record, self.runner.pool.req_to_token.device):
            out = self.runner.forward(
                [
                    StepInput(
                        req.row, req.cached, req.fill_ids[req.cached : req.cached + n], tuple(save)
                    )
                    for (req, n), save in zip(plan, batch.saves)
                ],
                every if any(every) else "last",
                image_rows([n for _, n in plan], runs, self.runner.model.dtype),
            )
        forward_s = time.perf_counter() - forward_start
        last_row = self._score_prompts(plan, targets, out.logits)
        for req, n in plan:
            req.cached += n
            req.in_flight += 1
            if req.uncached == 0 and self.prefilling is req:
                self.prefilling = None
        # max_tokens 0 with prompt logprobs: scored, nothing to sample (on a PD prefill worker
        # the scores then go to decode without a KV handoff)
        done = [
            i
            for i, (req, _) in enumerate(plan)
            if req.uncached == 0 and req.sampling.params.max_new_tokens > 0
        ]
        started = [plan[i][0] for i in done]
        last = to_device([last_row[i] for i in done], torch.int64, out.logits.device)
        sampled = self.commit.draw_step(started, out.logits[last], sync)
        # the sampled token, by plan index, when on the host (always with a draft: EAGLE's
        # steps are sync)
        first = {i: tok for i, (tok, _) in zip(done, sampled.host or [])}
        if self.spec is not None:
            self._extend_draft(plan, out.hidden, first)
        if self.images is not None:  # after the draft's extend: it reads one row further
            self.images.launched(plan)
        for i, ((req, n), saves) in enumerate(zip(plan, batch.saves)):
            # the cache keys reach the first token only with a draft (pair keys), so the
            # pending first token is never needed here
            tokens = req.fill_ids + ([first[i]] if i in first else [])
            for at, slot in saves:
                self.admission.insert(req, req.cached - n + at, slot, tokens)
        if sampled.device is not None:
            self.runner.publish([r.row for r in started], sampled.device.device)
            for req in started:
                req.pending += 1
        reqs = [req for req, _ in plan]
        ends = [r.cached for r in reqs]
        launched = Launched("prefill", reqs, sampled, sync, self.runner.mark_step(), ends, started)
        if record is not None:
            record.launched_at = time.perf_counter()
            record.add("launch_rest", record.launched_at - launch_start - forward_s)
            launched.phases = record
        return launched

    def process(self, launched: Launched) -> None:
        """After the step completed: tell the role each chunk's KV is there, then commit the
        first tokens. A request finished (aborted) since the launch gets neither."""
        record: StepPhases | None = launched.phases
        if record is not None:
            record.settle(time.perf_counter(), launched.waited)
        with timed(record, "process"):
            self._process(launched)
        if record is not None and self.phases is not None:
            self.phases.append(record)

    def _process(self, launched: Launched) -> None:
        for req in launched.reqs:
            req.in_flight -= 1
        for req, end in zip(launched.reqs, launched.ends):
            if req.finish_reason is not None:
                continue
            self.hooks.chunk_prefilled(req, end)
            if end == len(req.input_ids) and req.sampling.params.max_new_tokens == 0:
                self.commit.finish(req, FinishReason.length())
        self.commit.commit_sampled(launched.sampled)

    def _score_prompts(
        self, plan: list[tuple[Req, int]], targets: list[range], logits: torch.Tensor
    ) -> list[int]:
        """Score the prompt tokens each chunk's logits predict; returns each request's logits
        row of its last token (a request with targets got a row per chunk token, the others
        one row)."""
        first_row, last_row = 0, []
        vocab = self.commit.sampler.vocab_size
        for (req, n), wanted in zip(plan, targets):
            if wanted:
                rows = [first_row + t - 1 - req.cached for t in wanted]
                ids = [req.input_ids[t] for t in wanted]
                req.input_logprobs += score_tokens(logits[rows, :vocab], ids, req.top_logprobs_num)
                req.input_scored = wanted.stop
            first_row += n if wanted else 1
            last_row.append(first_row - 1)
        return last_row

    def _extend_draft(
        self, plan: list[tuple[Req, int]], hidden: torch.Tensor, first: dict[int, int]
    ) -> None:
        """Run the draft over the chunk just prefilled, at every position whose next token is
        known now: the prompt's, or for the last chunk the token just sampled (`first`, by plan
        index; a request that samples nothing has no next token at its last position). A next
        token in an image's run enters as that image's row (nextn.py)."""
        rows, starts, tokens, index, offset = [], [], [], [], 0
        runs: list[ImageRun] = []
        for i, (req, n) in enumerate(plan):
            start = req.cached - n
            nxt = (req.fill_ids + ([first[i]] if i in first else []))[start + 1 : req.cached + 1]
            if nxt:
                if self.images is not None:
                    end = start + 1 + len(nxt)
                    runs += self.images.rows(len(rows), req, start + 1, end)
                rows.append(req.row)
                starts.append(start)
                tokens.append(nxt)
                index.append(torch.arange(offset, offset + len(nxt)))
            offset += n
        if rows:
            self.spec.extend_draft(
                rows,
                starts,
                tokens,
                hidden[upload(torch.cat(index), hidden.device)],
                image_rows([len(t) for t in tokens], runs, self.runner.model.dtype),
            )
