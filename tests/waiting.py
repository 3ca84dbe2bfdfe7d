"""The tests' one way to wait for a state: poll it, with a deadline.

A fixed sleep is either too short on a loaded 2-core machine or needlessly long everywhere
else; a test waits on the state it means (an endpoint's answer, a process state, a counter)
through `wait_until`. Sleeps that remain in tests are the workload itself or a timeout under
test, and say so.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def wait_until(
    predicate: Callable[[], T],
    timeout: float = 20.0,
    interval: float = 0.05,
    what: str | Callable[[], str] = "the condition",
) -> T:
    """Call `predicate` every `interval` s until it returns something true, and return that.
    After `timeout` s an AssertionError names `what` (a callable is read only then, e.g. a
    log's tail). The predicate may raise to fail at once, e.g. when the process it waits on
    has exited."""
    deadline = time.monotonic() + timeout
    while not (value := predicate()):
        if time.monotonic() >= deadline:
            raise AssertionError(f"not within {timeout} s: {what() if callable(what) else what}")
        time.sleep(interval)
    return value
