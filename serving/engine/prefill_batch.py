"""The prefill half of a scheduler step: continue the request being chunk-prefilled, admit
waiting requests FIFO while rows, pages (one per running request kept in reserve), the token
budget and max_running_requests allow, run one forward, sample the requests whose prompt is
complete, and let the draft catch up over the chunk."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from serving.engine.request import Req
from serving.executor.model_runner import StepInput
from serving.executor.sampler import score_tokens
from serving.protocol import FinishReason

if TYPE_CHECKING:
    from serving.engine.scheduler import Scheduler


def run_prefill(s: Scheduler) -> bool:
    plan: list[tuple[Req, int]] = []
    budget = s.cfg.max_prefill_tokens
    if s.prefilling is not None:
        req = s.prefilling
        n = min(req.uncached, s.cfg.chunked_prefill_size, budget)
        if not s.pool.grow(req.row, req.pages, req.cached + n):
            return False  # decode frees pages as requests finish
        plan.append((req, n))
        budget -= n
    while (
        s.waiting
        and not s.hold_admission
        and budget > 0
        and s.prefilling is None
        and len(s.running) + len(plan) < s.cfg.max_running_requests
    ):
        req = s.waiting[0]
        n = min(req.uncached, s.cfg.chunked_prefill_size, budget)
        # keep one page per running request in reserve for its next decode tokens
        reserve = len(s.running) + len(plan)
        if s.pool.pages.num_free - s.pool.pages.pages_for(n + 1) < reserve:
            break
        row = s.pool.alloc_row()
        if row is None:
            break
        req.row = row
        if not s.pool.grow(row, req.pages, n):
            s.pool.free_row(row)
            req.row = None
            break
        s.waiting.popleft()
        plan.append((req, n))
        budget -= n
        if n < req.uncached:
            s.prefilling = req
    if not plan:
        return False
    targets = [req.prompt_targets(n) for req, n in plan]
    every = [bool(t) for t in targets]  # all of a chunk's logits, to score its prompt
    out = s.runner.forward(
        [
            StepInput(req.row, req.cached, req.fill_ids[req.cached : req.cached + n])
            for req, n in plan
        ],
        every if any(every) else "last",
    )
    last_row = _score_prompts(s, plan, targets, out.logits)
    done: list[tuple[Req, int]] = []
    for i, (req, n) in enumerate(plan):
        req.cached += n
        s.role.chunk_prefilled(req)
        if req.uncached == 0:
            done.append((req, i))
            if s.prefilling is req:
                s.prefilling = None
    # max_tokens 0 with prompt logprobs: scored, nothing to sample (on a PD prefill worker the
    # scores then go to decode without a KV handoff)
    for req, _ in done:
        if req.sampling.params.max_new_tokens == 0:
            s.finish(req, FinishReason.length())
    done = [(r, i) for r, i in done if r.finish_reason is None]
    if done:
        rows = [last_row[i] for _, i in done]
        s.sample_and_advance([r for r, _ in done], out.logits[rows])
        s.running.extend(r for r, _ in done if r.finish_reason is None)
    if s.spec is not None:
        _extend_draft(s, plan, out.hidden)
    return True


def _score_prompts(
    s: Scheduler, plan: list[tuple[Req, int]], targets: list[range], logits: torch.Tensor
) -> list[int]:
    """Score the prompt tokens each chunk's logits predict; returns each request's logits row of
    its last token (a request with targets got a row per chunk token, the others one row)."""
    first_row, last_row = 0, []
    for (req, n), wanted in zip(plan, targets):
        if wanted:
            rows = [first_row + t - 1 - req.cached for t in wanted]
            ids = [req.input_ids[t] for t in wanted]
            chunk = logits[rows, : s.sampler.vocab_size]
            req.input_logprobs += score_tokens(chunk, ids, req.top_logprobs_num)
            req.input_scored = wanted.stop
        first_row += n if wanted else 1
        last_row.append(first_row - 1)
    return last_row


def _extend_draft(s: Scheduler, plan: list[tuple[Req, int]], hidden: torch.Tensor) -> None:
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
    s.spec.extend_draft([r.row for r in reqs], starts, tokens, hidden[index.to(hidden.device)])
