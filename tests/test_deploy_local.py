"""deploy/launch_local.py end to end: real prefill, decode and router processes, Mooncake over
loopback TCP. It writes the tiny checkpoint on first use, prints where everything runs, the
seed's curl and its answer; --once, Ctrl-C and a worker that fails to start all end with every
process of the stack gone."""

from __future__ import annotations

import json
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from deploy.launch_local import printable

pytest.importorskip("mooncake.engine")

REPO = Path(__file__).resolve().parents[1]
LAUNCHER = REPO / "deploy" / "launch_local.py"
ROLES = ("prefill", "decode", "router")


def _children() -> dict[int, list[int]]:
    tree: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        tree.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    return tree


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


class Run:
    """The launcher as a person runs it, with every process it ever had below it recorded."""

    def __init__(self, *args: str, script: Path = LAUNCHER) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, str(script), "--port", "0", "--max-tokens", "8", *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            cwd=REPO,
        )
        self.seen: set[int] = set()
        self._watch = threading.Thread(target=self._record, daemon=True)
        self._watch.start()

    def _record(self) -> None:
        while self.proc.poll() is None:
            tree, todo = _children(), [self.proc.pid]
            while todo:
                kids = tree.get(todo.pop(), [])
                self.seen.update(kids)
                todo.extend(kids)
            time.sleep(0.1)

    def read_until(self, marker: str, timeout: float = 240) -> str:
        out = []
        deadline = time.monotonic() + timeout
        for line in self.proc.stdout:
            out.append(line)
            if marker in line or time.monotonic() > deadline:
                break
        return "".join(out)

    def finish(self, timeout: float = 240) -> tuple[int, str]:
        out, _ = self.proc.communicate(timeout=timeout)
        self._watch.join()
        return self.proc.returncode, out

    def assert_nothing_left(self) -> None:
        assert self.seen, "no child process was ever seen"
        deadline = time.monotonic() + 10
        while any(_alive(p) for p in self.seen) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not [p for p in self.seen if _alive(p)], "processes of the stack outlived it"


def assert_status_and_answer(out: str, name: str = "tiny") -> None:
    for role in ROLES:
        assert f"  {role}" in out and f"{role}.log" in out, out
        assert any(ln.strip().startswith(f"{role}") and "up after" in ln for ln in out.split("\n"))
    assert "curl --fail-with-body --max-time 600" in out and f'"model": "{name}"' in out, out
    assert "List three things to check when an HTTP service returns 503." in out
    assert "Answer (8 tokens" in out, out


def assert_stopped_in_order(out: str) -> None:
    stops = [ln.split()[0] for ln in out.split("\n") if "stopped (exit" in ln]
    assert stops == ["router", "decode", "prefill"], out
    assert out.count("stopped (exit 0)") == 3, out


def test_by_default_it_serves_the_shipped_small_model_with_eagle(tmp_path: Path) -> None:
    run = Run("--once", "--log-dir", str(tmp_path / "logs"))
    code, out = run.finish()
    assert code == 0, out
    assert_status_and_answer(out, name="small")
    assert_stopped_in_order(out)
    for role in ("prefill", "decode"):
        log = (tmp_path / "logs" / f"{role}.log").read_text()
        assert "small_model" in log and "speculative EAGLE 1 step(s)" in log, log
    run.assert_nothing_left()


def test_once_writes_the_tiny_checkpoint_and_answers(tmp_path: Path) -> None:
    """A fresh checkout: no models/ yet. --tiny writes models/tiny beside its deploy/."""
    script = tmp_path / "deploy" / "launch_local.py"
    script.parent.mkdir()
    shutil.copy(LAUNCHER, script)
    run = Run("--tiny", "--once", "--log-dir", str(tmp_path / "logs"), script=script)
    code, out = run.finish()
    assert code == 0, out
    assert "writing the tiny default checkpoint" in out, out
    assert (tmp_path / "models" / "tiny" / "config.json").is_file()
    assert_status_and_answer(out)
    assert_stopped_in_order(out)
    assert {p.name for p in (tmp_path / "logs").iterdir()} == {f"{r}.log" for r in ROLES}
    run.assert_nothing_left()


def test_the_printed_curl_answers_and_ctrl_c_stops_all_three(tiny_ckpt: Path) -> None:
    run = Run("--model-path", str(tiny_ckpt), "--served-model-name", "tiny")
    out = run.read_until("Ctrl-C stops")
    assert "Ctrl-C stops" in out, out + run.finish()[1]
    assert_status_and_answer(out)
    if shutil.which("curl"):
        curl = out.split("(this is the request sent now):\n")[1].split("\n\nAnswer")[0]
        answer = out.split("\n\nAnswer")[1].split(":\n", 1)[1].split("\n\nServing on")[0]
        got = subprocess.run(["bash", "-c", curl], capture_output=True, text=True, timeout=120)
        assert got.returncode == 0, got.stdout + got.stderr
        assert printable(json.loads(got.stdout)["choices"][0]["message"]["content"]) == answer
    run.proc.send_signal(signal.SIGINT)
    code, rest = run.finish(timeout=120)
    assert code == 0, out + rest
    assert "SIGINT: stopping." in rest, rest
    assert_stopped_in_order(rest)
    run.assert_nothing_left()


def test_a_worker_that_cannot_start_is_named_and_the_rest_stopped(tiny_ckpt: Path) -> None:
    run = Run("--model-path", str(tiny_ckpt), "--prefill-args", "--tp-size 3")
    code, out = run.finish()
    assert code == 1, out
    assert "error: prefill exited with code 1" in out, out
    assert "--tp-size 3: the checkpoint's linear_num_heads (KDA heads) = 4" in out, out  # its log
    assert "Answer" not in out
    run.assert_nothing_left()


def test_a_taken_router_port_is_refused_before_anything_starts(tiny_ckpt: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        out = subprocess.run(
            [sys.executable, str(LAUNCHER), "--model-path", str(tiny_ckpt), "--port", str(port)],
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert out.returncode == 1
    assert f"router port {port} on 127.0.0.1 is not free" in out.stderr, out.stderr
    assert "pid" not in out.stdout
