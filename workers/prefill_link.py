"""Decode's end of the link to prefill workers: which prefill rank serves a bootstrap address
(looked up and heartbeated by PrefillDirectory's thread), the handshake that rank must pass,
decode's memory registered with it once, aborts, and the rooms still waiting for memory here
(DecodeRole sends each room's destinations itself).
"""

from __future__ import annotations

import queue
from collections.abc import Iterable, Iterator

from serving.server_args import ServerArgs
from workers.kv_endpoint import KVEndpoint
from workers.kv_layout import layout_mismatch, simulation_mismatch, tp_mismatch
from workers.messages import Abort, Register, Waiting
from workers.prefill_directory import PrefillDirectory
from workers.rank_transfer import RankMemory
from workers.timeouts import Timeouts


class PrefillLink:
    def __init__(
        self,
        args: ServerArgs,
        endpoint: KVEndpoint,
        memory: list[RankMemory],
        tp_size: int,
        simulated_rank: int | None,
        fingerprint: dict,
        timeouts: Timeouts,
    ) -> None:
        """memory: entry r is decode rank r's (registered with every prefill rank used)."""
        self.args, self.endpoint, self.memory, self.timeouts = args, endpoint, memory, timeouts
        self.tp_size, self.simulated_rank, self.fingerprint = tp_size, simulated_rank, fingerprint
        self.prefills: dict[str, dict] = {}  # bootstrap addr -> cluster info + rank
        self.registered: set[str] = set()  # prefill ranks we sent our buffers to
        self.next_keepalive = 0.0
        self.directory = PrefillDirectory(timeouts, args.api_key)
        self.directory.start()

    def rank(self, bootstrap: str) -> str | None:
        """The control address of the prefill rank behind a bootstrap address, once found."""
        info = self.prefills.get(bootstrap)
        return info["rank"] if info is not None else None

    def look_up(self, bootstrap: str) -> None:
        self.directory.lookups.put(bootstrap)

    def events(self) -> Iterator[tuple[str, str, object]]:
        """The directory's news, each (kind, bootstrap addr, payload): "found" (the cluster
        info), "unreachable" (why), "dead" (the rank's control address, or None: never found).
        A rank found is used once handshake() passes it."""
        while True:
            try:
                kind, addr, payload = self.directory.events.get_nowait()
            except queue.Empty:
                return
            if kind == "dead":
                payload = (self.prefills.pop(addr, None) or {}).get("rank")
            yield kind, addr, payload

    def handshake(self, addr: str, info: dict) -> str | None:
        """A rank found: why it cannot serve this decode worker, or None (it is used from now
        on, and heartbeated)."""
        mismatch = self._handshake_problem(info)
        if mismatch is None:
            self.prefills[addr] = info
            self.directory.watched.add(addr)
        return mismatch

    def _handshake_problem(self, info: dict) -> str | None:
        tp = tp_mismatch(info.get("attn_tp_size"), self.tp_size)
        if tp is not None:
            return tp
        simulated = simulation_mismatch(info.get("simulated_rank"), self.simulated_rank)
        if simulated is not None:
            return simulated
        if info.get("model") != self.fingerprint:
            return (
                f"model config differs: prefill serves {info.get('model_path')}, decode "
                f"{self.args.model_path}"
            )
        if info.get("page_size") != self.args.page_size:
            return f"page size: prefill {info.get('page_size')}, decode {self.args.page_size}"
        return layout_mismatch(self.endpoint.layout, info.get("layout") or [])

    def register(self, rank: str) -> None:
        """Register decode's memory with a prefill rank (once), before its first destinations."""
        if rank not in self.registered:
            register = Register(
                decode_addr=self.endpoint.addr,
                tp_size=self.tp_size,
                sessions=[m.session for m in self.memory],
                page_addrs=[m.page_addrs for m in self.memory],
                row_addrs=[m.row_addrs for m in self.memory],
                layout=self.endpoint.layout,
            )
            self.endpoint.send(rank, register)
            self.registered.add(rank)

    def abort(self, rank: str, room: int, reason: str = "") -> None:
        """Prefill's request for the room fails (with `reason`: decode refused the handoff)."""
        self.endpoint.send(rank, Abort(room, self.endpoint.addr, reason))

    def keep_waiting(self, now: float, rooms: Iterable[tuple[str, int]]) -> None:
        """Tell each prefill rank which of its rooms still wait here for memory, every
        heartbeat interval (rooms: (bootstrap addr, room)); prefill extends their bootstrap
        deadline (a dead decode stops sending, and prefill's timeout then frees the room)."""
        if now < self.next_keepalive:
            return
        self.next_keepalive = now + self.timeouts.heartbeat_interval
        by_rank: dict[str, list[int]] = {}
        for addr, room in rooms:
            if addr in self.prefills:
                by_rank.setdefault(self.prefills[addr]["rank"], []).append(room)
        for rank, waiting in by_rank.items():
            self.endpoint.send(rank, Waiting(waiting))
