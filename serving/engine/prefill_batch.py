"""The prefill half of a scheduler step: continue the request being chunk-prefilled, admit
waiting requests FIFO while rows, pages (one per running request kept in reserve), the token
budget and max_running_requests allow, run one forward, sample the requests whose prompt is
complete, and let the draft catch up over the chunk."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from serving.engine.request import Req
from serving.executor.model_runner import StepInput

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
    out = s.runner.forward(
        [
            StepInput(req.row, req.cached, req.fill_ids[req.cached : req.cached + n])
            for req, n in plan
        ]
    )
    done: list[tuple[Req, int]] = []
    for i, (req, n) in enumerate(plan):
        req.cached += n
        s.role.chunk_prefilled(req)
        if req.uncached == 0:
            done.append((req, i))
            if s.prefilling is req:
                s.prefilling = None
    if done:
        s.sample_and_advance([r for r, _ in done], out.logits[[i for _, i in done]])
        s.running.extend(r for r, _ in done if r.finish_reason is None)
    if s.spec is not None:
        _extend_draft(s, plan, out.hidden)
    return True


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
