"""Start the real server (`python -m serving.launch_server`) as a subprocess for tests."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx


def eagle_flags(steps: int) -> list[str]:
    """Server flags for EAGLE with `steps` chain draft steps (none for 0)."""
    if not steps:
        return []
    return [
        "--speculative-algorithm",
        "EAGLE",
        "--speculative-num-steps",
        str(steps),
        "--speculative-num-draft-tokens",
        str(steps + 1),
    ]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(
        self, model_path: Path, *flags: str, log_dir: Path, env: dict[str, str] | None = None
    ) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        key = (env or {}).get("SGLANG_API_KEY")
        self.headers = {"authorization": f"Bearer {key}"} if key else {}
        self.log_path = log_dir / f"server-{self.port}.log"
        env = dict(os.environ, PDSERVE_CHECK_INVARIANTS="1", PYTHONUNBUFFERED="1", **(env or {}))
        cmd = [
            sys.executable,
            "-m",
            "serving.launch_server",
            "--model-path",
            str(model_path),
            "--port",
            str(self.port),
            "--page-size",
            "16",
            "--enable-metrics",  # tests read /metrics
            *flags,
        ]
        self.log = open(self.log_path, "w")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env)
        self.wait_healthy()

    def wait_healthy(self, timeout: float = 90.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited:\n{self.log_path.read_text()}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise TimeoutError(f"server not healthy:\n{self.log_path.read_text()}")

    def children(self) -> list[int]:
        return self.children_of(self.proc.pid)

    @staticmethod
    def children_of(pid: int) -> list[int]:
        out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True)
        return [int(p) for p in out.stdout.split()]

    def stats(self) -> dict:
        info = httpx.get(self.url + "/server_info", headers=self.headers, timeout=5).json()
        return info["internal_states"][0]

    def idle_pool(self, timeout: float = 10.0) -> dict:
        """Wait until no request is live; returns the scheduler stats."""
        deadline = time.monotonic() + timeout
        while True:
            stats = self.stats()
            idle = stats["running"] == 0 and stats["queued"] == 0
            if idle and stats["used_rows"] == 0 and stats["used_pages"] == 0:
                return stats
            if time.monotonic() > deadline:
                raise AssertionError(f"pool not idle: {stats}")
            time.sleep(0.1)

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        return self.proc.returncode
