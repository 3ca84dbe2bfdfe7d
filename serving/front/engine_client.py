"""The front's side of the ZMQ link to the scheduler, and the serving metrics it observes.

The front binds a PULL socket at `recv_addr` (SchedulerReady or SchedulerFailed, then
BatchOutput and FlushCacheDone) and connects a PUSH socket to `send_addr` (GenerateRequest,
AbortRequest, FlushCache).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
import uuid
from collections.abc import AsyncIterator

import zmq
import zmq.asyncio
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from serving.protocol import (
    SHUTDOWN,
    AbortRequest,
    BatchOutput,
    FinishReason,
    FlushCache,
    FlushCacheDone,
    GenerateRequest,
    SchedulerFailed,
    SchedulerReady,
    SchedulerStats,
    SequenceOutput,
)

log = logging.getLogger(__name__)

_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0)
_TTFT_BUCKETS += (2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_ITL_BUCKETS = (0.001, 0.002, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075)
_ITL_BUCKETS += (0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
_E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0, 300.0, 600.0)


class EngineUnavailable(RuntimeError):
    """The scheduler cannot take requests (starting, failed, shutting down); an HTTP 503."""


class RidInUse(ValueError):
    """A request reused the rid of a sequence still in flight; an HTTP 409."""


@dataclasses.dataclass
class _Inflight:
    # None once the consumer has gone: outputs are then only counted until the final one.
    queue: asyncio.Queue[SequenceOutput] | None
    created: float
    last_token_at: float | None = None


class EngineMetrics:
    """Prometheus metrics of the requests this front sent, in their own registry."""

    def __init__(self, registry: CollectorRegistry) -> None:
        p = "pdserve:"
        self.requests = Counter(
            p + "requests",
            "Finished requests by finish reason",
            ["finish_reason"],
            registry=registry,
        )
        self.prompt_tokens = Counter(p + "prompt_tokens", "Prompt tokens", registry=registry)
        self.generation_tokens = Counter(
            p + "generation_tokens", "Generated tokens", registry=registry
        )
        self.ttft = Histogram(
            p + "time_to_first_token_seconds",
            "Time to first token",
            buckets=_TTFT_BUCKETS,
            registry=registry,
        )
        self.itl = Histogram(
            p + "inter_token_latency_seconds",
            "Time between output tokens",
            buckets=_ITL_BUCKETS,
            registry=registry,
        )
        self.e2e = Histogram(
            p + "e2e_request_latency_seconds",
            "Request latency, sent to finished",
            buckets=_E2E_BUCKETS,
            registry=registry,
        )
        gauge = lambda name, doc: Gauge(p + name, doc, registry=registry)
        self.running = gauge("num_running_reqs", "Requests running in the scheduler")
        self.queued = gauge("num_queue_reqs", "Requests waiting in the scheduler")
        self.used_rows = gauge("used_rows", "Request rows in use")
        self.total_rows = gauge("total_rows", "Request rows")
        self.used_pages = gauge("used_pages", "KV pages in use")
        self.total_pages = gauge("total_pages", "KV pages")
        self.page_usage = gauge("page_usage", "Fraction of KV pages in use")
        self.retractions = gauge("num_retractions", "Requests retracted so far")
        self.spec_accept_length = gauge(
            "spec_accept_length",
            "EAGLE: mean tokens committed per request per verify step (1 = no draft accepted)",
        )
        self.spec_acceptance_rate = gauge(
            "spec_acceptance_rate", "EAGLE: accepted draft tokens / proposed draft tokens"
        )
        self.spec_num_steps = gauge("spec_num_steps", "EAGLE: draft tokens proposed per step")
        self.cache_hit_rate = gauge(
            "cache_hit_rate", "Prefix cache: prompt tokens served from it / prompt tokens"
        )
        self.cached_tokens = gauge("cached_tokens_total", "Prefix cache: prompt tokens served")
        self.cached_pages = gauge("cached_pages", "Prefix cache: KV pages it holds")
        self.cached_states = gauge("cached_states", "Prefix cache: KDA state snapshots it holds")
        self.total_state_slots = gauge("total_state_slots", "Prefix cache: state snapshot slots")

    def observe_stats(self, stats: SchedulerStats) -> None:
        self.running.set(stats.running)
        self.queued.set(stats.queued)
        self.used_rows.set(stats.used_rows)
        self.total_rows.set(stats.total_rows)
        self.used_pages.set(stats.used_pages)
        self.total_pages.set(stats.total_pages)
        self.page_usage.set(stats.used_pages / stats.total_pages if stats.total_pages else 0.0)
        self.retractions.set(stats.retractions)
        if stats.prompt_tokens_total:
            self.cache_hit_rate.set(stats.cached_tokens_total / stats.prompt_tokens_total)
        self.cached_tokens.set(stats.cached_tokens_total)
        self.cached_pages.set(stats.cached_pages)
        self.cached_states.set(stats.cached_states)
        self.total_state_slots.set(stats.total_state_slots)
        if stats.spec_verify_steps and stats.spec_num_steps:
            accept = stats.spec_committed_tokens / stats.spec_verify_steps
            self.spec_accept_length.set(accept)
            self.spec_acceptance_rate.set((accept - 1) / stats.spec_num_steps)
            self.spec_num_steps.set(stats.spec_num_steps)

    def observe_output(self, req: _Inflight, out: SequenceOutput, now: float) -> None:
        n = len(out.new_token_ids)
        if n:
            self.generation_tokens.inc(n)
            if req.last_token_at is None:
                self.ttft.observe(now - req.created)
            else:
                gap = (now - req.last_token_at) / n
                for _ in range(n):
                    self.itl.observe(gap)
            req.last_token_at = now
        if out.finished:
            self.prompt_tokens.inc(out.prompt_tokens)
            kind = out.finish_reason.kind if out.finish_reason is not None else "unknown"
            self.requests.labels(finish_reason=kind).inc()
            self.e2e.observe(now - req.created)


class EngineClient:
    """Sends requests to the scheduler and routes its outputs to per-rid queues.

    Construct anywhere; `start` must run on the serving event loop.
    """

    def __init__(self, send_addr: str, recv_addr: str) -> None:
        self.send_addr = send_addr
        self.recv_addr = recv_addr
        self.ready: SchedulerReady | None = None
        self.failure: str | None = None
        self.stats: SchedulerStats | None = None
        self.draining = False
        self.registry = CollectorRegistry()
        self.metrics = EngineMetrics(self.registry)
        self._inflight: dict[str, _Inflight] = {}
        self._ctx: zmq.asyncio.Context | None = None
        self._push: zmq.asyncio.Socket | None = None
        self._pull: zmq.asyncio.Socket | None = None
        self._receiver: asyncio.Task[None] | None = None
        self._settled = asyncio.Event()  # set by SchedulerReady or a failure
        self._flushes: dict[str, asyncio.Future[str | None]] = {}

    @property
    def is_ready(self) -> bool:
        return self.ready is not None and self.failure is None and not self.draining

    @property
    def state(self) -> str:
        """One line for /health: why requests are (not) accepted."""
        if self.failure is not None:
            return f"scheduler failed: {self.failure}"
        if self.draining:
            return "server is shutting down"
        return "scheduler is ready" if self.ready is not None else "scheduler is starting"

    async def start(self) -> None:
        self._ctx = zmq.asyncio.Context()
        self._pull = self._ctx.socket(zmq.PULL)
        self._pull.bind(self.recv_addr)
        self._push = self._ctx.socket(zmq.PUSH)
        self._push.connect(self.send_addr)
        self._receiver = asyncio.create_task(self._receive_loop(), name="engine-client-recv")

    async def wait_ready(self) -> SchedulerReady:
        """Wait for SchedulerReady; raise EngineUnavailable if the scheduler failed instead."""
        await self._settled.wait()
        if self.failure is not None or self.ready is None:
            raise EngineUnavailable(self.state)
        return self.ready

    def mark_ready(self, ready: SchedulerReady) -> None:
        self.ready = ready
        self._settled.set()

    def fail(self, message: str) -> None:
        """The scheduler failed or died: finish every request in flight with an abort."""
        log.error("scheduler failed: %s", message)
        self.failure = message
        self._settled.set()
        self._finish_all(message, 503)

    def begin_shutdown(self) -> None:
        """Refuse new requests (/health turns 503); requests in flight go on."""
        self.draining = True

    def end_in_flight(self, message: str) -> None:
        """Abort every request in flight: each finishes now with an abort (a stream ends with
        its error event and [DONE]) instead of being cut when the process exits."""
        self.draining = True
        for rid in list(self._inflight):
            self.abort(rid, message)
        self._finish_all(message, 503)

    async def close(self) -> None:
        """Abort what is still in flight, tell the scheduler to exit, close the sockets."""
        self.end_in_flight("server is shutting down")
        if self._push is not None:
            self._push.send_pyobj(SHUTDOWN)
        if self._receiver is not None:
            self._receiver.cancel()
            await asyncio.gather(self._receiver, return_exceptions=True)
        if self._ctx is not None:
            self._pull.close(linger=0)
            self._push.close(linger=500)
            self._ctx.term()
            self._ctx = None

    def inflight_rids(self) -> list[str]:
        return list(self._inflight)

    async def generate(self, req: GenerateRequest) -> AsyncIterator[SequenceOutput]:
        """The sequence's outputs until the finished one. Closing the iterator early (or
        cancelling its consumer) aborts the sequence in the scheduler."""
        if not self.is_ready or self._push is None:
            raise EngineUnavailable(self.state)
        if req.rid in self._inflight:
            raise RidInUse(f"rid {req.rid!r} is already in use")
        inflight = _Inflight(queue=asyncio.Queue(), created=time.perf_counter())
        self._inflight[req.rid] = inflight
        finished = False
        try:
            await self._push.send_pyobj(req)
            while not finished:
                out = await inflight.queue.get()
                while not out.finished and not inflight.queue.empty():
                    out = _merge(out, inflight.queue.get_nowait())
                finished = out.finished
                yield out
        finally:
            inflight.queue = None
            if not finished and req.rid in self._inflight:
                self.abort(req.rid)

    def abort(self, rid: str, reason: str = "client disconnected") -> bool:
        """Ask the scheduler to finish `rid`; False if it is not in flight."""
        if rid not in self._inflight or self._push is None:
            return False
        # Fire and forget: the send completes on the loop even when called from a `finally`
        # that runs during cancellation.
        self._push.send_pyobj(AbortRequest(rid=rid, reason=reason))
        return True

    async def flush_cache(self, timeout: float = 30.0) -> str | None:
        """Ask the scheduler to empty its prefix cache; None when it did, else why not."""
        if not self.is_ready or self._push is None:
            raise EngineUnavailable(self.state)
        flush = FlushCache(uuid.uuid4().hex)
        done = self._flushes[flush.id] = asyncio.get_running_loop().create_future()
        try:
            await self._push.send_pyobj(flush)
            return await asyncio.wait_for(done, timeout)
        except asyncio.TimeoutError:
            return f"the scheduler did not answer within {timeout:.0f} s"
        finally:
            self._flushes.pop(flush.id, None)

    def metrics_text(self) -> bytes:
        return generate_latest(self.registry)

    async def _receive_loop(self) -> None:
        while True:
            try:
                msg = await self._pull.recv_pyobj()
            except zmq.ZMQError:
                log.exception("the scheduler link is closed")
                return
            except Exception:
                log.exception("could not unpickle a message from the scheduler")
                continue
            if isinstance(msg, BatchOutput):
                self._route(msg)
            elif isinstance(msg, SchedulerReady):
                self.mark_ready(msg)
            elif isinstance(msg, SchedulerFailed):
                self.fail(msg.message)
            elif isinstance(msg, FlushCacheDone):
                done = self._flushes.get(msg.id)
                if done is not None and not done.done():
                    done.set_result(msg.error)
            else:
                log.warning("ignoring an unexpected message: %s", type(msg).__name__)

    def _route(self, batch: BatchOutput) -> None:
        now = time.perf_counter()
        if batch.stats is not None:
            self.stats = batch.stats
            self.metrics.observe_stats(batch.stats)
        for out in batch.outputs:
            inflight = self._inflight.get(out.rid)
            if inflight is None:
                continue
            self.metrics.observe_output(inflight, out, now)
            if out.finished:
                del self._inflight[out.rid]
            if inflight.queue is not None:
                inflight.queue.put_nowait(out)

    def _finish_all(self, message: str, status: int) -> None:
        now = time.perf_counter()
        for rid, inflight in list(self._inflight.items()):
            out = SequenceOutput(
                rid=rid,
                new_token_ids=[],
                finished=True,
                finish_reason=FinishReason.abort(message, status),
            )
            self.metrics.observe_output(inflight, out, now)
            if inflight.queue is not None:
                inflight.queue.put_nowait(out)
        self._inflight.clear()


def _merge(a: SequenceOutput, b: SequenceOutput) -> SequenceOutput:
    """Two consecutive outputs of one sequence as one (a consumer that fell behind)."""
    logprobs = None
    if a.logprobs is not None or b.logprobs is not None:
        logprobs = [*(a.logprobs or []), *(b.logprobs or [])]
    return dataclasses.replace(
        b,
        new_token_ids=a.new_token_ids + b.new_token_ids,
        logprobs=logprobs,
        input_logprobs=a.input_logprobs or b.input_logprobs,
    )
