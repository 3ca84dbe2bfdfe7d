"""Workers as the router sees them: address, role, health, load; and the registry of them all.

Health is a small state machine per worker, fed by the health checker's probes and by the
requests themselves:

    not yet seen --first good probe--> healthy --failure_threshold bad probes in a row--> down
                                       healthy --a request or probe is refused--------> down
                                       healthy --a request is cut mid-answer----------> down
                                       down --success_threshold good probes in a row--> healthy

Only healthy workers are offered to the policies. The registry keeps the healthy list of each
role ready, rebuilt on every change, so picking a worker never filters.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

from router.config import RouterConfig, check_url
from router.upstream import Aborted, ConnectError, Disconnected, Pool, Response

log = logging.getLogger(__name__)

ROLES = ("prefill", "decode", "regular")


@dataclass(eq=False)
class Worker:
    url: str
    role: str  # prefill | decode | regular
    bootstrap_port: int | None = None  # prefill only; None: the worker uses its own
    host: str = field(init=False)
    port: int = field(init=False)
    pool: Pool = field(init=False, repr=False)
    healthy: bool = False
    ever_healthy: bool = False
    good_probes: int = 0  # consecutive
    bad_probes: int = 0  # consecutive
    last_error: str = "not probed yet"
    in_flight: int = 0  # requests started and not finished, as the router counts them
    requests: int = 0  # requests sent, in all
    failures: int = 0  # requests that ended in a connect error, a disconnect or a 5xx
    probes_ok: int = 0  # health probes, in all
    probes_failed: int = 0
    on_change: Callable[[Worker], None] = field(default=lambda w: None, repr=False)
    on_suspect: Callable[[Worker], None] = field(default=lambda w: None, repr=False)

    def __post_init__(self) -> None:
        self.host, self.port = check_url(self.url)
        self.pool = Pool(self.host, self.port, self.url)

    def probe_result(self, ok: bool, error: str, failure_threshold: int, success_threshold: int):
        """Feed one health probe's outcome into the state machine. (A probe refused outright
        takes the worker out at once: health.py calls mark_down for it.)"""
        if ok:
            self.probes_ok += 1
            self.last_error = ""
            self.bad_probes = 0
            self.good_probes += 1
            if not self.healthy and (
                not self.ever_healthy or self.good_probes >= success_threshold
            ):
                self._set(True, "")
        else:
            self.probes_failed += 1
            self.good_probes = 0
            self.bad_probes += 1
            self.last_error = error
            if self.healthy and self.bad_probes >= failure_threshold:
                self._set(False, error)

    def mark_down(self, error: str) -> None:
        """A request could not connect or was cut: out of rotation now, not after probes."""
        self.good_probes = 0
        self.last_error = error
        if self.healthy:
            self._set(False, error)

    def start(self, method: bytes, path: bytes, body: bytes, headers: bytes, timeout: float):
        """Send a request to this worker, counted in its load until the response ends."""
        self.in_flight += 1
        self.requests += 1
        resp = self.pool.request(method, path, body, headers, timeout)
        resp.add_done_callback(self._ended)
        return resp

    def _ended(self, resp: Response) -> None:
        self.in_flight -= 1
        error = resp.error
        if error is None:
            self.failures += resp.status >= 500
        elif getattr(error, "origin", None) == self.url:  # not the other side's, passed on
            self.failures += not isinstance(error, Aborted)
            if isinstance(error, ConnectError) or (
                isinstance(error, Disconnected) and resp.status != 0
            ):
                # refused, or cut after its answer began (a killed worker): out of rotation
                # now, and probed at once
                self.mark_down(str(error))
            elif isinstance(error, Disconnected):
                # closed before any answer: a killed worker, or only a stale keep-alive
                # connection; a probe at once tells (refused: down)
                self.on_suspect(self)

    def _set(self, healthy: bool, error: str) -> None:
        self.healthy = healthy
        if healthy:
            self.ever_healthy = True
            log.info("%s worker %s is healthy", self.role, self.url)
        else:
            log.warning("%s worker %s left rotation: %s", self.role, self.url, error)
        self.on_change(self)


class WorkerRegistry:
    def __init__(self, workers: list[Worker]) -> None:
        self.workers = workers
        self.by_role: dict[str, list[Worker]] = {r: [] for r in ROLES}
        for w in workers:
            self.by_role[w.role].append(w)
            w.on_change = self._changed
        self.healthy: dict[str, list[Worker]] = {r: [] for r in ROLES}
        self.by_url = {w.url: w for w in workers}
        self.listeners: list[Callable[[Worker], None]] = []  # told of every health change

    @classmethod
    def from_config(cls, config: RouterConfig) -> WorkerRegistry:
        workers = [Worker(url, "prefill", port) for url, port in config.prefill]
        workers += [Worker(url, "decode") for url in config.decode]
        workers += [Worker(url, "regular") for url in config.worker_urls]
        for w in workers:
            w.pool.set_auth(config.auth_header)
        return cls(workers)

    def unavailable(self, role: str) -> str:
        """Why no worker of `role` can take a request, for the client's 503."""
        workers = self.by_role[role]
        label = "" if role == "regular" else f"{role} "
        reasons = "; ".join(f"{w.url}: {w.last_error}" for w in workers)
        return f"no healthy {label}workers ({len(workers)} configured, 0 healthy): {reasons}"

    def close(self) -> None:
        for w in self.workers:
            w.pool.close()

    def _changed(self, worker: Worker) -> None:
        role = worker.role
        self.healthy[role] = [w for w in self.by_role[role] if w.healthy]
        for fn in self.listeners:
            fn(worker)
