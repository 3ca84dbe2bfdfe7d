"""pytest plugin for device calls (`-p bench.instafail`): each failure's report is
printed as its test ends. pytest prints them at the session's end, which a call cut off by its
time limit never reaches."""


def pytest_runtest_logreport(report):
    if report.failed:
        print(f"\n--- {report.nodeid} failed ({report.when}):\n{report.longreprtext}\n", flush=True)
