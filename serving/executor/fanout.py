"""The fanout: how the other ranks of a TP/EP worker run what rank 0 runs.

Every forward and every EAGLE program runs on every rank, but only rank 0 schedules and samples:
before each it hands its fanout what the followers need to run the same (the host inputs; the
device inputs follow as tensor broadcasts). The PD roles and the profiler ask the followers
through it too, and get their answers. Fanout is the fanout of a worker that is one rank (or a
simulated rank): nothing follows, every point does nothing and an ask has no answers.
RankFanout (serving/engine/tp_worker.py) broadcasts to the followers. ModelRunner, Eagle,
ProfileControl and the PD roles are given theirs at construction (rank 0's by build_engine;
followers and tools keep the default, ONE_RANK).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # no torch at run time: the launcher's process imports this (no torch there)
    import torch


class Fanout:
    followers = 0  # rank processes that run what this one runs

    def forward(self, items: list, logits: str | list[bool], images=None) -> None:
        """Before ModelRunner.forward(items, logits, images) (items: its StepInputs; images:
        its ImageRows or None)."""

    def publish(self, rows: list[int], tokens: torch.Tensor) -> None:
        """Before ModelRunner.publish: the followers get the tokens too."""

    def extend_draft(
        self,
        rows: list[int],
        starts: list[int],
        next_tokens: list[list[int]],
        hidden: torch.Tensor,
        images=None,
    ) -> None:
        """Before Eagle.extend_draft: its host inputs, then the target hiddens (and the image
        rows: ImageRows or None)."""

    def verify(self, host: torch.Tensor) -> None:
        """Before Eagle.verify(host) of a step that accepts on the host."""

    def roll_back(
        self, padded: list[list[int]], last: list[int], captures: list[tuple[int, int, int]]
    ) -> None:
        """Before Eagle.roll_back of that step: the committed tokens and snapshots."""

    def ask_role(self, orders: object) -> list:
        """The followers' PD role plugs' answers to `orders`, ranks 1..N-1 in order."""
        return []

    def ask_profilers(self, order: tuple) -> list:
        """The followers' RankProfiler answers to a /start_profile or /stop_profile order."""
        return []

    def keepalive(self) -> None:
        """Rank 0 idles: keep the followers' wait for the next step short of the timeout."""

    def stop(self) -> None:
        """The worker shuts down: the followers leave their loop."""


ONE_RANK = Fanout()
