"""The prefill worker's bootstrap server: where decode workers find prefill scheduler ranks.

PUT /route   a prefill rank registers {rank_ip, rank_port, page_size, kv_cache_dtype, ...}
             (register_rank: the prefill scheduler's end)
GET /route   ?prefill_dp_rank=&prefill_cp_rank=&target_tp_rank=&target_pp_rank= (all required)
             all -1: cluster info; else {rank_ip, rank_port} of that rank; 503 until registered
GET /health  200 (decode workers heartbeat this)

Runs in the front process on --disaggregation-bootstrap-port (stdlib HTTP server, one thread
per connection): it must answer even while the scheduler is busy with a long forward.

With --api-key, /route needs "Authorization: Bearer KEY" (401 otherwise): a stranger must not
redirect decode workers to a rank of its own, nor read the cluster's layout. A registration is
checked field by field (400 naming the field) before it replaces anything.
"""

from __future__ import annotations

import hmac
import ipaddress
import json
import logging
import re
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlparse

import httpx

from serving.server_args import ServerArgs

log = logging.getLogger(__name__)

QUERY = ("prefill_dp_rank", "prefill_cp_rank", "target_tp_rank", "target_pp_rank")
CLUSTER_KEYS = (
    "attn_tp_size",
    "simulated_rank",
    "attn_cp_size",
    "dp_size",
    "pp_size",
    "page_size",
    "kv_cache_dtype",
    "layout",
    "model",
    "model_path",
    "prefill_http_port",
)
MAX_BODY = 1 << 20  # a registration is a few KiB (the layout lists every buffer)
MAX_RANK = 1 << 16
SOCKET_TIMEOUT_S = 10.0  # a client that stops sending mid-request loses its thread after this
_HOSTNAME = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9.-]{0,251}[A-Za-z0-9])?$")


class BadRegistration(ValueError):
    pass


def check_registration(info: Any) -> dict[str, Any]:
    """`info` if it is a well-formed rank registration; BadRegistration naming the field."""
    if not isinstance(info, dict):
        raise BadRegistration("the body must be a JSON object")
    ip = info.get("rank_ip")
    if not isinstance(ip, str) or not _is_host(ip):
        raise BadRegistration(f"rank_ip: not an IP address or host name: {ip!r}")
    port = info.get("rank_port")
    if not isinstance(port, int) or isinstance(port, bool) or not 0 < port < 65536:
        raise BadRegistration(f"rank_port: not a port number: {port!r}")
    for key in ("dp_rank", "cp_rank", "tp_rank", "pp_rank"):
        value = info.get(key, 0)
        if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < MAX_RANK:
            raise BadRegistration(f"{key}: not a rank: {value!r}")
    page_size = info.get("page_size")
    if page_size is not None and (not isinstance(page_size, int) or page_size < 1):
        raise BadRegistration(f"page_size: not a positive integer: {page_size!r}")
    if not isinstance(info.get("layout", []), list):
        raise BadRegistration("layout: not a list")
    return info


def register_rank(
    args: ServerArgs,
    rank_ip: str,
    rank_port: int,
    tp_size: int,
    simulated_rank: int | None,
    model: dict[str, Any],
    layout: list,
) -> None:
    """Register a prefill worker's rank 0 with its bootstrap server (PUT /route): its control
    socket and the cluster info decode's handshake compares. The server runs in the front
    process and listens on --host (all interfaces when 0.0.0.0); it may still be starting, so
    the registration is tried for about 5 s."""
    info = {
        "rank_ip": rank_ip,
        "rank_port": rank_port,
        "dp_rank": 0,
        "cp_rank": 0,
        "tp_rank": 0,
        "pp_rank": 0,
        "attn_tp_size": tp_size,
        "simulated_rank": simulated_rank,
        "attn_cp_size": 1,
        "dp_size": 1,
        "pp_size": 1,
        "page_size": args.page_size,
        "kv_cache_dtype": args.kv_cache_dtype,
        "model": model,
        "model_path": args.model_path,
        "layout": layout,
        "prefill_http_port": args.port,
    }
    bind = args.host if args.host not in ("", "0.0.0.0", "::") else "127.0.0.1"
    url = f"http://{bind}:{args.disaggregation_bootstrap_port}/route"
    body = json.dumps(info).encode()
    for attempt in range(50):
        try:
            headers = {"content-type": "application/json"}
            if args.api_key:
                headers["authorization"] = f"Bearer {args.api_key}"
            httpx.put(url, content=body, headers=headers, timeout=5).raise_for_status()
            return
        except httpx.HTTPError as exc:
            if attempt == 49:
                raise RuntimeError(f"cannot register with the bootstrap server {url}") from exc
            time.sleep(0.1)


def _is_host(text: str) -> bool:
    try:
        ipaddress.ip_address(text)
        return True
    except ValueError:
        return bool(_HOSTNAME.match(text))


class BootstrapServer:
    def __init__(self, host: str, port: int, api_key: str | None = None) -> None:
        self.expected = f"Bearer {api_key}".encode() if api_key else None
        self.ranks: dict[tuple[int, int, int, int], dict[str, Any]] = {}
        self.cluster: dict[str, Any] = {}
        self._lock = threading.Lock()
        handler = type("Handler", (_Handler,), {"owner": self})
        self.httpd = ThreadingHTTPServer((host, port), handler)
        self.httpd.daemon_threads = True
        self.thread = threading.Thread(
            target=self.httpd.serve_forever, daemon=True, name="bootstrap-server"
        )

    def start(self) -> None:
        self.thread.start()
        log.info("bootstrap server on %s:%d", *self.httpd.server_address[:2])

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

    def register(self, info: dict[str, Any]) -> None:
        key = tuple(int(info.get(k, 0)) for k in ("dp_rank", "cp_rank", "tp_rank", "pp_rank"))
        with self._lock:
            self.ranks[key] = {"rank_ip": info["rank_ip"], "rank_port": int(info["rank_port"])}
            self.cluster = {k: info.get(k) for k in CLUSTER_KEYS}
        log.info("prefill rank %s registered at %s:%s", key, info["rank_ip"], info["rank_port"])

    def lookup(self, query: dict[str, int]) -> tuple[int, dict[str, Any]]:
        with self._lock:
            if not self.ranks:
                return 503, {"error": "no prefill rank has registered yet"}
            if all(query[k] == -1 for k in QUERY):
                return 200, dict(self.cluster)
            key = tuple(query[k] for k in QUERY)
            if key not in self.ranks:
                return 404, {"error": f"no prefill rank {key}"}
            return 200, dict(self.ranks[key])


class _Handler(BaseHTTPRequestHandler):
    owner: BootstrapServer
    protocol_version = "HTTP/1.1"
    timeout = SOCKET_TIMEOUT_S

    def _authorized(self) -> bool:
        expected = self.owner.expected
        if expected is None:
            return True
        given = (self.headers.get("authorization") or "").encode()
        if hmac.compare_digest(given, expected):
            return True
        self._reply(401, {"error": "invalid or missing API key (Bearer token)"})
        return False

    def log_message(self, fmt: str, *args: Any) -> None:
        log.debug("bootstrap: " + fmt, *args)

    def _reply(self, status: int, body: Any) -> None:
        data = json.dumps(body).encode() if not isinstance(body, bytes) else body
        self.send_response(status)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:  # noqa: N802 (http.server API)
        url = urlparse(self.path)
        if url.path == "/health":
            return self._reply(200, b"OK")
        if url.path != "/route":
            return self._reply(404, {"error": f"no route {url.path}"})
        if not self._authorized():
            return
        params = parse_qs(url.query)
        missing = [k for k in QUERY if k not in params]
        if missing:
            return self._reply(400, {"error": f"missing query parameters: {', '.join(missing)}"})
        try:
            query = {k: int(params[k][0]) for k in QUERY}
        except ValueError:
            return self._reply(400, {"error": "query parameters must be integers"})
        self._reply(*self.owner.lookup(query))

    def do_PUT(self) -> None:  # noqa: N802
        if urlparse(self.path).path != "/route":
            return self._reply(404, {"error": "no such route"})
        if not self._authorized():
            return
        length = self.headers.get("content-length", "")
        if not length.isdigit() or int(length) > MAX_BODY:
            self.close_connection = True
            return self._reply(413, {"error": f"send a content-length of at most {MAX_BODY}"})
        try:
            info = check_registration(json.loads(self.rfile.read(int(length))))
            self.owner.register(info)
        except (ValueError, KeyError, TypeError, RecursionError) as exc:
            return self._reply(400, {"error": f"bad registration: {exc}"})
        self._reply(200, {"status": "ok"})
