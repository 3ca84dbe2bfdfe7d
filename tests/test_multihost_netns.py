"""Three hosts on one machine: prefill, decode and router each in a network namespace of its own
(10.77.0.1, .2, .3), a client in a fourth (.4), all joined by veth pairs to a bridge in a fifth.
Each process runs the command of its deploy/docker-compose.yml service (through
deploy/compose_command.py), so SGLANG_HOST_IP is its namespace's address and the KV handoff is
Mooncake over TCP between namespaces. Nothing is routed outside the namespaces this test makes.

Then decode's link is cut (mid-stream, and for new requests) and restored: the router answers
clean errors while it is cut, and the same answers as before once it is back.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SUBNET = "10.77.0"
NODES = {"prefill": 1, "decode": 2, "router": 3, "client": 4}
PORTS = {"prefill": 32171, "decode": 32172, "router": 30000}
ROUTER = f"http://{SUBNET}.{NODES['router']}:{PORTS['router']}"
CHAT = ROUTER + "/v1/chat/completions"
REQUEST_TIMEOUT_S = 15
BODY = {
    "model": "tiny",
    "messages": [
        {"role": "user", "content": "List three things to check when an HTTP service returns 503."}
    ],
    "temperature": 0,
    "max_tokens": 8,
    "ignore_eos": True,
}

# Runs in the client namespace: GET (no body) or POST a JSON body; print "STATUS <code>", then
# the response body line by line as it arrives (SSE: one event a line). "STATUS 0 <why>" when
# no response came.
CLIENT = r"""
import sys, urllib.request, urllib.error
url, body, timeout = sys.argv[1], sys.argv[2].encode() or None, float(sys.argv[3])
req = urllib.request.Request(url, body, {"Content-Type": "application/json"})
try:
    resp = urllib.request.urlopen(req, timeout=timeout)
except urllib.error.HTTPError as e:
    resp = e
except OSError as e:
    print("STATUS 0", e, flush=True)
    sys.exit()
print("STATUS", resp.status, flush=True)
for line in resp:
    print(line.decode().rstrip("\n"), flush=True)
"""


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check)


class Network:
    """The namespaces, the bridge and the links; `remove` undoes all of it."""

    def __init__(self) -> None:
        tag = f"pdt{os.getpid()}"
        self.switch = f"{tag}sw"
        self.ns = {role: f"{tag}{role[0]}" for role in NODES}
        self.created: list[str] = []

    def create(self) -> None:
        self.sweep_stale()
        for name in [self.switch, *self.ns.values()]:
            _ip("netns", "add", name)
            self.created.append(name)
        sw = ("-n", self.switch)
        _ip(*sw, "link", "add", "br0", "type", "bridge")
        _ip(*sw, "link", "set", "br0", "up")
        for role, n in NODES.items():
            ns = ("-n", self.ns[role])
            _ip(*sw, "link", "add", self.port(role), "type", "veth",
                "peer", "name", "eth0", "netns", self.ns[role])  # fmt: skip
            _ip(*sw, "link", "set", self.port(role), "master", "br0", "up")
            _ip(*ns, "addr", "add", f"{SUBNET}.{n}/24", "dev", "eth0")
            _ip(*ns, "link", "set", "eth0", "up")
            _ip(*ns, "link", "set", "lo", "up")

    @staticmethod
    def port(role: str) -> str:
        return f"v{role}"

    def link(self, role: str, up: bool) -> None:
        """Plug `role`'s cable into the bridge, or pull it (its side sees no carrier)."""
        _ip("-n", self.switch, "link", "set", self.port(role), "up" if up else "down")

    def remove(self) -> None:
        for name in reversed(self.created):
            _drop(name)

    @staticmethod
    def sweep_stale() -> None:
        """What an earlier run of this test left when it was killed (its pid is gone)."""
        for line in _ip("netns", "list").stdout.splitlines():
            m = re.fullmatch(r"pdt(\d+)(sw|[pdrc])", line.split()[0])
            if m and not Path(f"/proc/{m.group(1)}").exists():
                _drop(m.group(0))


def _drop(name: str) -> None:
    """Kill what runs in namespace `name` (only this test starts processes there), delete it."""
    for pid in map(int, _ip("netns", "pids", name, check=False).stdout.split()):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    _ip("netns", "del", name, check=False)


def _skip_reason() -> str | None:
    if sys.platform != "linux" or shutil.which("ip") is None:
        return "needs Linux with iproute2 (`ip`)"
    if os.geteuid() != 0:
        return "needs root to create network namespaces"
    probe = f"pdt{os.getpid()}probe"
    made = _ip("netns", "add", probe, check=False)
    if made.returncode != 0:
        return f"cannot create network namespaces here: {made.stderr.strip()}"
    _ip("netns", "del", probe, check=False)
    try:
        import mooncake.engine  # noqa: F401
    except ImportError:
        return "the mooncake transfer engine is not installed"
    return None


def deployment_env(model: Path) -> dict[str, str]:
    """The env file of this deployment: the compose defaults, except what a CPU machine with the
    tiny checkpoint needs, and short timeouts so a cut shows within seconds."""
    return {
        "MODEL_PATH": str(model),
        "SERVED_MODEL_NAME": "tiny",
        "PREFILL_HOST": f"{SUBNET}.{NODES['prefill']}",
        "DECODE_HOST": f"{SUBNET}.{NODES['decode']}",
        "ROUTER_BIND": f"{SUBNET}.{NODES['router']}",
        "CONTEXT_LENGTH": "8192",
        "DECODE_CUDA_GRAPH": "disabled",
        "REQUEST_TIMEOUT_SECS": str(REQUEST_TIMEOUT_S),
        "HEALTH_CHECK_INTERVAL_SECS": "1",
        "HEALTH_CHECK_TIMEOUT_SECS": "1",
        "SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT": "4",
        "SGLANG_DISAGGREGATION_WAITING_TIMEOUT": "20",
        "SGLANG_DISAGGREGATION_HEARTBEAT_INTERVAL": "0.5",
        "SGLANG_DISAGGREGATION_HEARTBEAT_MAX_FAILURE": "2",
    }


class Stack:
    def __init__(self, net: Network, model: Path, logs: Path) -> None:
        self.net = net
        self.logs = logs
        # python3 in the compose commands: this interpreter's (the venv's).
        path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
        env = {**os.environ, **deployment_env(model), "PATH": path, "PYTHONUNBUFFERED": "1"}
        self.procs: dict[str, subprocess.Popen] = {}
        for role in PORTS:
            cmd = [sys.executable, str(REPO / "deploy" / "compose_command.py"), role, "--exec"]
            with open(logs / f"{role}.log", "w") as log:
                self.procs[role] = subprocess.Popen(
                    ["ip", "netns", "exec", net.ns[role], *cmd],
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                    env=env,
                    cwd=REPO,
                )

    def client(self, url: str, body: dict | None, timeout: float = 60) -> subprocess.Popen:
        data = "" if body is None else json.dumps(body)
        args = [sys.executable, "-c", CLIENT, url, data, str(timeout)]
        return subprocess.Popen(
            ["ip", "netns", "exec", self.net.ns["client"], *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )

    def call(
        self, url: str, body: dict | None = None, timeout: float = 60
    ) -> tuple[int, list[str]]:
        """(status, body lines) of one request from the client namespace."""
        proc = self.client(url, body, timeout)
        out, err = proc.communicate(timeout=timeout + 10)
        head, *lines = out.splitlines() or [""]
        assert head.startswith("STATUS"), f"client failed: {out}{err}"
        return int(head.split()[1]), lines

    def wait_status(self, url: str, want: int, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for role, p in self.procs.items():
                assert p.poll() is None, f"{role} exited:\n{self.log(role)}"
            if self.call(url, timeout=2)[0] == want:
                return
            time.sleep(0.5)
        raise AssertionError(f"{url} never answered {want}; router log:\n{self.log('router')}")

    def wait_idle(self, role: str, timeout: float = 30) -> None:
        """Until the worker has no request and every row and page is free again."""
        url = f"http://{SUBNET}.{NODES[role]}:{PORTS[role]}/server_info"
        deadline = time.monotonic() + timeout
        while True:
            status, lines = self.call(url, timeout=5)
            stats = json.loads("\n".join(lines))["internal_states"][0] if status == 200 else {}
            busy = {k: stats.get(k) for k in ("running", "queued", "used_rows", "used_pages")}
            if not any(busy.values()) and status == 200:
                return
            assert time.monotonic() < deadline, f"{role} not idle: {busy}"
            time.sleep(0.5)

    def log(self, role: str) -> str:
        return (self.logs / f"{role}.log").read_text()[-4000:]

    def stop(self) -> dict[str, int | None]:
        for role in ("router", "decode", "prefill"):
            p = self.procs[role]
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
                try:
                    p.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
        return {role: p.returncode for role, p in self.procs.items()}


@pytest.fixture(scope="module")
def stack(tiny_ckpt: Path, tmp_path_factory: pytest.TempPathFactory):
    reason = _skip_reason()
    if reason:
        pytest.skip(reason)
    net = Network()
    try:
        net.create()
        s = Stack(net, tiny_ckpt, tmp_path_factory.mktemp("netns"))
        try:
            s.wait_status(ROUTER + "/readiness", 200, timeout=120)
            yield s
        finally:
            codes = s.stop()
        assert codes == {"prefill": 0, "decode": 0, "router": 0}, codes
    finally:
        net.remove()
        assert not any(n in _ip("netns", "list").stdout for n in net.created)


def sse_events(lines: list[str]) -> list[str]:
    return [ln.removeprefix("data: ") for ln in lines if ln.startswith("data: ")]


def text_of(message: dict) -> str:
    """Reasoning then content (the seed's --reasoning-parser glm45 splits the two)."""
    return (message.get("reasoning_content") or "") + (message.get("content") or "")


def sse_text(events: list[str]) -> str:
    chunks = [json.loads(e) for e in events if e != "[DONE]"]
    choices = [choice for c in chunks if "error" not in c for choice in c["choices"]]
    return "".join(text_of(choice["delta"]) for choice in choices)


def assert_openai_error(status: int, lines: list[str]) -> None:
    assert 500 <= status < 600, (status, lines)
    error = json.loads("\n".join(lines))["error"]
    assert error["message"] and error["code"] == status


def test_chat_across_namespaces_then_decode_cut_off_and_back(stack: Stack) -> None:
    # Through the router, prefill and decode on different "hosts": plain, then streaming.
    status, lines = stack.call(CHAT, BODY)
    assert status == 200, lines
    answer = json.loads("\n".join(lines))
    assert answer["usage"]["completion_tokens"] == BODY["max_tokens"]
    want = text_of(answer["choices"][0]["message"])
    status, lines = stack.call(CHAT, {**BODY, "stream": True})
    events = sse_events(lines)
    assert status == 200 and events[-1] == "[DONE]", lines
    assert sse_text(events) == want

    # Cut decode off while it streams: the stream ends with an error event, then [DONE].
    long = {**BODY, "max_tokens": 400, "stream": True}
    proc = stack.client(CHAT, long, timeout=REQUEST_TIMEOUT_S + 30)
    assert proc.stdout.readline().strip() == "STATUS 200"
    t_cut = None
    lines = []
    for line in proc.stdout:
        lines.append(line.rstrip("\n"))
        if t_cut is None and sse_text(sse_events(lines[-1:])):
            stack.net.link("decode", up=False)
            t_cut = time.monotonic()
    proc.wait(timeout=10)
    events = sse_events(lines)
    assert t_cut is not None, lines
    assert events[-1] == "[DONE]" and "error" in json.loads(events[-2]), events[-3:]
    assert json.loads(events[-2])["error"]["code"] >= 500
    assert time.monotonic() - t_cut < REQUEST_TIMEOUT_S + 10

    # While it is cut: new requests, plain and streaming, get a clean 5xx in bounded time.
    for body in (BODY, {**BODY, "stream": True}):
        t0 = time.monotonic()
        status, lines = stack.call(CHAT, body)
        assert_openai_error(status, lines)
        assert time.monotonic() - t0 < 30
    stack.wait_status(ROUTER + "/readiness", 503, timeout=30)

    # Back: the router admits decode again and the answers are what they were.
    stack.net.link("decode", up=True)
    stack.wait_status(ROUTER + "/readiness", 200, timeout=60)
    status, lines = stack.call(CHAT, BODY)
    assert status == 200, lines
    assert text_of(json.loads("\n".join(lines))["choices"][0]["message"]) == want
    status, lines = stack.call(CHAT, {**BODY, "stream": True})
    assert status == 200 and sse_text(sse_events(lines)) == want, lines
    stack.wait_idle("prefill")
    stack.wait_idle("decode")
