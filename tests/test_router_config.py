"""RouterConfig: the seed's router command, flag forms, refusals; the package stands apart."""

from __future__ import annotations

import resource
import subprocess
import sys

import pytest

from router.config import RouterConfig

SEED = [
    "--pd-disaggregation",
    "--prefill-policy", "round_robin",
    "--decode-policy", "round_robin",
    "--prefill", "http://10.0.0.1:32171", "28998",
    "--decode", "http://10.0.0.2:32172",
    "--host", "0.0.0.0",
    "--port", "30000",
    "--request-timeout-secs", "1800",
    "--model-path", "/models/GLM-5.3-Flash",
]  # fmt: skip


def test_seed_router_command_parses():
    c = RouterConfig.from_cli(SEED)
    assert c.pd_disaggregation
    assert c.prefill == (("http://10.0.0.1:32171", 28998),)
    assert c.decode == ("http://10.0.0.2:32172",)
    assert c.policy_for == {
        "prefill": "round_robin",
        "decode": "round_robin",
        "regular": "round_robin",
    }
    assert (c.host, c.port, c.request_timeout_secs) == ("0.0.0.0", 30000, 1800.0)
    assert c.model_path == "/models/GLM-5.3-Flash"


def test_prefill_bootstrap_port_forms_and_repeats():
    c = RouterConfig.from_cli(
        ["--pd-disaggregation", "--prefill", "http://a:1", "--prefill", "http://b:2", "none",
         "--prefill", "http://c:3", "8999", "--decode", "http://d:4", "--decode", "http://e:5",
         "--policy", "cache_aware", "--decode-policy", "power_of_two"]
    )  # fmt: skip
    assert c.prefill == (("http://a:1", None), ("http://b:2", None), ("http://c:3", 8999))
    assert c.decode == ("http://d:4", "http://e:5")
    assert c.policy_for["prefill"] == "cache_aware"
    assert c.policy_for["decode"] == "power_of_two"


def test_plain_mode_and_reliability_flags():
    c = RouterConfig.from_cli(
        ["--worker-urls", "http://a:1", "http://b:2", "--policy", "random",
         "--health-check-interval-secs", "0.5", "--health-failure-threshold", "1",
         "--health-success-threshold", "1", "--health-check-timeout-secs", "2",
         "--retry-max-retries", "2", "--max-concurrent-requests", "8", "--queue-size", "4",
         "--queue-timeout-secs", "3", "--prometheus-port", "29000", "--log-level", "warn",
         "--max-payload-size", "1024"]
    )  # fmt: skip
    assert not c.pd_disaggregation and c.worker_urls == ("http://a:1", "http://b:2")
    assert (c.health_check_interval_secs, c.health_failure_threshold) == (0.5, 1)
    assert (c.max_retries, c.max_concurrent_requests, c.queue_size) == (2, 8, 4)
    assert c.prometheus_port == 29000 and c.max_payload_size == 1024
    assert (
        RouterConfig.from_cli(["--worker-urls", "http://a:1", "--disable-retries"]).max_retries == 0
    )


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--pd-disaggregation", "--decode", "http://d:1"], "needs at least one --prefill"),
        (["--prefill", "http://p:1", "--decode", "http://d:1"], "--worker-urls: needs"),
        (["--pd-disaggregation", "--prefill", "http://p:1", "x", "--decode", "http://d:1"],
         "BOOTSTRAP_PORT is a port number"),
        (["--pd-disaggregation", "--prefill", "http://p:1", "1", "2", "--decode", "http://d:1"],
         "expected URL [BOOTSTRAP_PORT|none]"),
        (["--worker-urls", "https://a:1"], "expected http://HOST:PORT"),
        (["--worker-urls", "http://a:1/v1"], "expected http://HOST:PORT"),
        (["--worker-urls", "http://a:1", "http://a:1"], "named once"),
        (["--worker-urls", "http://a:1", "--policy", "bucket"], "invalid choice"),
        (["--worker-urls", "http://a:1", "--max-concurrent-requests", "0"], "must be >= 1"),
        (["--worker-urls", "http://a:1", "--health-failure-threshold", "0"], "must be >= 1"),
        (["--worker-urls", "http://a:1", "--no-such-flag"], "unrecognized arguments"),
    ],
)  # fmt: skip
def test_bad_flags_exit_with_one_line(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        RouterConfig.from_cli(argv)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_router_imports_neither_torch_nor_the_engine_and_starts_fast():
    code = (
        "import sys, time; t = time.process_time(); import router.launch_router; "
        "print(time.process_time() - t); "
        "bad = [m for m in sys.modules if m.split('.')[0] in "
        "('torch', 'serving', 'workers', 'kernels', 'fastapi', 'httpx')]; print(bad)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    seconds, bad = out.stdout.splitlines()
    assert bad == "[]"
    assert float(seconds) < 1.0  # CPU seconds: a loaded machine does not inflate them


def test_help_lists_sglang_flag_names():
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    out = subprocess.run(
        [sys.executable, "-m", "router.launch_router", "--help"],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    assert (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime) < 5
    for flag in ("--pd-disaggregation", "--prefill URL [BOOTSTRAP_PORT ...]", "--decode URL",
                 "--worker-urls", "--prefill-policy", "--request-timeout-secs",
                 "--health-check-interval-secs", "--retry-max-retries", "--queue-size",
                 "--prometheus-port", "--max-payload-size"):  # fmt: skip
        assert flag in out.stdout
