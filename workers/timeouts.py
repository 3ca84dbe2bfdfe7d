"""Handoff timeouts, read from SGLang's environment variable names (seconds)."""

from __future__ import annotations

import os
from dataclasses import dataclass


def _env(name: str, default: float) -> float:
    return float(os.environ.get(name, default))


@dataclass(frozen=True)
class Timeouts:
    bootstrap: float  # prefill: decode never sent destinations for a room
    waiting: float  # decode: destinations sent, no KV arrived
    heartbeat_interval: float  # decode: GET prefill bootstrap /health every this often
    heartbeat_max_failures: int
    abort_ack: float  # decode: pages of an aborted room wait this long for prefill's ack

    @classmethod
    def from_env(cls) -> Timeouts:
        return cls(
            bootstrap=_env("SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT", 300),
            waiting=_env("SGLANG_DISAGGREGATION_WAITING_TIMEOUT", 300),
            heartbeat_interval=_env("SGLANG_DISAGGREGATION_HEARTBEAT_INTERVAL", 5),
            heartbeat_max_failures=int(_env("SGLANG_DISAGGREGATION_HEARTBEAT_MAX_FAILURE", 2)),
            abort_ack=_env("PDSERVE_DISAGGREGATION_ABORT_ACK_TIMEOUT", 30),
        )
