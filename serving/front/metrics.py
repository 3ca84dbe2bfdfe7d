"""The worker's /metrics (--enable-metrics): SGLang's metric names, types, units and labels, so
SGLang's Grafana dashboard and alerts work on pdserve unchanged.

Two halves, as SGLang has them:
- per request (SGLang's "tokenizer" metrics, label `model_name`): time to first token,
  inter-token latency, time per output token, end-to-end latency, queue time, and the request
  and token counters. They are observed here as the scheduler's outputs arrive.
- the scheduler's state (SGLang's "scheduler" metrics, labels `model_name`, `engine_type`
  (unified | prefill | decode), `tp_rank`, `pp_rank`): read at scrape time from the last
  SchedulerStats the scheduler sent. Rates and ratios (gen_throughput, spec_accept_length,
  spec_accept_rate, num_retracted_reqs, cache_hit_rate) are taken over the stats of the last
  WINDOW_S seconds: throughput and retractions fall to 0 when the worker idles, a ratio keeps
  its last value while nothing new feeds it (as SGLang's gauges do between its log intervals).

Units and meanings follow SGLang's collector (python/sglang/srt/metrics/collector.py):
time_per_output_token_seconds is per request, (finish - first token) / (tokens - 1);
inter_token_latency_seconds is per token, a gap of n tokens observed n times as gap / n;
spec_accept_rate is accept length / draft tokens per step (steps + 1, the bonus token counted).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from serving.protocol import SchedulerStats, SequenceOutput

WINDOW_S = 5.0

# SGLang's default buckets, seconds
TTFT_BUCKETS = (0.1, 0.2, 0.4, 0.6, 0.8, 1, 2, 4, 6, 8, 10, 20, 40, 60, 80, 100, 200, 400)
E2E_BUCKETS = (*TTFT_BUCKETS, 600, 1200, 1800, 2400)
ITL_BUCKETS = (0.002, 0.004, 0.006, 0.008, 0.01, 0.015, 0.02, 0.025, 0.03, 0.035, 0.04, 0.06,
               0.08, 0.1, 0.2, 0.4, 0.6, 0.8, 1, 2, 4, 6, 8)  # fmt: skip
TPOT_BUCKETS = (0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3,
                0.4, 0.5, 0.75, 1, 2.5)  # fmt: skip
QUEUE_BUCKETS = (0, 0.1, 0.2, 0.5, 1, 2, 3, 4, 5, 10, 15, 20, 30, 40, 50, 60, 70, 80, 90, 100,
                 200, 300, 400, 500, 600, 700, 800, 900, 1000, 1200, 1400, 1600, 1800, 2000,
                 2500, 3000)  # fmt: skip

ENGINE_TYPES = {"null": "unified", "prefill": "prefill", "decode": "decode"}


@dataclass
class RequestTimes:
    """One request's timestamps (time.perf_counter()), as its outputs arrive."""

    created: float
    first_token_at: float | None = None
    last_token_at: float | None = None


class WorkerMetrics:
    def __init__(self, model_name: str, disaggregation_mode: str = "null") -> None:
        self.registry = CollectorRegistry()
        r, labels = self.registry, ["model_name"]

        def histogram(name: str, doc: str, buckets: tuple) -> Histogram:
            return Histogram(name, doc, labels, buckets=buckets, registry=r).labels(model_name)

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, labels, registry=r).labels(model_name)

        self.ttft = histogram(
            "sglang:time_to_first_token_seconds", "Time to first token (s)", TTFT_BUCKETS
        )
        self.itl = histogram(
            "sglang:inter_token_latency_seconds", "Time between output tokens (s)", ITL_BUCKETS
        )
        self.tpot = histogram(
            "sglang:time_per_output_token_seconds",
            "Per request: (finish - first token) / (output tokens - 1) (s)",
            TPOT_BUCKETS,
        )
        self.e2e = histogram(
            "sglang:e2e_request_latency_seconds", "Request arrival to finish (s)", E2E_BUCKETS
        )
        self.queue_time = histogram(
            "sglang:queue_time_seconds",
            "Joining the queue (PD decode: the KV's arrival) to starting to run (s)",
            QUEUE_BUCKETS,
        )
        self.prompt_tokens = counter("sglang:prompt_tokens", "Prompt tokens of finished requests")
        self.generation_tokens = counter(
            "sglang:generation_tokens", "Output tokens of finished requests"
        )
        self.requests = counter("sglang:num_requests", "Finished requests")
        self.aborted = counter("sglang:num_aborted_requests", "Requests finished by an abort")
        self.scheduler = SchedulerCollector(model_name, ENGINE_TYPES[disaggregation_mode])
        r.register(self.scheduler)

    def text(self) -> bytes:
        return generate_latest(self.registry)

    def observe_stats(self, stats: SchedulerStats, now: float) -> None:
        self.scheduler.observe(stats, now)

    def observe_output(self, req: RequestTimes, out: SequenceOutput, now: float) -> None:
        n = len(out.new_token_ids)
        if out.queue_time is not None:
            self.queue_time.observe(out.queue_time)
        if n:
            if req.first_token_at is None:
                self.ttft.observe(now - req.created)
                req.first_token_at = now
            else:
                gap = (now - req.last_token_at) / n
                for _ in range(n):
                    self.itl.observe(gap)
            req.last_token_at = now
        if not out.finished:
            return
        self.requests.inc()
        self.prompt_tokens.inc(out.prompt_tokens)
        self.generation_tokens.inc(out.completion_tokens)
        self.e2e.observe(now - req.created)
        if out.finish_reason is not None and out.finish_reason.kind == "abort":
            self.aborted.inc()
        if out.completion_tokens >= 2 and req.first_token_at is not None:
            self.tpot.observe((now - req.first_token_at) / (out.completion_tokens - 1))


class SchedulerCollector(Collector):
    """The scheduler gauges and counters, computed when scraped."""

    def __init__(self, model_name: str, engine_type: str) -> None:
        self.labels = {"model_name": model_name, "engine_type": engine_type,
                       "tp_rank": "0", "pp_rank": "0"}  # fmt: skip
        # (arrival time, stats) of the last WINDOW_S seconds, plus the one just before them;
        # the counters start at 0 with the scheduler
        self.samples = deque([(float("-inf"), SchedulerStats())])
        self.accept_length = 0.0
        self.cache_hit_rate = 0.0
        self.clock = time.perf_counter  # the clock `observe` is given times of

    def observe(self, stats: SchedulerStats, now: float) -> None:
        """Ratios are updated here, not when scraped, so a value survives a scrape gap."""
        self.samples.append((now, stats))
        self._trim(now)
        first = self.samples[0][1]
        spec_steps = stats.spec_verify_steps - first.spec_verify_steps
        if spec_steps:
            committed = stats.spec_committed_tokens - first.spec_committed_tokens
            self.accept_length = committed / spec_steps
        lookups = stats.cache_lookup_tokens_total - first.cache_lookup_tokens_total
        if lookups:
            hits = stats.cache_hit_tokens_total - first.cache_hit_tokens_total
            self.cache_hit_rate = hits / lookups

    def _trim(self, now: float) -> None:
        while len(self.samples) > 1 and self.samples[1][0] <= now - WINDOW_S:
            self.samples.popleft()

    def window(self, now: float) -> tuple[SchedulerStats, SchedulerStats, float]:
        """(stats at the window's start, the latest stats, the window's length in seconds).
        Stats come whenever they change, so none changed between the first sample and the
        next: the window is at most WINDOW_S long."""
        self._trim(now)
        (t0, first), (_, last) = self.samples[0], self.samples[-1]
        return first, last, min(now - t0, WINDOW_S)

    def collect(self) -> Iterator[Metric]:
        first, s, seconds = self.window(self.clock())
        tokens = s.total_pages * s.page_size
        gauges = {
            "num_running_reqs": (s.running, "Requests running"),
            "num_queue_reqs": (s.queued, "Requests not started (PD: the role's queues too)"),
            "num_used_tokens": (s.used_pages * s.page_size, "KV cache tokens in use (pages)"),
            "max_total_num_tokens": (tokens, "KV cache size in tokens"),
            "token_usage": (s.used_pages / s.total_pages if s.total_pages else 0.0,
                            "Fraction of the KV cache in use"),
            "mamba_usage": (s.used_rows / s.total_rows if s.total_rows else 0.0,
                            "Fraction of the hybrid state pool (request rows: KDA states) in use"),
            "gen_throughput": ((s.decode_tokens_total - first.decode_tokens_total) / seconds
                               if seconds > 0 else 0.0,
                               f"Tokens per second from decode steps, last {WINDOW_S:.0f} s"),
            "cache_hit_rate": (self.cache_hit_rate, "Prompt tokens found in the prefix cache"),
            "spec_accept_length": (self.accept_length,
                                   "EAGLE: tokens committed per request per verify step"),
            "spec_accept_rate": (self.accept_length / (s.spec_num_steps + 1)
                                 if s.spec_num_steps else 0.0,
                                 "EAGLE: accept length / draft tokens per step (steps + 1)"),
            "num_retracted_reqs": (s.retractions - first.retractions,
                                   f"Requests retracted in the last {WINDOW_S:.0f} s"),
            "num_prefill_prealloc_queue_reqs": (s.num_prefill_prealloc_queue_reqs,
                                                "PD prefill: waiting for decode's destinations"),
            "num_prefill_inflight_queue_reqs": (s.num_prefill_inflight_queue_reqs,
                                                "PD prefill: prefilled, KV still being written"),
            "num_decode_prealloc_queue_reqs": (s.num_decode_prealloc_queue_reqs,
                                               "PD decode: finding prefill or waiting for memory"),
            "num_decode_transfer_queue_reqs": (s.num_decode_transfer_queue_reqs,
                                               "PD decode: destinations sent, KV not all here"),
            "kv_transfer_latency_ms": (s.kv_transfer_latency_ms,
                                       "PD prefill, last request: last write ordered to done"),
            "kv_transfer_speed_gb_s": (s.kv_transfer_speed_gb_s,
                                       "PD prefill, last request: bytes / time writes ran"),
            "kv_transfer_total_mb": (s.kv_transfer_total_mb,
                                     "PD prefill, last request: MB written (10^6 B)"),
        }  # fmt: skip
        names, values = list(self.labels), list(self.labels.values())
        for name, (value, doc) in gauges.items():
            gauge = GaugeMetricFamily("sglang:" + name, doc, labels=names)
            gauge.add_metric(values, value)
            yield gauge
        counters = {
            "num_retracted_requests_total": (s.retractions, "Requests retracted"),
            "num_bootstrap_failed_reqs_total": (s.num_bootstrap_failed_reqs_total,
                                                "PD: failed before their KV was on its way"),
            "num_transfer_failed_reqs_total": (s.num_transfer_failed_reqs_total,
                                               "PD: failed while their KV was on its way"),
        }  # fmt: skip
        for name, (value, doc) in counters.items():
            family = CounterMetricFamily("sglang:" + name, doc, labels=names)
            family.add_metric(values, value)
            yield family
