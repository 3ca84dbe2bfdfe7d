"""The Role plug: what differs by worker role (plain, PD prefill, PD decode) around the engine.

The plain worker uses Role as is; workers/prefill.py and workers/decode.py override intake
(submit, abort), the per-iteration poll, and the hooks of RoleHooks (serving/engine/request.py)
that the engine calls. A role reaches the engine only through these Scheduler verbs:
- every role: add, fail_request, abort; the plain one: queue_full;
- PD prefill: release_held (a request it held for its transfer), inflight (a step in flight);
- PD decode: intake, preallocate, then adopt (or finish_scored) once the KV landed, or free;
  free_running_slots.
The PD roles are also given the pool and the rank fanout (attach).
"""

from __future__ import annotations

from serving.engine.request import RoleHooks
from serving.engine.scheduler import Scheduler
from serving.executor.fanout import Fanout
from serving.memory.pool import MemoryPool
from serving.protocol import GenerateRequest


class Role(RoleHooks):
    scheduler: Scheduler

    def attach(self, scheduler: Scheduler, pool: MemoryPool, fanout: Fanout) -> None:
        """Plugged into `scheduler` (build_engine); a PD role also takes the pool (its buffers
        are what a handoff moves) and this rank's fanout (its followers' transfers)."""
        self.scheduler = scheduler

    def submit(self, request: GenerateRequest) -> None:
        full = self.scheduler.queue_full()
        if full is not None:
            return self.scheduler.fail_request(request, full, 503)
        self.scheduler.add(request)

    def abort(self, rid: str, reason: str) -> None:
        self.scheduler.abort(rid, reason)

    def poll(self) -> None:
        """Called before every step: advance the role's own queues."""

    @property
    def busy(self) -> bool:
        """Work outside the scheduler's queues (transfers in flight)."""
        return False

    def sockets(self) -> list:
        """ZMQ sockets the process loop should wake up for."""
        return []
