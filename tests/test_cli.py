"""launch_server's command line: the seed's flags parse; impossible flags fail in one line;
SIGTERM stops the front and the scheduler with no orphan."""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
import threading
from pathlib import Path

import httpx
import pytest

from serving.server_args import ServerArgs
from tests.server_proc import Server
from tests.waiting import wait_until

SEED_COMMANDS = Path(__file__).parent / "data" / "seed_launch_commands.sh"


def seed_commands() -> dict[str, list[str]]:
    """The seed's two launch_server commands, as argument lists (without the executable)."""
    out = {}
    for block in SEED_COMMANDS.read_text().split("python3 -m sglang.launch_server")[1:]:
        argv = shlex.split(block.replace("\\\n", " "))
        out[argv[argv.index("--disaggregation-mode") + 1]] = argv
    assert set(out) == {"prefill", "decode"}
    return out


def test_every_seed_flag_parses(tiny_ckpt):
    for role, argv in seed_commands().items():
        argv = [str(tiny_ckpt) if a == "$MODEL_PATH" else a for a in argv]
        argv = [
            a.replace("$MODEL_PATH", str(tiny_ckpt)).replace("$IB_DEVICES", "mlx5_0") for a in argv
        ]
        args = ServerArgs.from_cli(argv)
        assert args.disaggregation_mode == role
        assert args.tp_size == 8 and args.speculative_num_draft_tokens == 2
        assert args.served_model_name == "GLM-5.3-Flash"


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--tp-size", "8"], "--tp-size 8: the checkpoint's linear_num_heads (KDA heads) = 4"),
        (["--tp-size", "2", "--ep-size", "4"], "--tp-size 2: --tp-size and --ep-size must each"),
        (["--kv-cache-dtype", "fp8_e4m3"], "--kv-cache-dtype fp8_e4m3"),
        (["--dsa-decode-backend", "tilelang"], "--dsa-decode-backend tilelang"),
        (["--cuda-graph-backend-decode", "full"], "--cuda-graph-backend-decode full: needs a CUDA"),
        (["--chunked-prefill-size", "10"], "--chunked-prefill-size 10: must be a multiple"),
        (["--context-length", "99999999"], "--context-length 99999999"),
        (
            ["--disaggregation-decode-enable-radix-cache"],
            "--disaggregation-decode-enable-radix-cache: only for --disaggregation-mode decode",
        ),
    ],
)
def test_impossible_flags_fail_in_one_line(tiny_ckpt, flags, message):
    out = subprocess.run(
        [sys.executable, "-m", "serving.launch_server", "--model-path", str(tiny_ckpt), *flags],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode != 0
    assert "Traceback" not in out.stderr
    lines = out.stderr.strip().splitlines()
    assert lines[-1].startswith("error: ") and message in lines[-1], out.stderr


def test_help_lists_sglang_flags():
    out = subprocess.run(
        [sys.executable, "-m", "serving.launch_server", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0
    for flag in (
        "--mem-fraction-static",
        "--disaggregation-mode",
        "--cuda-graph-max-bs-decode",
        "--disaggregation-decode-enable-radix-cache",
    ):
        assert flag in out.stdout


def test_sigterm_drains_and_leaves_no_orphan(tiny_ckpt, tmp_path):
    srv = Server(tiny_ckpt, log_dir=tmp_path)
    children = srv.children()
    assert children, "the scheduler process should be a child of the front"
    got: dict[str, object] = {"lines": []}
    streaming = threading.Event()

    def stream() -> None:
        body = {
            "input_ids": [5] * 20,
            "stream": True,
            "sampling_params": {"max_new_tokens": 24, "ignore_eos": True},
        }
        try:
            with httpx.stream("POST", srv.url + "/generate", json=body, timeout=60) as r:
                for ln in r.iter_lines():
                    if ln.startswith("data: "):
                        got["lines"].append(ln)
                        streaming.set()
        except httpx.HTTPError as exc:
            got["error"] = exc
        streaming.set()

    t = threading.Thread(target=stream)
    t.start()
    # SIGTERM while the stream is running (not before it started); the rest of its 24 tokens
    # fits in the drain window even on a loaded machine
    assert streaming.wait(timeout=60)
    assert srv.stop() == 0
    t.join(timeout=30)
    lines = got.get("lines", [])
    assert lines and lines[-1] == "data: [DONE]", got  # finished or ended cleanly
    # multiprocessing's resource tracker (a child too) exits on its own once it sees the pipe
    # close, a moment after the front; an orphan would still be there after the grace period
    alive = list(children)

    def all_gone() -> bool:
        alive[:] = [p for p in alive if Path(f"/proc/{p}").exists() and not _is_zombie(p)]
        return not alive

    wait_until(all_gone, 10, 0.1, lambda: f"orphans: {alive}")


def _is_zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z"
    except OSError:
        return True


def test_scheduler_death_is_reported(tiny_ckpt, tmp_path):
    srv = Server(tiny_ckpt, log_dir=tmp_path)
    for pid in srv.children():
        os.kill(pid, signal.SIGKILL)
    wait_until(
        lambda: srv.proc.poll() is not None,
        20,
        0.2,
        "front must not keep serving without a scheduler",
    )
    srv.stop()
