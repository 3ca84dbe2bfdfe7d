"""Admission of generation requests: at most --max-concurrent-requests at once, then a FIFO
queue of at most --queue-size that a request leaves after --queue-timeout-secs.

Full queue: 429 at once. Waited too long: 408. With no limit (-1) there is no queue and
admission costs nothing.
"""

from __future__ import annotations

import asyncio
from collections import deque

from router.errors import ClientError


class Admission:
    def __init__(self, limit: int, queue_size: int, queue_timeout: float) -> None:
        self.limit = limit  # -1: no limit
        self.queue_size = queue_size
        self.queue_timeout = queue_timeout
        self.active = 0
        self.waiting: deque[asyncio.Future[None]] = deque()

    async def acquire(self) -> None:
        """Raises ClientError 429 (queue full) or 408 (queued too long)."""
        if self.limit < 0:
            return
        if self.active < self.limit:
            self.active += 1
            return
        if len(self.waiting) >= self.queue_size:
            raise ClientError(
                429, f"too many requests: {self.active} running and {len(self.waiting)} queued"
            )
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[None] = loop.create_future()
        self.waiting.append(fut)
        timer = loop.call_later(self.queue_timeout, _expire, fut)
        try:
            await fut  # release() hands its slot over: `active` is already counted
        except BaseException:
            if fut.done() and not fut.cancelled() and fut.exception() is None:
                self.release()  # the slot arrived together with a cancellation: give it on
            elif fut in self.waiting:
                self.waiting.remove(fut)
            raise
        finally:
            timer.cancel()

    def release(self) -> None:
        if self.limit < 0:
            return
        while self.waiting:
            fut = self.waiting.popleft()
            if not fut.done():
                fut.set_result(None)
                return
        self.active -= 1


def _expire(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_exception(ClientError(408, "timed out waiting in the router's queue"))
