"""bench/sync_check.py's WaitTracer, on the CPU: a clock stands for the device's sleep."""

import sys
import time

from bench.sync_check import WaitTracer


def _traced(done, launch) -> WaitTracer:
    tracer = WaitTracer(done)
    sys.setprofile(tracer)
    try:
        launch()
    finally:
        sys.setprofile(None)
    return tracer


def _host_work():
    return sum(range(1000))


def test_names_the_call_running_when_the_sleep_ended():
    ends = []

    def waits():
        # the sleep "ends" inside this call: it waited (0.3 s of margin for a paused thread)
        ends.append(time.perf_counter() + 0.3)
        time.sleep(0.6)
        return _host_work()

    def launch():
        _host_work()
        waits()
        _host_work()

    found = _traced(lambda: bool(ends) and time.perf_counter() >= ends[0], launch).found
    assert found is not None
    assert found["call"].startswith("sleep (from tests/test_sync_check.py:"), found
    assert found["ms"] >= 500, found


def test_host_work_that_outlasts_the_sleep_is_named_with_its_own_cost():
    end = time.perf_counter() + 0.2

    def launch():
        for _ in range(400):
            time.sleep(0.001)

    found = _traced(lambda: time.perf_counter() >= end, launch).found
    assert found is not None and found["call"].startswith("sleep ("), found
    assert found["ms"] < 100, found  # one short call, not the 0.2 s before it


def test_a_launch_the_sleep_outlasts_names_nothing():
    assert _traced(lambda: False, lambda: [_host_work() for _ in range(10)]).found is None
