"""A real prefill + decode worker pair (Mooncake over loopback TCP) for tests.

`dispatch` does what a PD router does for one request: the same body plus bootstrap_host,
bootstrap_port and a fresh bootstrap_room, sent to both workers at once; decode's answer is the
client's answer.
"""

from __future__ import annotations

import random
import threading
from pathlib import Path

import httpx

from tests.server_proc import Server, free_port

FAST_TIMEOUTS = {
    # Short enough that a test of each timeout runs in seconds, long enough that a loaded 2-core
    # machine (load 10 seen) does not trip them: a decode step or a heartbeat answer can take
    # seconds there.
    "SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT": "15",
    # A hang guard, not a budget: under CI load a request queued behind others at prefill can
    # wait long for its KV. Dead peers are caught by the heartbeat and bootstrap timeouts.
    "SGLANG_DISAGGREGATION_WAITING_TIMEOUT": "240",
    "SGLANG_DISAGGREGATION_HEARTBEAT_INTERVAL": "0.5",
    "SGLANG_DISAGGREGATION_HEARTBEAT_MAX_FAILURE": "4",
    "PDSERVE_DISAGGREGATION_ABORT_ACK_TIMEOUT": "30",
}


class PDPair:
    def __init__(
        self,
        model: Path,
        log_dir: Path,
        prefill_flags: tuple[str, ...] = (),
        decode_flags: tuple[str, ...] = (),
        decode_model: Path | None = None,
    ) -> None:
        self.bootstrap_port = free_port()
        self.prefill = Server(
            model,
            "--disaggregation-mode",
            "prefill",
            "--disaggregation-bootstrap-port",
            str(self.bootstrap_port),
            *prefill_flags,
            log_dir=log_dir,
            env=FAST_TIMEOUTS,
        )
        try:
            self.decode = Server(
                decode_model or model,
                "--disaggregation-mode",
                "decode",
                *decode_flags,
                log_dir=log_dir,
                env=FAST_TIMEOUTS,
            )
        except Exception:
            self.prefill.stop()
            raise

    @classmethod
    def join(cls, prefill: Server, bootstrap_port: int, decode: Server) -> PDPair:
        """A pair of workers already running (tests that pair one worker with several)."""
        pair = cls.__new__(cls)
        pair.prefill, pair.bootstrap_port, pair.decode = prefill, bootstrap_port, decode
        return pair

    def bootstrap(self, room: int | None = None) -> dict:
        return {
            "bootstrap_host": "127.0.0.1",
            "bootstrap_port": self.bootstrap_port,
            "bootstrap_room": random.getrandbits(63) if room is None else room,
        }

    def dispatch(self, path: str, body: dict, timeout: float = 300) -> tuple[httpx.Response, ...]:
        """POST to both; returns (decode response, prefill response)."""
        full = {**body, **self.bootstrap()}
        out: dict[str, httpx.Response] = {}

        def post(name: str, url: str) -> None:
            out[name] = httpx.post(url + path, json=full, timeout=timeout)

        threads = [
            threading.Thread(target=post, args=(n, s.url))
            for n, s in (("decode", self.decode), ("prefill", self.prefill))
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return out["decode"], out["prefill"]

    def idle(self) -> None:
        self.prefill.idle_pool()
        self.decode.idle_pool()

    def stop(self) -> None:
        self.decode.stop()
        self.prefill.stop()
