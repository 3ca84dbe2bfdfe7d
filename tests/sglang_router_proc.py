"""Start the real sglang-router (pip package, a test-only peer) in PD mode for tests."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import httpx

from tests.pd_pair import PDPair
from tests.server_proc import free_port, stop_process
from tests.waiting import wait_until


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
        body = {"messages": [{"role": "user", "content": "ping"}], "max_tokens": 1}

        def serves() -> bool:
            try:
                r = httpx.post(self.url + "/v1/chat/completions", json=body, timeout=5)
            except httpx.HTTPError:
                return False
            return r.status_code == 200

        wait_until(
            serves,
            timeout,
            0.5,
            lambda: "sglang-router never served:\n" + self.log_path.read_text(),
        )

    def stop(self) -> None:
        stop_process(self.proc, 15)
        self.log.close()
