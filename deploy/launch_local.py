"""The whole PD stack on one machine, in one command: prefill + decode + router.

    python deploy/launch_local.py                    # the shipped small model, EAGLE 1 step
    python deploy/launch_local.py --tiny             # the random tiny checkpoint (written once)
    python deploy/launch_local.py --model-path DIR --served-model-name GLM-5.3-Flash
    python deploy/launch_local.py --once             # exit after printing the first answer

The workers advertise 127.0.0.1 (SGLANG_HOST_IP) and hand the KV cache over with Mooncake on
loopback TCP. Once all three are healthy it prints the seed's curl (with our model name), sends
that request through the router and prints the answer. Ctrl-C (or SIGTERM) stops the router,
then decode, then prefill, and exits 0.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
TINY = REPO / "models" / "tiny"
SMALL = REPO / "serving" / "assets" / "small_model"  # trained: training/train_small.py
# The seed's flags for the shipped model: EAGLE with the checkpoint's NextN layer (one draft
# step), GLM's reasoning and tool-call parsers.
SMALL_FLAGS = ("--speculative-algorithm EAGLE --speculative-num-steps 1 "
               "--speculative-eagle-topk 1 --speculative-num-draft-tokens 2 "
               "--reasoning-parser glm45 --tool-call-parser glm47")  # fmt: skip
PROMPT = "List three things to check when an HTTP service returns 503."
STOP_TIMEOUT_S = 30
PR_SET_PDEATHSIG = 1


class Interrupted(Exception):
    """SIGINT or SIGTERM arrived."""


class StackError(Exception):
    """The stack could not come up; the message says which process and why."""


@dataclass
class Proc:
    role: str
    cmd: list[str]
    url: str
    ready_path: str
    log_path: Path
    note: str = ""
    popen: subprocess.Popen | None = field(default=None, repr=False)

    def describe(self) -> str:
        return (
            f"  {self.role:<8} {self.url:<24} {self.note:<16} pid {self.popen.pid:<8} "
            f"log {self.log_path}"
        )

    def log_tail(self, lines: int = 20) -> str:
        text = self.log_path.read_text(errors="replace").splitlines()[-lines:]
        return "\n".join("    | " + line for line in text)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="python deploy/launch_local.py",
        description="Prefill + decode + router on this machine (Mooncake over loopback TCP).",
    )
    which = ap.add_mutually_exclusive_group()
    which.add_argument(
        "--model-path",
        help=f"checkpoint directory (default: the shipped small model, {SMALL}, with EAGLE 1 "
        "step and GLM's reasoning and tool-call parsers on both workers)",
    )
    which.add_argument(
        "--tiny",
        action="store_true",
        help=f"serve the random tiny checkpoint instead ({TINY}, written on first use)",
    )
    ap.add_argument(
        "--served-model-name",
        help='model id in the API (default: "small", "tiny", else the directory name)',
    )
    ap.add_argument("--host", default="127.0.0.1", help="the router's bind address")
    ap.add_argument("--port", type=int, default=30000, help="router port (0: any free port)")
    ap.add_argument("--prefill-port", type=int, default=0, help="0: any free port")
    ap.add_argument("--bootstrap-port", type=int, default=0, help="0: any free port")
    ap.add_argument("--decode-port", type=int, default=0, help="0: any free port")
    ap.add_argument("--prefill-args", default="", help="more launch_server flags, one string")
    ap.add_argument("--decode-args", default="", help="more launch_server flags, one string")
    ap.add_argument(
        "--max-tokens",
        type=int,
        help="of the example request (default: the seed's 1024; 256 for the small model, 32 "
        "for the tiny checkpoint, whose random weights answer noise)",
    )
    ap.add_argument("--log-dir", type=Path, help="default: a new directory under the temp dir")
    ap.add_argument("--timeout", type=float, default=900, help="seconds to wait for health")
    ap.add_argument("--once", action="store_true", help="stop after printing the first answer")
    return ap.parse_args(argv)


def take_port(host: str, port: int, what: str) -> int:
    """`port`, or a free one for 0; StackError if it is taken. Free now, not reserved: a process
    that takes it before our worker does makes that worker fail to start, which is reported."""
    with socket.socket() as s:
        try:
            s.bind((host, port))
        except OSError as e:
            raise StackError(
                f"{what} port {port} on {host} is not free ({e.strerror}); "
                "pass another, or 0 for any free port"
            ) from None
        return s.getsockname()[1]


def write_tiny() -> None:
    """Into a scratch directory renamed into place, so an interrupted write leaves nothing."""
    print(f"writing the tiny default checkpoint to {TINY} (first use) ...", flush=True)
    TINY.parent.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix="tiny-", dir=TINY.parent))
    try:
        cmd = [sys.executable, "-m", "serving.tools.tiny_model", str(scratch)]
        if subprocess.run(cmd).returncode != 0:
            raise StackError(f"could not write the tiny checkpoint to {TINY}")
        try:
            scratch.rename(TINY)
        except OSError:
            if not TINY.is_dir():  # else another launcher finished first
                raise
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def model_and_name(args: argparse.Namespace) -> tuple[Path, str]:
    if args.tiny:
        if not TINY.is_dir():
            write_tiny()
        return TINY, args.served_model_name or "tiny"
    if args.model_path is None:
        if not (SMALL / "config.json").is_file():
            raise StackError(f"the shipped small model is missing from {SMALL}")
        return SMALL, args.served_model_name or "small"
    path = Path(args.model_path).resolve()
    if not (path / "config.json").is_file():
        raise StackError(f"--model-path {args.model_path}: no config.json there")
    return path, args.served_model_name or path.name


def build(args: argparse.Namespace, model: Path, name: str, log_dir: Path) -> list[Proc]:
    loop = "127.0.0.1"
    prefill_port = take_port(loop, args.prefill_port, "prefill")
    bootstrap_port = take_port(loop, args.bootstrap_port, "bootstrap")
    decode_port = take_port(loop, args.decode_port, "decode")
    router_port = take_port(args.host, args.port, "router")
    prefill_url, decode_url = f"http://{loop}:{prefill_port}", f"http://{loop}:{decode_port}"

    def worker(mode: str, port: int, flags: list[str], extra: str) -> list[str]:
        return [
            *(sys.executable, "-m", "serving.launch_server", "--model-path", str(model)),
            *("--served-model-name", name, "--host", loop, "--port", str(port)),
            *("--disaggregation-mode", mode, "--disaggregation-transfer-backend", "mooncake"),
            "--enable-metrics",
            *flags,
            *shlex.split(extra),
        ]

    router = [
        *(sys.executable, "-m", "router.launch_router", "--pd-disaggregation"),
        *("--prefill-policy", "round_robin", "--decode-policy", "round_robin"),
        *("--prefill", prefill_url, str(bootstrap_port), "--decode", decode_url),
        *("--host", args.host, "--port", str(router_port)),
        *("--request-timeout-secs", "1800", "--model-path", str(model)),
    ]
    router_host = "127.0.0.1" if args.host in ("0.0.0.0", "::") else args.host
    bootstrap = ["--disaggregation-bootstrap-port", str(bootstrap_port)]
    spec = shlex.split(SMALL_FLAGS) if model == SMALL else []
    return [
        Proc(
            "prefill",
            worker("prefill", prefill_port, [*bootstrap, *spec], args.prefill_args),
            prefill_url,
            "/health",
            log_dir / "prefill.log",
            f"bootstrap {bootstrap_port}",
        ),
        Proc(
            "decode",
            worker("decode", decode_port, spec, args.decode_args),
            decode_url,
            "/health",
            log_dir / "decode.log",
        ),
        Proc(
            "router",
            router,
            f"http://{router_host}:{router_port}",
            "/readiness",
            log_dir / "router.log",
        ),
    ]


def _die_with_launcher() -> None:
    """Runs in each child before exec. The children have their own sessions, so a terminal's
    Ctrl-C reaches only this launcher, which stops them in order; if the launcher is killed
    outright instead, the kernel sends them SIGTERM."""
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def start(proc: Proc) -> None:
    env = dict(os.environ, SGLANG_HOST_IP="127.0.0.1", PYTHONUNBUFFERED="1")
    with open(proc.log_path, "w") as log:
        proc.popen = subprocess.Popen(
            proc.cmd,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
            preexec_fn=_die_with_launcher if sys.platform == "linux" else None,
        )


def check_alive(procs: list[Proc]) -> None:
    for p in procs:
        code = p.popen.poll()
        if code is not None:
            raise StackError(
                f"{p.role} exited with code {code}; the end of {p.log_path}:\n{p.log_tail()}"
            )


def wait_ready(procs: list[Proc], timeout: float, t0: float) -> None:
    waiting = list(procs)
    deadline = time.monotonic() + timeout
    while waiting:
        check_alive(procs)
        for p in list(waiting):
            try:
                ok = httpx.get(p.url + p.ready_path, timeout=2).status_code == 200
            except httpx.HTTPError:
                ok = False
            if ok:
                waiting.remove(p)
                print(
                    f"  {p.role:<8} up after {time.monotonic() - t0:5.1f} s ({p.ready_path} 200)",
                    flush=True,
                )
        if time.monotonic() > deadline:
            names = ", ".join(p.role for p in waiting)
            raise StackError(f"not healthy after {timeout:.0f} s: {names} (see the logs above)")
        time.sleep(0.3)


def example_request(router_url: str, name: str, max_tokens: int) -> tuple[str, dict]:
    """The seed's request with our model name: (the curl line to print, the body)."""
    body = {
        "model": name,
        "messages": [{"role": "user", "content": PROMPT}],
        "temperature": 0,
        "max_tokens": max_tokens,
        "stream": False,
    }
    url = f"{router_url}/v1/chat/completions"
    fields = ",\n".join(f"    {json.dumps(k)}: {json.dumps(v)}" for k, v in body.items())
    data = shlex.quote("{\n" + fields + "\n  }")
    curl = (
        f'curl --fail-with-body --max-time 600 \\\n  "{url}" \\\n'
        f"  -H 'Content-Type: application/json' \\\n  -d {data}"
    )
    return curl, body


def printable(text: str) -> str:
    """Control characters escaped: a model's output must not drive the terminal."""
    return "".join(c if c.isprintable() or c in "\n\t" else ascii(c)[1:-1] for c in text)


def ask(router_url: str, body: dict) -> None:
    t0 = time.monotonic()
    try:
        r = httpx.post(f"{router_url}/v1/chat/completions", json=body, timeout=600)
    except httpx.HTTPError as e:
        raise StackError(f"the example request failed: {e!r}") from None
    if r.status_code != 200:
        raise StackError(f"the example request failed: {r.status_code} {r.text}")
    out = r.json()
    choice = out["choices"][0]
    print(
        f"\nAnswer ({out['usage']['completion_tokens']} tokens, finish_reason "
        f"{choice['finish_reason']}, {time.monotonic() - t0:.1f} s):",
        flush=True,
    )
    reasoning = choice["message"].get("reasoning_content")
    if reasoning:
        print(f"[reasoning] {printable(reasoning)}", flush=True)
    print(printable(choice["message"]["content"] or ""), flush=True)


def stop(procs: list[Proc]) -> None:
    """Router first (no new requests), then decode, then prefill; each gets SIGTERM and
    STOP_TIMEOUT_S to drain, then its whole process group is killed."""
    for p in reversed(procs):
        if p.popen is None:
            continue
        if p.popen.poll() is None:
            p.popen.send_signal(signal.SIGTERM)
            try:
                p.popen.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                os.killpg(p.popen.pid, signal.SIGKILL)
                p.popen.wait()
        code = p.popen.returncode
        see = f", see {p.log_path}" if code != 0 else ""
        print(f"  {p.role:<8} stopped (exit {code}{see})", flush=True)


def _interrupt(signum: int, _frame: object) -> None:
    raise Interrupted(signal.Signals(signum).name)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, _interrupt)
    procs: list[Proc] = []
    try:
        model, name = model_and_name(args)
        log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="pdserve-local-"))
        log_dir.mkdir(parents=True, exist_ok=True)
        procs = build(args, model, name, log_dir)
        print(
            f"\npdserve local stack: model {model} served as {name!r}, logs in {log_dir}",
            flush=True,
        )
        t0 = time.monotonic()
        for p in procs:
            start(p)
            print(p.describe(), flush=True)
        print("waiting until all three are healthy ...", flush=True)
        wait_ready(procs, args.timeout, t0)
        router = procs[-1]
        max_tokens = args.max_tokens or {TINY: 32, SMALL: 256}.get(model, 1024)
        curl, body = example_request(router.url, name, max_tokens)
        print(f"\nTry it (this is the request sent now):\n{curl}", flush=True)
        ask(router.url, body)
        if args.once:
            print("\n--once: stopping.", flush=True)
            return 0
        print(f"\nServing on {router.url}. Ctrl-C stops router, decode and prefill.", flush=True)
        while True:
            check_alive(procs)
            time.sleep(0.5)
    except Interrupted as e:
        print(f"\n{e}: stopping.", flush=True)
        return 0
    except StackError as e:
        print(f"\nerror: {e}", file=sys.stderr, flush=True)
        return 1
    finally:
        # A second Ctrl-C must not cut the orderly stop short (each step is bounded).
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, signal.SIG_IGN)
        stop(procs)


if __name__ == "__main__":
    sys.exit(main())
