"""The front's side of the ZMQ link to the scheduler; it feeds /metrics (serving/front/metrics.py)
when metrics are on.

The front binds a PULL socket at `recv_addr` (SchedulerReady or SchedulerFailed, then
BatchOutput and ControlReply) and connects a PUSH socket to `send_addr` (GenerateRequest,
AbortRequest, ControlRequest).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import AsyncIterator

import zmq
import zmq.asyncio

from serving.front.metrics import RequestTimes, WorkerMetrics
from serving.protocol import (
    SHUTDOWN,
    AbortRequest,
    BatchOutput,
    ControlReply,
    ControlRequest,
    FinishReason,
    GenerateRequest,
    SchedulerFailed,
    SchedulerReady,
    SchedulerStats,
    SequenceOutput,
)

log = logging.getLogger(__name__)


class EngineUnavailable(RuntimeError):
    """The scheduler cannot take requests (starting, failed, shutting down); an HTTP 503."""


class RidInUse(ValueError):
    """A request reused the rid of a sequence still in flight; an HTTP 409."""


@dataclasses.dataclass
class _Inflight(RequestTimes):
    # None once the consumer has gone: outputs are then only counted until the final one.
    queue: asyncio.Queue[SequenceOutput] | None = None


class EngineClient:
    """Sends requests to the scheduler and routes its outputs to per-rid queues.

    Construct anywhere; `start` must run on the serving event loop. With `metrics` (None:
    --enable-metrics is off) every output and stats message is observed there.
    """

    def __init__(
        self, send_addr: str, recv_addr: str, metrics: WorkerMetrics | None = None
    ) -> None:
        self.send_addr = send_addr
        self.recv_addr = recv_addr
        self.ready: SchedulerReady | None = None
        self.failure: str | None = None
        self.stats: SchedulerStats | None = None
        self.draining = False
        self.metrics = metrics
        self._inflight: dict[str, _Inflight] = {}
        self._ctx: zmq.asyncio.Context | None = None
        self._push: zmq.asyncio.Socket | None = None
        self._pull: zmq.asyncio.Socket | None = None
        self._receiver: asyncio.Task[None] | None = None
        self._settled = asyncio.Event()  # set by SchedulerReady or a failure
        self._controls: dict[str, asyncio.Future[ControlReply]] = {}

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
        inflight = _Inflight(created=time.perf_counter(), queue=asyncio.Queue())
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

    async def control(self, request: ControlRequest, timeout: float = 30.0) -> ControlReply:
        """Send an admin command to the scheduler and wait for its reply (an error reply when
        none comes within `timeout` seconds)."""
        if not self.is_ready or self._push is None:
            raise EngineUnavailable(self.state)
        done = self._controls[request.id] = asyncio.get_running_loop().create_future()
        try:
            await self._push.send_pyobj(request)
            return await asyncio.wait_for(done, timeout)
        except asyncio.TimeoutError:
            error = f"the scheduler did not answer within {timeout:.0f} s"
            return ControlReply(request.id, error=error)
        finally:
            self._controls.pop(request.id, None)

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
            elif isinstance(msg, ControlReply):
                done = self._controls.get(msg.id)
                if done is not None and not done.done():
                    done.set_result(msg)
            else:
                log.warning("ignoring an unexpected message: %s", type(msg).__name__)

    def _route(self, batch: BatchOutput) -> None:
        now = time.perf_counter()
        if batch.stats is not None:
            self.stats = batch.stats
            if self.metrics is not None:
                self.metrics.observe_stats(batch.stats, now)
        for out in batch.outputs:
            inflight = self._inflight.get(out.rid)
            if inflight is None:
                continue
            if self.metrics is not None:
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
            if self.metrics is not None:
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
