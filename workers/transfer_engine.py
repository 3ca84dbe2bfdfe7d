"""The Mooncake transfer engine, as the PD workers use it.

One engine per worker process, P2P handshake metadata (no metadata server). Protocol: rdma when
--disaggregation-ib-device names devices, else tcp. Every buffer the peer may write into is
registered once at start-up; a write to an unregistered range fails on the target side.
"""

from __future__ import annotations

import logging
import os
import socket

log = logging.getLogger(__name__)


def advertise_host(bind_host: str) -> str:
    """The address peers reach this worker at: SGLANG_HOST_IP (as in SGLang), else the --host
    it serves on, else this host's name resolved."""
    explicit = os.environ.get("SGLANG_HOST_IP")
    if explicit:
        return explicit
    if bind_host not in ("", "0.0.0.0", "::"):
        return bind_host
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


# Mooncake's TCP transport moves a write in slices of MC_TCP_SLICE_SIZE bytes (64 KiB by
# default), each staged through the host with its own blocking cudaMemcpy when the memory is a
# GPU's. 1 MiB slices measured 1.6x faster for a bench-preset handoff in GPU memory on an H200
# (7.6 -> 4.7 ms for 9.7 MB; 4 and 16 MiB: 5.2 and 5.7 ms) and no slower in host memory
# (docs/notebook/2026-11-29_2026-12-03.md, "The KV handoff's slices"; docs/BENCHMARKS.md, "KV
# handoff"). An operator's own setting wins.
TCP_SLICE_BYTES = 1 << 20


class TransferError(RuntimeError):
    pass


class MooncakeEngine:
    def __init__(self, host: str, ib_device: str | None) -> None:
        """`host` is the address peers reach this engine at (the session's host).

        Hazard: whatever `host` says, Mooncake (0.3.13, and its source to date) opens two
        listeners on wildcard addresses that nothing configures: the handshake RPC socket on
        0.0.0.0 (findAvailableTcpPort binds INADDR_ANY; [::] with MC_USE_IPV6), and, with the tcp
        protocol, the data socket on [::] dual stack (TcpContext binds asio's tcp::v6() with
        v6_only off; 0.0.0.0 where IPv6 is missing). MC_TCP_BIND_ADDRESS binds nothing: it is
        read only with a metadata server, as the address to advertise (measured: the log says
        "listening on <it>:<port>" while the socket is 0.0.0.0:<port>); under P2PHANDSHAKE the
        advertised address is `host`. Both ports lie in [MC_MIN_RPC_PORT, MC_MAX_RPC_PORT];
        docs/DEPLOY.md has the firewall rule."""
        os.environ.setdefault("MC_LOG_LEVEL", "WARNING")
        from mooncake.engine import TransferEngine

        self.protocol = "rdma" if ib_device else "tcp"
        if self.protocol == "tcp":
            os.environ.setdefault("MC_TCP_SLICE_SIZE", str(TCP_SLICE_BYTES))
        self.engine = TransferEngine()
        rc = self.engine.initialize(host, "P2PHANDSHAKE", self.protocol, ib_device or "")
        if rc != 0:
            raise TransferError(
                f"Mooncake initialize({host}, {self.protocol}, {ib_device or '-'}) returned {rc}"
            )
        self.session_id = f"{host}:{self.engine.get_rpc_port()}"
        # tests/test_reliability.py reads the handshake port from this line
        log.info("Mooncake engine up: session %s, protocol %s", self.session_id, self.protocol)

    def register(self, regions: list[tuple[int, int]]) -> None:
        """(address, length) pairs of memory peers may write into."""
        addrs, lens = [a for a, _ in regions], [n for _, n in regions]
        rc = self.engine.batch_register_memory(addrs, lens)
        if rc != 0:
            raise TransferError(f"Mooncake batch_register_memory returned {rc}")

    def write(self, session: str, srcs: list[int], dsts: list[int], lens: list[int]) -> None:
        """One synchronous batch of writes into `session`'s registered memory."""
        if not srcs:
            return
        rc = self.engine.batch_transfer_sync_write(session, srcs, dsts, lens)
        if rc != 0:
            raise TransferError(f"Mooncake write of {len(srcs)} pieces to {session} returned {rc}")

    def write_async(self, session: str, srcs: list[int], dsts: list[int], lens: list[int]) -> int:
        """Submit one batch of writes; returns its batch id for `wait` (negative: refused)."""
        return self.engine.batch_transfer_async_write(session, srcs, dsts, lens)

    def wait(self, batch: int) -> None:
        """Until the batch `write_async` returned is written (Mooncake's status call blocks until
        then); raises TransferError if it was refused or failed."""
        rc = self.engine.get_batch_transfer_status([batch]) if batch >= 0 else batch
        if rc != 0:
            raise TransferError(f"Mooncake batch write {batch} returned {rc}")
