"""Prometheus metrics under sglang-router's names (its `smg_*` set, as the installed
sglang-router 0.3.2 exports them), so its dashboards and alerts read ours: per request counts,
durations and TTFT, updated per request; retries; worker health and load, read from the
registry only when scraped (nothing on the request path).

Where ours differ from sglang-router's:
- `model` is "default": sglang-router takes it from the request's body, which lets a client
  create series without bound.
- `smg_router_ttft_seconds` (sglang-router fills it in gRPC mode only) is the client's time to
  first token: arrival to the first byte of a streamed answer. Workers hold a stream's head
  until its first token, so in PD this covers prefill, the KV handoff and decode's first step.
- `smg_http_*` count the generation routes only.
Ours alone (no sglang-router name): router_worker_requests_total and
router_worker_failures_total per worker, router_active_requests and router_queued_requests.
"""

from __future__ import annotations

from collections.abc import Iterator
from http import HTTPStatus
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from router.admission import Admission
from router.workers import ROLES, WorkerRegistry

# sglang-router 0.3.2's duration buckets (s)
_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 15, 30, 45, 60,
            90, 120, 180, 240)  # fmt: skip
ENDPOINTS = {"/v1/chat/completions": "chat", "/v1/completions": "completions",
             "/v1/responses": "responses", "/generate": "generate"}  # fmt: skip
MODEL = "default"
ROUTER_TYPE = CONNECTION_MODE = "http"  # an HTTP router in front of HTTP workers


def error_code(status: int) -> str:
    """smg_http_responses_total's error_code: empty on success, else the status's name."""
    if status < 400:
        return ""
    if status == 499:
        return "client_closed_request"
    try:
        return HTTPStatus(status).phrase.lower().replace(" ", "_").replace("-", "_")
    except ValueError:
        return "error"


class RouterMetrics:
    def __init__(self, workers: WorkerRegistry, admission: Admission, pd: bool) -> None:
        self.registry = CollectorRegistry()
        self.workers = workers
        self.backend = "pd" if pd else "regular"
        r = self.registry
        route_labels = ["router_type", "backend_type", "connection_mode", "model", "endpoint"]
        self.http_requests = Counter(
            "smg_http_requests", "Generation requests received", ["method", "path"], registry=r
        )
        self.http_duration = Histogram(
            "smg_http_request_duration_seconds", "Request arrival to response end",
            ["method", "path"], buckets=_BUCKETS, registry=r,
        )  # fmt: skip
        self.http_responses = Counter(
            "smg_http_responses", "Responses by status", ["status_code", "error_code"], registry=r
        )
        self.requests = Counter(
            "smg_router_requests", "Requests routed", [*route_labels, "streaming"], registry=r
        )
        self.duration = Histogram(
            "smg_router_request_duration_seconds", "Request arrival to response end",
            route_labels, buckets=_BUCKETS, registry=r,
        )  # fmt: skip
        self.ttft = Histogram(
            "smg_router_ttft_seconds", "Streams: request arrival to the first token's bytes",
            ["router_type", "backend_type", "model", "endpoint"], buckets=_BUCKETS, registry=r,
        )  # fmt: skip
        self.retries = Counter(
            "smg_worker_retries", "Attempts after the first, by the failed worker's role",
            ["worker_type", "endpoint"], registry=r,
        )  # fmt: skip
        self.exhausted = Counter(
            "smg_worker_retries_exhausted", "Requests that failed every attempt",
            ["worker_type", "endpoint"], registry=r,
        )  # fmt: skip
        for role in ROLES:  # every series from the start: a dashboard's rate() sees a 0
            for endpoint in ENDPOINTS.values() if workers.by_role[role] else ():
                self.retries.labels(role, endpoint)
                self.exhausted.labels(role, endpoint)
        r.register(_State(workers, admission))
        self._children: dict[tuple[str, int, bool], tuple[Any, ...]] = {}

    def observe(
        self, route: str, status: int, duration: float, ttft: float | None, streamed: bool
    ) -> None:
        """One generation request is over (`ttft`: when its first bytes went out)."""
        key = (route, status, streamed)
        children = self._children.get(key)
        if children is None:  # labels() costs more than the update itself: look up once
            endpoint = ENDPOINTS[route]
            route_labels = (ROUTER_TYPE, self.backend, CONNECTION_MODE, MODEL, endpoint)
            children = (
                self.http_requests.labels("POST", route),
                self.http_duration.labels("POST", route),
                self.http_responses.labels(str(status), error_code(status)),
                self.requests.labels(*route_labels, "true" if streamed else "false"),
                self.duration.labels(*route_labels),
                self.ttft.labels(ROUTER_TYPE, self.backend, MODEL, endpoint),
            )
            self._children[key] = children
        http_requests, http_duration, responses, requests, duration_h, ttft_h = children
        http_requests.inc()
        http_duration.observe(duration)
        responses.inc()
        requests.inc()
        duration_h.observe(duration)
        if streamed and ttft is not None:
            ttft_h.observe(ttft)

    def retry(self, failed_origin: str, route: str) -> None:
        self.retries.labels(self._role(failed_origin), ENDPOINTS[route]).inc()

    def retries_exhausted(self, failed_origin: str, route: str) -> None:
        self.exhausted.labels(self._role(failed_origin), ENDPOINTS[route]).inc()

    def _role(self, origin: str) -> str:
        worker = self.workers.by_url.get(origin)
        return worker.role if worker is not None else "unknown"

    def text(self) -> bytes:
        return generate_latest(self.registry)


class _State(Collector):
    def __init__(self, workers: WorkerRegistry, admission: Admission) -> None:
        self.workers = workers
        self.admission = admission

    def collect(self) -> Iterator[Metric]:
        health = GaugeMetricFamily("smg_worker_health", "1 while in rotation", labels=["worker"])
        active = GaugeMetricFamily(
            "smg_worker_requests_active", "Requests sent and not finished", labels=["worker"]
        )
        labels = ["worker", "role"]
        sent = CounterMetricFamily("router_worker_requests", "Requests sent", labels=labels)
        failed = CounterMetricFamily(
            "router_worker_failures",
            "Requests ended by a connect error, a disconnect, a timeout or a 5xx",
            labels=labels,
        )
        for w in self.workers.workers:
            health.add_metric([w.url], float(w.healthy))
            active.add_metric([w.url], w.in_flight)
            sent.add_metric([w.url, w.role], w.requests)
            failed.add_metric([w.url, w.role], w.failures)
        yield from (health, active, sent, failed)
        by_type = ["worker_type", "connection_mode"]
        pool = GaugeMetricFamily(
            "smg_worker_pool_size", "Workers configured", labels=[*by_type, "model"]
        )
        checks = CounterMetricFamily(
            "smg_worker_health_checks", "Health probes by outcome", labels=["worker_type", "result"]
        )
        errors = CounterMetricFamily(
            "smg_worker_errors", "Requests failed by a worker", labels=[*by_type, "error_type"]
        )
        for role in ROLES:
            workers = self.workers.by_role[role]
            if not workers:
                continue
            pool.add_metric([role, CONNECTION_MODE, MODEL], len(workers))
            checks.add_metric([role, "success"], sum(w.probes_ok for w in workers))
            checks.add_metric([role, "failure"], sum(w.probes_failed for w in workers))
            failures = sum(w.failures for w in workers)
            errors.add_metric([role, CONNECTION_MODE, "backend_error"], failures)
        yield from (pool, checks, errors)
        yield GaugeMetricFamily(
            "router_active_requests", "Admitted under --max-concurrent-requests",
            value=self.admission.active,
        )  # fmt: skip
        yield GaugeMetricFamily(
            "router_queued_requests", "Waiting for admission", value=len(self.admission.waiting)
        )
