"""Start the real server (`python -m serving.launch_server`) as a subprocess for tests."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import httpx

from tests.waiting import wait_until


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
        wait_answering(self.proc, self.url + "/health", self.log_path, timeout, 0.2)

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
        last: dict = {}

        def idle() -> dict | None:
            last.update(self.stats())
            busy = ("running", "queued", "used_rows", "used_pages")
            return None if any(last[k] for k in busy) else dict(last)

        return wait_until(idle, timeout, 0.1, lambda: f"pool not idle: {last}")

    def stop(self) -> int:
        returncode = stop_process(self.proc, 30)
        self.log.close()
        return returncode


def wait_answering(
    proc: subprocess.Popen, url: str, log_path: Path, timeout: float, interval: float
) -> None:
    """Until GET `url` answers 200. Fails at once, with the log, if the process exits first;
    after `timeout` s, with the log."""

    def answers() -> bool:
        if proc.poll() is not None:
            raise RuntimeError(f"exited (its log, {log_path.name}):\n{log_path.read_text()}")
        try:
            return httpx.get(url, timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    wait_until(answers, timeout, interval, lambda: f"{url} not 200:\n{log_path.read_text()}")


def stop_process(proc: subprocess.Popen, timeout: float) -> int:
    """SIGTERM, then SIGKILL if it is still running after `timeout` s; its exit status."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return proc.returncode
