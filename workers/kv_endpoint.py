"""Rank 0's end of the handoff: the Mooncake engine with its pool registered, one ZMQ PULL
socket for control messages, and PUSH sockets to peers (ranks > 0 have only the engine:
workers/rank_transfer.FollowerKV)."""

from __future__ import annotations

import logging

import zmq

from serving.memory.pool import MemoryPool
from workers import messages
from workers.kv_layout import layout, page_buffers, row_buffers
from workers.rank_transfer import RankMemory
from workers.transfer_engine import MooncakeEngine

log = logging.getLogger(__name__)


class KVEndpoint:
    def __init__(self, pool: MemoryPool, host: str, ib_device: str | None) -> None:
        self.host = host
        self.engine = MooncakeEngine(host, ib_device)
        self.page_buffers = page_buffers(pool)
        self.row_buffers = row_buffers(pool)
        self.engine.register([(b.addr, b.nbytes) for b in self.page_buffers + self.row_buffers])
        self.layout = layout(pool)
        self.memory = RankMemory(
            self.engine.session_id,
            [b.addr for b in self.page_buffers],
            [b.addr for b in self.row_buffers],
        )
        self.ctx = zmq.Context.instance()
        self.pull = self.ctx.socket(zmq.PULL)
        self.port = self.pull.bind_to_random_port(f"tcp://{host}")
        self.addr = f"{host}:{self.port}"
        self._push: dict[str, zmq.Socket] = {}
        total = sum(b.nbytes for b in self.page_buffers + self.row_buffers)
        log.info(
            "KV endpoint %s: %d page buffers + %d row buffers registered (%.1f MiB)",
            self.addr,
            len(self.page_buffers),
            len(self.row_buffers),
            total / 2**20,
        )

    def send(self, addr: str, msg: messages.ControlMessage) -> None:
        sock = self._push.get(addr)
        if sock is None:
            sock = self.ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SNDTIMEO, 1000)
            sock.connect(f"tcp://{addr}")
            self._push[addr] = sock
        try:
            sock.send(messages.encode(msg))
        except zmq.Again:
            log.warning("control message %s to %s timed out", type(msg).__name__, addr)

    def receive(self) -> list[messages.ControlMessage]:
        out = []
        while True:
            try:
                raw = self.pull.recv(zmq.NOBLOCK)
            except zmq.Again:
                return out
            try:
                out.append(messages.decode(raw))
            except ValueError as exc:
                log.warning("dropped a malformed control message: %s", exc)
