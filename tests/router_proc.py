"""Start our router (`python -m router.launch_router`) as a subprocess for tests."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import httpx

from tests.server_proc import free_port, stop_process, wait_answering


class RouterProc:
    def __init__(self, *flags: str, log_dir: Path, env: dict[str, str] | None = None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_dir / f"router-{self.port}.log"
        cmd = [sys.executable, "-m", "router.launch_router", "--host", "127.0.0.1",
               "--port", str(self.port), *flags]  # fmt: skip
        self.log = open(self.log_path, "w")
        key = (env or {}).get("SGLANG_API_KEY")
        self.headers = {"authorization": f"Bearer {key}"} if key else {}
        self.proc = subprocess.Popen(
            cmd, stdout=self.log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})}
        )
        wait_answering(self.proc, self.url + "/liveness", self.log_path, 60.0, 0.05)
        self.cpu_to_serve = self._cpu_seconds()

    def wait_ready(self, timeout: float = 30.0) -> None:
        """Until every role has a healthy worker."""
        wait_answering(self.proc, self.url + "/readiness", self.log_path, timeout, 0.05)

    def state(self) -> dict:
        info = httpx.get(self.url + "/server_info", headers=self.headers, timeout=5)
        return info.json()["router"]

    def stop(self) -> int:
        returncode = stop_process(self.proc, 15)
        self.log.close()
        return returncode

    def _cpu_seconds(self) -> float:
        """CPU time the router process has used (user + system): unlike wall-clock time, it
        does not grow when a loaded machine leaves the process waiting for a core."""
        fields = Path(f"/proc/{self.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
