"""Prometheus metrics: per-route request counts and latencies, updated per request; worker
health and load, read from the registry only when scraped (nothing on the request path)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from router.admission import Admission
from router.workers import WorkerRegistry

_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30,
            60, 120, 300, 600, 1800)  # fmt: skip


class RouterMetrics:
    def __init__(self, workers: WorkerRegistry, admission: Admission) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "router_requests", "Requests answered, by route and status", ["route", "status"],
            registry=r,
        )  # fmt: skip
        self.duration = Histogram(
            "router_request_duration_seconds", "Request arrival to response end", ["route"],
            buckets=_BUCKETS, registry=r,
        )  # fmt: skip
        self.ttfb = Histogram(
            "router_time_to_first_byte_seconds", "Request arrival to the first response byte",
            ["route"], buckets=_BUCKETS, registry=r,
        )  # fmt: skip
        self.retries = Counter("router_retries", "Attempts after the first", registry=r)
        r.register(_State(workers, admission))
        self._children: dict[tuple[str, int], tuple[Any, Any, Any]] = {}

    def observe(self, route: str, status: int, duration: float, ttfb: float | None) -> None:
        children = self._children.get((route, status))
        if children is None:  # labels() costs more than the update itself: look up once
            children = (self.requests.labels(route, str(status)), self.duration.labels(route),
                        self.ttfb.labels(route))  # fmt: skip
            self._children[route, status] = children
        requests, duration_h, ttfb_h = children
        requests.inc()
        duration_h.observe(duration)
        if ttfb is not None:
            ttfb_h.observe(ttfb)

    def text(self) -> bytes:
        return generate_latest(self.registry)


class _State(Collector):
    def __init__(self, workers: WorkerRegistry, admission: Admission) -> None:
        self.workers = workers
        self.admission = admission

    def collect(self) -> Iterator[Metric]:
        labels = ["worker", "role"]
        healthy = GaugeMetricFamily("router_worker_healthy", "1 while in rotation", labels=labels)
        in_flight = GaugeMetricFamily(
            "router_worker_in_flight", "Requests sent and not finished", labels=labels
        )
        sent = CounterMetricFamily("router_worker_requests", "Requests sent", labels=labels)
        failed = CounterMetricFamily(
            "router_worker_failures",
            "Requests ended by a connect error, a disconnect, a timeout or a 5xx",
            labels=labels,
        )
        for w in self.workers.workers:
            key = [w.url, w.role]
            healthy.add_metric(key, float(w.healthy))
            in_flight.add_metric(key, w.in_flight)
            sent.add_metric(key, w.requests)
            failed.add_metric(key, w.failures)
        yield from (healthy, in_flight, sent, failed)
        yield GaugeMetricFamily(
            "router_active_requests", "Admitted under --max-concurrent-requests",
            value=self.admission.active,
        )  # fmt: skip
        yield GaugeMetricFamily(
            "router_queued_requests", "Waiting for admission", value=len(self.admission.waiting)
        )
