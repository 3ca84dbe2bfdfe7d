"""Start the real sglang-router (pip package, a test-only peer) in PD mode for tests."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import httpx

from tests.pd_pair import PDPair
from tests.server_proc import free_port


class SglangRouter:
    def __init__(self, pd: PDPair, model_path: Path, log_dir: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_dir / f"sglang-router-{self.port}.log"
        self.log = open(self.log_path, "w")
        cmd = [sys.executable, "-m", "sglang_router.launch_router", "--pd-disaggregation",
               "--prefill-policy", "round_robin", "--decode-policy", "round_robin",
               "--prefill", pd.prefill.url, str(pd.bootstrap_port), "--decode", pd.decode.url,
               "--host", "127.0.0.1", "--port", str(self.port), "--request-timeout-secs", "60",
               "--model-path", str(model_path), "--prometheus-port", str(free_port()),
               "--prometheus-host", "127.0.0.1", "--health-check-interval-secs", "1"]  # fmt: skip
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT)

    def wait_serving(self, timeout: float = 60.0) -> None:
        """Until a one-token chat completion goes through (workers register in the background)."""
        deadline = time.monotonic() + timeout
        body = {"messages": [{"role": "user", "content": "ping"}], "max_tokens": 1}
        while time.monotonic() < deadline:
            try:
                r = httpx.post(self.url + "/v1/chat/completions", json=body, timeout=5)
                if r.status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise TimeoutError("sglang-router never served:\n" + self.log_path.read_text())

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()
