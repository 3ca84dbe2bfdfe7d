"""Decode's lookup of prefill ranks: a thread that asks prefill's bootstrap server (GET /route)
which scheduler rank serves a bootstrap address, and heartbeats (GET /health) the ones in use.

DecodeRole queues addresses on `lookups` and drains `events`, each (kind, addr, payload):
"found" (the cluster info with the rank's control address under "rank"), "unreachable" (why) or
"dead" (a watched prefill missed heartbeat_max_failures heartbeats in a row). Only this thread
does HTTP, so the scheduler loop never waits on a prefill.
"""

from __future__ import annotations

import queue
import threading
import time

import httpx

from workers.bootstrap_server import QUERY
from workers.timeouts import Timeouts

LOOKUP_ATTEMPTS = 3  # of a bootstrap lookup that times out (the client's timeout: 2 s each)


class PrefillDirectory(threading.Thread):
    """Looks prefill ranks up on their bootstrap servers and heartbeats those in use.

    Hazard: this thread must outlive any answer a dying prefill gives (refused, reset, a body
    cut short): if it died, decode would never again find a prefill rank and every new room
    would wait out prefill's bootstrap timeout. Every transport failure is an httpx.HTTPError,
    counted as unreachable; a malformed answer is unreachable too."""

    def __init__(self, timeouts: Timeouts, api_key: str | None) -> None:
        super().__init__(daemon=True, name="prefill-directory")
        self.timeouts = timeouts
        headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
        self.client = httpx.Client(headers=headers, timeout=2.0)
        self.lookups: queue.Queue[str] = queue.Queue()
        self.events: queue.Queue[tuple[str, str, object]] = queue.Queue()
        self.watched: set[str] = set()
        self._misses: dict[str, int] = {}

    def run(self) -> None:
        next_beat = time.monotonic() + self.timeouts.heartbeat_interval
        while True:
            try:
                addr = self.lookups.get(timeout=max(0.0, next_beat - time.monotonic()))
                self.events.put(self._lookup(addr))
            except queue.Empty:
                pass
            if time.monotonic() >= next_beat:
                next_beat = time.monotonic() + self.timeouts.heartbeat_interval
                for addr in list(self.watched):
                    self._heartbeat(addr)

    def _lookup(self, addr: str) -> tuple[str, str, object]:
        """Hazard: "unreachable" fails every room waiting on this prefill at once, so a lookup
        that only timed out is tried again (LOOKUP_ATTEMPTS in all): a prefill worker admitting
        a burst on a loaded host can take longer than the client's timeout to answer (a CI run
        lost all 96 rooms of a burst to one such answer)."""
        base = f"http://{addr}/route?"
        for _ in range(LOOKUP_ATTEMPTS):
            try:
                cluster = self._get_json(base + "&".join(f"{k}=-1" for k in QUERY))
                rank = self._get_json(base + "&".join(f"{k}=0" for k in QUERY))
                rank_addr = f"{rank['rank_ip']}:{rank['rank_port']}"
            except httpx.TimeoutException as exc:
                why = f"{type(exc).__name__}: {exc} ({LOOKUP_ATTEMPTS} attempts)"
                continue
            except (httpx.HTTPError, ValueError, KeyError, TypeError) as exc:
                return "unreachable", addr, f"{type(exc).__name__}: {exc}"
            return "found", addr, {**cluster, "rank": rank_addr}
        return "unreachable", addr, why

    def _get_json(self, url: str) -> dict:
        r = self.client.get(url)
        r.raise_for_status()
        return r.json() if r.content else {}

    def _heartbeat(self, addr: str) -> None:
        try:
            self.client.get(f"http://{addr}/health").raise_for_status()
            self._misses[addr] = 0
        except httpx.HTTPError:
            self._misses[addr] = self._misses.get(addr, 0) + 1
            if self._misses[addr] >= self.timeouts.heartbeat_max_failures:
                self._misses[addr] = 0
                self.watched.discard(addr)
                self.events.put(("dead", addr, None))
