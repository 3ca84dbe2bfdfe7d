"""Start the real sglang-router (pip package, a test-only peer) in PD mode for tests."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import httpx

from tests.pd_pair import PDPair
from tests.server_proc import free_port, stop_process
from tests.waiting import wait_until

# free_port's port may be taken by another test process before the router binds it; the router
# then logs this and exits, and a request to the port may meet that other process instead
PORT_TAKEN = "Address already in use"
LAUNCHES = 3


class SglangRouter:
    def __init__(self, pd: PDPair, model_path: Path, log_dir: Path) -> None:
        self.pd, self.model_path, self.log_dir = pd, model_path, log_dir
        self._launch()

    def _launch(self) -> None:
        pd = self.pd
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = self.log_dir / f"sglang-router-{self.port}.log"
        self.log = open(self.log_path, "w")
        cmd = [sys.executable, "-m", "sglang_router.launch_router", "--pd-disaggregation",
               "--prefill-policy", "round_robin", "--decode-policy", "round_robin",
               "--prefill", pd.prefill.url, str(pd.bootstrap_port), "--decode", pd.decode.url,
               "--host", "127.0.0.1", "--port", str(self.port), "--request-timeout-secs", "60",
               "--model-path", str(self.model_path), "--prometheus-port", str(free_port()),
               "--prometheus-host", "127.0.0.1", "--health-check-interval-secs", "1"]  # fmt: skip
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT)

    def wait_serving(self, timeout: float = 60.0) -> None:
        """Until a one-token chat completion goes through (workers register in the background).
        Only answers after the router's own bind attempt count, while it runs; a router that
        found its port taken is launched again on other ports (up to LAUNCHES times)."""
        body = {"messages": [{"role": "user", "content": "ping"}], "max_tokens": 1}

        def serves() -> bool:
            if self.proc.poll() is not None:
                raise RuntimeError(f"sglang-router exited:\n{self.log_path.read_text()}")
            if "Starting server on" not in self.log_path.read_text():
                return False  # before its bind: the port may answer for another process
            try:
                r = httpx.post(self.url + "/v1/chat/completions", json=body, timeout=5)
            except httpx.HTTPError:
                return False
            return r.status_code == 200 and self.proc.poll() is None

        for launch in range(1, LAUNCHES + 1):
            try:
                wait_until(
                    serves,
                    timeout,
                    0.5,
                    lambda: "sglang-router never served:\n" + self.log_path.read_text(),
                )
                return
            except RuntimeError:
                if launch == LAUNCHES or PORT_TAKEN not in self.log_path.read_text():
                    raise
                self.log.close()
                self._launch()

    def stop(self) -> None:
        stop_process(self.proc, 15)
        self.log.close()
