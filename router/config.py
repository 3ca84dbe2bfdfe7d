"""RouterConfig: sglang-router's flag names, one frozen dataclass, argparse built from it.

The seed's router command parses as it is (with `python -m router.launch_router` in place of
`python3 -m sglang_router.launch_router`). Only the flags this router acts on exist; a flag it
does not know is an error at start-up, not silently ignored.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

API_KEY_ENV = "SGLANG_API_KEY"  # as the workers read it
POLICIES = ("round_robin", "random", "power_of_two", "cache_aware")


class ConfigError(ValueError):
    """A flag value the router cannot run with; the message starts with the flag."""


@dataclass(frozen=True)
class RouterConfig:
    # workers
    pd_disaggregation: bool = field(
        default=False, metadata={"help": "PD mode: pair a --prefill and a --decode per request"}
    )
    prefill: tuple[tuple[str, int | None], ...] = field(
        default=(),
        metadata={
            "nargs": "+",
            "action": "append",
            "metavar": ("URL", "BOOTSTRAP_PORT"),
            "help": "a prefill worker: URL [BOOTSTRAP_PORT|none] (repeatable); without a port "
            "the workers get bootstrap_port null and use their own",
        },
    )
    decode: tuple[str, ...] = field(
        default=(), metadata={"action": "append", "metavar": "URL", "help": "repeatable"}
    )
    worker_urls: tuple[str, ...] = field(
        default=(), metadata={"nargs": "+", "metavar": "URL", "help": "plain (non-PD) mode"}
    )
    # policies
    policy: str = field(
        default="round_robin",
        metadata={"choices": POLICIES, "help": "plain mode, and PD sides not set below"},
    )
    prefill_policy: str | None = field(default=None, metadata={"choices": POLICIES})
    decode_policy: str | None = field(default=None, metadata={"choices": POLICIES})
    cache_threshold: float = field(
        default=0.3, metadata={"help": "cache_aware: prefix match ratio that wins over load"}
    )
    balance_abs_threshold: int = field(
        default=64, metadata={"help": "cache_aware: in-flight gap (max - min) that is imbalance"}
    )
    balance_rel_threshold: float = field(
        default=1.5, metadata={"help": "cache_aware: ...and max > this x min"}
    )
    max_tree_size: int = field(
        default=1 << 22, metadata={"help": "cache_aware: prompt characters remembered, in all"}
    )
    # server
    host: str = "127.0.0.1"
    port: int = 30000
    model_path: str | None = field(
        default=None, metadata={"help": "the model id /v1/models names while no worker is up"}
    )
    max_payload_size: int = field(default=32 << 20, metadata={"help": "bytes (413 above)"})
    body_read_timeout_secs: float = field(
        default=10.0, metadata={"help": "a request body that stalls this long gets 408"}
    )
    api_key: str | None = field(
        default=None,
        metadata={
            "help": "clients must send Authorization: Bearer KEY, and the router sends it to the "
            "workers (default: $SGLANG_API_KEY)"
        },
    )
    log_level: str = field(default="info", metadata={"choices": ["debug", "info", "warn", "error"]})
    prometheus_host: str = "127.0.0.1"
    prometheus_port: int | None = field(
        default=None, metadata={"help": "also serve /metrics here (always on the main port)"}
    )
    # reliability
    request_timeout_secs: float = field(
        default=1800.0, metadata={"help": "limit on each upstream request, streams included"}
    )
    retry_max_retries: int = field(
        default=5, metadata={"help": "retries on connect errors and 5xx, before any byte is sent"}
    )
    disable_retries: bool = False
    health_check_interval_secs: float = 60.0
    health_check_timeout_secs: float = 5.0
    health_failure_threshold: int = 3
    health_success_threshold: int = 2
    health_check_endpoint: str = "/health"
    max_concurrent_requests: int = field(
        default=-1, metadata={"help": "generation requests at once (-1: no limit, no queue)"}
    )
    queue_size: int = field(default=100, metadata={"help": "waiting beyond that: 429"})
    queue_timeout_secs: float = field(default=60.0, metadata={"help": "waited longer: 408"})

    # ---- derived ----
    @property
    def auth_header(self) -> bytes:
        """The header line the router sends to workers ("" without a key)."""
        return b"authorization: Bearer %s\r\n" % self.api_key.encode() if self.api_key else b""

    @property
    def max_retries(self) -> int:
        return 0 if self.disable_retries else self.retry_max_retries

    @property
    def policy_for(self) -> dict[str, str]:
        return {
            "prefill": self.prefill_policy or self.policy,
            "decode": self.decode_policy or self.policy,
            "regular": self.policy,
        }

    def validate(self) -> None:
        """Raise ConfigError for the first flag the router cannot run with."""
        if self.pd_disaggregation:
            if not self.prefill or not self.decode:
                raise ConfigError("--pd-disaggregation: needs at least one --prefill and --decode")
            if self.worker_urls:
                raise ConfigError("--worker-urls: not used with --pd-disaggregation")
        else:
            if not self.worker_urls:
                raise ConfigError("--worker-urls: needs at least one URL (or --pd-disaggregation)")
            if self.prefill or self.decode:
                raise ConfigError("--prefill/--decode: need --pd-disaggregation")
        urls = [u for u, _ in self.prefill] + list(self.decode) + list(self.worker_urls)
        for url in urls:
            check_url(url)
        if len(set(urls)) != len(urls):
            raise ConfigError("worker URLs: each worker may be named once")
        for name in ("health_failure_threshold", "health_success_threshold"):
            if getattr(self, name) < 1:
                raise ConfigError(f"--{_dash(name)}: must be >= 1")
        for name in ("request_timeout_secs", "health_check_interval_secs",
                     "health_check_timeout_secs", "queue_timeout_secs",
                     "body_read_timeout_secs"):  # fmt: skip
            if getattr(self, name) <= 0:
                raise ConfigError(f"--{_dash(name)}: must be > 0")
        if self.max_payload_size < 1:
            raise ConfigError("--max-payload-size: must be >= 1")
        if self.retry_max_retries < 0 or self.queue_size < 0:
            raise ConfigError("--retry-max-retries/--queue-size: must be >= 0")
        if self.max_concurrent_requests == 0 or self.max_concurrent_requests < -1:
            raise ConfigError("--max-concurrent-requests: must be >= 1, or -1 for no limit")
        if not 0.0 <= self.cache_threshold <= 1.0:
            raise ConfigError("--cache-threshold: must be in [0, 1]")

    # ---- argparse ----
    @classmethod
    def parser(cls) -> argparse.ArgumentParser:
        ap = argparse.ArgumentParser(
            prog="python -m router.launch_router",
            description="OpenAI-compatible router in front of prefill/decode (or plain) workers.",
        )
        for f in dataclasses.fields(cls):
            meta = dict(f.metadata)
            flag = "--" + _dash(f.name)
            if f.type in ("bool", bool):
                ap.add_argument(flag, action="store_true", help=meta.get("help"))
                continue
            kwargs: dict[str, Any] = {k: meta[k] for k in ("help", "choices", "nargs", "action",
                                                          "metavar") if k in meta}  # fmt: skip
            if "nargs" not in meta and "action" not in meta:
                kwargs["type"] = _scalar_type(str(f.type))
            kwargs["default"] = None if f.default == () else f.default
            ap.add_argument(flag, **kwargs)
        return ap

    @classmethod
    def from_cli(cls, argv: list[str] | None = None) -> RouterConfig:
        """Parse and validate; a bad flag exits with one line naming it (argparse's exit 2)."""
        ap = cls.parser()
        ns = vars(ap.parse_args(argv))
        try:
            ns["prefill"] = tuple(_prefill_entry(e) for e in ns["prefill"] or ())
            ns["decode"] = tuple(ns["decode"] or ())
            ns["worker_urls"] = tuple(ns["worker_urls"] or ())
            ns["api_key"] = ns["api_key"] or os.environ.get(API_KEY_ENV) or None
            config = cls(**ns)
            config.validate()
        except ConfigError as e:
            ap.error(str(e))
        return config


def check_url(url: str) -> tuple[str, int]:
    """(host, port) of a worker URL: http://HOST[:PORT], nothing after the port."""
    parts = urlsplit(url)
    try:
        port = parts.port
    except ValueError:
        port = -1
    if parts.scheme != "http" or not parts.hostname or port == -1 or parts.path not in ("", "/"):
        raise ConfigError(f"worker URL {url!r}: expected http://HOST:PORT")
    return parts.hostname, port or 80


def _prefill_entry(values: list[str]) -> tuple[str, int | None]:
    if len(values) > 2:
        raise ConfigError(f"--prefill {' '.join(values)}: expected URL [BOOTSTRAP_PORT|none]")
    url = values[0]
    if len(values) == 1 or values[1].lower() in ("none", "null"):
        return url, None
    try:
        port = int(values[1])
    except ValueError:
        port = -1
    if not 0 < port < 65536:
        raise ConfigError(f"--prefill {url} {values[1]}: BOOTSTRAP_PORT is a port number or none")
    return url, port


def _dash(name: str) -> str:
    return name.replace("_", "-")


def _scalar_type(annotation: str):
    if "int" in annotation:
        return int
    if "float" in annotation:
        return float
    return str
