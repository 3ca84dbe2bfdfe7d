"""The prefill half of the engine: it owns the queue of requests that have not started (FIFO) and
the one request part-way through chunked prefill.

schedule(): continue the chunk-prefilling request, then admit waiting requests FIFO while rows,
pages (one per running request kept in reserve), the token budget and max_running_requests
allow. run(): one forward over the plan, score prompt logprobs, commit a first token for the
requests whose prompt is complete, and let the draft catch up over the chunk.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import torch

from serving.engine.admission import Admission
from serving.engine.commit import Commit
from serving.engine.request import Req, RoleHooks, SchedulerConfig
from serving.executor.model_runner import ModelRunner, StepInput
from serving.executor.sampler import score_tokens
from serving.protocol import FinishReason
from serving.speculative.eagle import Eagle


@dataclass
class PrefillBatch:
    plan: list[tuple[Req, int]]  # (request, tokens of this chunk)


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
        self.waiting: deque[Req] = deque()
        self.prefilling: Req | None = None  # the one request part-way through chunked prefill
        # After a retraction, admit nothing new until a running request finishes: re-admitting
        # at once would only retract again (thrash).
        self.hold_admission = False

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

    def schedule(self, running: int) -> PrefillBatch | None:
        """The next prefill batch, its memory allocated; None when nothing fits (`running`:
        requests decoding now)."""
        plan: list[tuple[Req, int]] = []
        budget = self.cfg.max_prefill_tokens
        if self.prefilling is not None:
            req = self.prefilling
            n = min(req.uncached, self.cfg.chunked_prefill_size, budget)
            if not self.admission.grow(req, req.cached + n):
                return None  # decode frees pages as requests finish
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
            # keep one page per running request in reserve for its next decode tokens
            reserve = running + len(plan)
            n = self.admission.admit(req, min(self.cfg.chunked_prefill_size, budget), reserve)
            if n is None:
                break
            self.waiting.popleft()
            req.started()
            plan.append((req, n))
            budget -= n
            if n < req.uncached:
                self.prefilling = req
        return PrefillBatch(plan) if plan else None

    def run(self, batch: PrefillBatch) -> list[Req]:
        """One forward over the batch; returns the requests that start decoding."""
        plan = batch.plan
        targets = [req.prompt_targets(n) for req, n in plan]
        every = [bool(t) for t in targets]  # all of a chunk's logits, to score its prompt
        out = self.runner.forward(
            [
                StepInput(req.row, req.cached, req.fill_ids[req.cached : req.cached + n])
                for req, n in plan
            ],
            every if any(every) else "last",
        )
        last_row = self._score_prompts(plan, targets, out.logits)
        done: list[tuple[Req, int]] = []
        for i, (req, n) in enumerate(plan):
            req.cached += n
            self.hooks.chunk_prefilled(req)
            if req.uncached == 0:
                done.append((req, i))
                if self.prefilling is req:
                    self.prefilling = None
        # max_tokens 0 with prompt logprobs: scored, nothing to sample (on a PD prefill worker
        # the scores then go to decode without a KV handoff)
        for req, _ in done:
            if req.sampling.params.max_new_tokens == 0:
                self.commit.finish(req, FinishReason.length())
        done = [(r, i) for r, i in done if r.finish_reason is None]
        started: list[Req] = []
        if done:
            rows = [last_row[i] for _, i in done]
            self.commit.sample([r for r, _ in done], out.logits[rows])
            started = [r for r, _ in done if r.finish_reason is None]
        if self.spec is not None:
            self._extend_draft(plan, out.hidden)
        return started

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
