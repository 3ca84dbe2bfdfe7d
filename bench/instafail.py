"""pytest plugin for device calls (`-p bench.instafail`): each failure's report is printed as
its test ends, and each phase that took 10 s or more with its time. pytest prints both (the
reports, --durations) at the session's end, which a call cut off by its time limit never
reaches."""

SLOW_S = 10.0


def pytest_runtest_logreport(report):
    if report.failed:
        print(f"\n--- {report.nodeid} failed ({report.when}):\n{report.longreprtext}\n", flush=True)
    if report.duration >= SLOW_S:
        print(f"\n--- {report.nodeid} {report.when} took {report.duration:.1f} s\n", flush=True)
