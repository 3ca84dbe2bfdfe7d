"""Periodic health probes: GET --health-check-endpoint on every worker, one loop per worker.

A healthy worker is probed every --health-check-interval-secs. A worker that is not healthy
(not up yet, or taken out) is probed every min(interval, RECOVERY_PROBE_S), so a router started
before its workers admits them as soon as they answer, and a restarted worker rejoins after
--health-success-threshold quick probes rather than after minutes. A worker taken out by a
failed request (Worker.mark_down) is probed at once, and so is one whose connection closed
before it answered (Worker.on_suspect). A probe that cannot connect takes a worker out at once.
"""

from __future__ import annotations

import asyncio
import contextlib

from router.config import RouterConfig
from router.upstream import ConnectError, UpstreamError
from router.workers import Worker, WorkerRegistry

RECOVERY_PROBE_S = 1.0


class HealthChecker:
    def __init__(self, config: RouterConfig, registry: WorkerRegistry) -> None:
        self.config = config
        self.registry = registry
        self._wake = {w: asyncio.Event() for w in registry.workers}
        self._tasks: list[asyncio.Task[None]] = []

    def start(self) -> None:
        self.registry.listeners.append(self._on_change)
        for w in self.registry.workers:
            w.on_suspect = lambda w: self._wake[w].set()
            self._tasks.append(asyncio.create_task(self._loop(w), name=f"health {w.url}"))

    async def stop(self) -> None:
        if self._on_change in self.registry.listeners:
            self.registry.listeners.remove(self._on_change)
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks.clear()

    async def probe(self, worker: Worker) -> None:
        """One probe, fed into the worker's state machine."""
        c = self.config
        try:
            status, body = await worker.pool.get(
                c.health_check_endpoint, c.health_check_timeout_secs
            )
            ok, error = 200 <= status < 300, f"health check answered {status}"
        except UpstreamError as e:
            ok, error = False, str(e).removeprefix(worker.url + ": ")
            if isinstance(e, ConnectError):  # nothing listens there: no threshold to wait for
                worker.mark_down(error)
        worker.probe_result(ok, error, c.health_failure_threshold, c.health_success_threshold)

    async def _loop(self, worker: Worker) -> None:
        interval = self.config.health_check_interval_secs
        wake = self._wake[worker]
        while True:
            await self.probe(worker)
            wait = interval if worker.healthy else min(interval, RECOVERY_PROBE_S)
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(wake.wait(), wait)
            wake.clear()

    def _on_change(self, worker: Worker) -> None:
        if not worker.healthy:
            self._wake[worker].set()
