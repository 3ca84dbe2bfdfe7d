"""The operators' view on a real PD stack (prefill + decode + our router on the tiny checkpoint,
KV over Mooncake on loopback; issue 27): after N requests every counter on all three moved by
what it should and the KV transfer metrics moved; the handoff failure counters move when a room's
destinations never come and when a transfer is killed, on either side; every metric our Grafana
dashboard and SGLang's query exists on the running stack.

The stack is this module's own. Its last test kills decode.
"""

from __future__ import annotations

import json
import os
import re
import signal
import threading
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.pd_pair import FAST_TIMEOUTS, PDPair
from tests.router_proc import RouterProc
from tests.server_proc import Server, free_port
from tests.waiting import wait_until

pytest.importorskip("mooncake.engine")

REPO = Path(__file__).resolve().parents[1]
DASHBOARD = REPO / "deploy" / "monitoring" / "grafana" / "dashboards" / "pdserve.json"
SGLANG_DASHBOARD_NAMES = Path(__file__).parent / "data" / "sglang_dashboard_metrics.txt"
PROMPT = list(range(5, 25))
# prefill gives up on a room without destinations after 4 s (test_faults uses the same)
ENV = {**FAST_TIMEOUTS, "SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT": "4"}

Sample = tuple[str, dict[str, str], float]


@pytest.fixture(scope="module")
def stack(tiny_ckpt, tmp_path_factory):
    logs = tmp_path_factory.mktemp("metrics_pd")
    port = free_port()
    flags = ("--disaggregation-mode", "prefill", "--disaggregation-bootstrap-port", str(port))
    started: list = []
    try:
        started.append(Server(tiny_ckpt, *flags, log_dir=logs, env=ENV))
        started.append(Server(tiny_ckpt, "--disaggregation-mode", "decode", log_dir=logs, env=ENV))
        pair = PDPair.join(started[0], port, started[1])
        started.append(RouterProc("--pd-disaggregation", "--prefill", pair.prefill.url, str(port),
                                  "--decode", pair.decode.url, log_dir=logs))  # fmt: skip
        started[-1].wait_ready()
        yield pair, started[-1]
    finally:
        for proc in reversed(started):
            if isinstance(proc, Server) and proc.proc.poll() is None:
                os.kill(proc.proc.pid, signal.SIGCONT)  # a test stopped it: let SIGTERM work
            proc.stop()


def scrape(url: str) -> list[Sample]:
    text = httpx.get(url + "/metrics", timeout=10).text
    families = text_string_to_metric_families(text)
    return [(s.name, s.labels, s.value) for f in families for s in f.samples]


def total(samples: list[Sample], name: str, **labels: str) -> float:
    """The sum of `name`'s samples whose labels include `labels`."""
    return sum(
        v for n, got, v in samples if n == name and all(got.get(k) == x for k, x in labels.items())
    )


_PROMQL_WORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "and", "or",
                 "unless", "offset", "bool", "inf", "nan"}  # fmt: skip


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression reads: strings, label matchers, ranges and
    grouping label lists removed, then every name that is not a function call or a keyword."""
    expr = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)
    expr = re.sub(r"\{[^}]*\}|\[[^\]]*\]", "", expr)
    expr = re.sub(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", "", expr)
    names = set()
    for m in re.finditer(r"[A-Za-z_:][A-Za-z0-9_:]*", expr):
        if not expr[m.end() :].lstrip().startswith("(") and m.group() not in _PROMQL_WORDS:
            names.add(m.group())
    return names


def test_the_promql_reader_finds_every_metric_and_nothing_else() -> None:
    expr = (
        'histogram_quantile(0.99, sum by (le, job) (rate(sglang:x_bucket{a=~"$m",b!="c(d)"}'
        "[$__rate_interval]))) / ignoring(le) group_left up + on (job) rate(y_total[5m])"
    )
    assert metric_names(expr) == {"sglang:x_bucket", "up", "y_total"}


def test_after_n_requests_every_counter_moved_by_what_it_should(stack) -> None:
    pair, router = stack
    urls = {"prefill": pair.prefill.url, "decode": pair.decode.url, "router": router.url}
    before = {role: scrape(url) for role, url in urls.items()}
    n, k, length = 4, 5, len(PROMPT)
    for i in range(n):
        stream = i % 2 == 1
        body = {"prompt": PROMPT, "max_tokens": k, "temperature": 0, "ignore_eos": True,
                "stream": stream}  # fmt: skip
        r = httpx.post(router.url + "/v1/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        if stream:
            assert r.text.rstrip().endswith("data: [DONE]") and '"error"' not in r.text, r.text
        else:
            usage = r.json()["usage"]
            assert (usage["prompt_tokens"], usage["completion_tokens"]) == (length, k)
    # the client has decode's answer; prefill's own may still be on its way to its front
    done = "sglang:num_requests_total"
    wait_until(
        lambda: total(scrape(pair.prefill.url), done) - total(before["prefill"], done) >= n, 30
    )
    after = {role: scrape(url) for role, url in urls.items()}

    def moved(where: str, name: str, **labels: str) -> float:
        return total(after[where], name, **labels) - total(before[where], name, **labels)

    ok = {"status_code": "200"}
    completions = {"endpoint": "completions"}
    want = {
        # decode: k tokens each, the first adopted from prefill, k - 1 gaps, one queue wait
        ("decode", "sglang:num_requests_total"): n,
        ("decode", "sglang:prompt_tokens_total"): n * length,
        ("decode", "sglang:generation_tokens_total"): n * k,
        ("decode", "sglang:time_to_first_token_seconds_count"): n,
        ("decode", "sglang:inter_token_latency_seconds_count"): n * (k - 1),
        ("decode", "sglang:time_per_output_token_seconds_count"): n,
        ("decode", "sglang:e2e_request_latency_seconds_count"): n,
        ("decode", "sglang:queue_time_seconds_count"): n,
        # prefill: one token each, answered once the KV is handed over
        ("prefill", "sglang:num_requests_total"): n,
        ("prefill", "sglang:prompt_tokens_total"): n * length,
        ("prefill", "sglang:generation_tokens_total"): n,
        ("prefill", "sglang:time_to_first_token_seconds_count"): n,
        ("prefill", "sglang:inter_token_latency_seconds_count"): 0,
        ("prefill", "sglang:time_per_output_token_seconds_count"): 0,
        ("prefill", "sglang:e2e_request_latency_seconds_count"): n,
        ("prefill", "sglang:queue_time_seconds_count"): n,
        ("router", "smg_http_requests_total"): n,
        ("router", "smg_http_request_duration_seconds_count"): n,
        ("router", "smg_router_request_duration_seconds_count"): n,
        ("router", "smg_router_ttft_seconds_count"): n // 2,  # the streams
        ("router", "smg_worker_retries_total"): 0,
        ("router", "smg_worker_retries_exhausted_total"): 0,
    }
    for role in ("prefill", "decode"):
        for name in ("sglang:num_aborted_requests_total", "sglang:num_retracted_requests_total",
                     "sglang:num_bootstrap_failed_reqs_total",
                     "sglang:num_transfer_failed_reqs_total"):  # fmt: skip
            want[role, name] = 0
    got = {key: moved(*key) for key in want}
    assert got == want
    assert moved("router", "smg_http_responses_total", **ok) == n
    assert moved("router", "smg_http_requests_total", path="/v1/completions") == n
    for streaming in ("true", "false"):
        labels = {**completions, "streaming": streaming, "backend_type": "pd"}
        assert moved("router", "smg_router_requests_total", **labels) == n // 2
    for role, url in (("prefill", pair.prefill.url), ("decode", pair.decode.url)):
        assert moved("router", "router_worker_requests_total", role=role) == n
        assert total(after["router"], "smg_worker_health", worker=url) == 1
    # the latencies are real: each TTFT is under its request's end-to-end time
    for role in ("prefill", "decode"):
        ttft = moved(role, "sglang:time_to_first_token_seconds_sum")
        assert 0 < ttft <= moved(role, "sglang:e2e_request_latency_seconds_sum")
    assert total(after["decode"], "sglang:gen_throughput") > 0  # tokens in the last 5 s
    # the KV transfer: prefill measured the last handoff; decode sends nothing
    p = after["prefill"]
    for name in ("kv_transfer_total_mb", "kv_transfer_latency_ms", "kv_transfer_speed_gb_s"):
        assert total(p, f"sglang:{name}", engine_type="prefill") > 0, name
        assert total(after["decode"], f"sglang:{name}") == 0, name
    pair.idle()
    idle = {role: scrape(url) for role, url in urls.items() if role != "router"}
    zero = ("num_running_reqs", "num_queue_reqs", "token_usage", "mamba_usage",
            "num_prefill_prealloc_queue_reqs", "num_prefill_inflight_queue_reqs",
            "num_decode_prealloc_queue_reqs", "num_decode_transfer_queue_reqs")  # fmt: skip
    for role, samples in idle.items():
        for name in zero:
            assert total(samples, f"sglang:{name}") == 0, (role, name)
        assert total(samples, "sglang:max_total_num_tokens") > 0


def test_every_dashboard_metric_exists_on_the_running_stack(stack) -> None:
    """Every metric an expression of our dashboard reads, and every one SGLang's dashboard
    reads (tests/data/sglang_dashboard_metrics.txt), is served by a worker or the router."""
    pair, router = stack
    body = {"prompt": PROMPT, "max_tokens": 3, "stream": True}  # every per-route series exists
    assert httpx.post(router.url + "/v1/completions", json=body, timeout=120).status_code == 200
    samples = [s for url in (pair.prefill.url, pair.decode.url, router.url) for s in scrape(url)]
    served = {name for name, _, _ in samples}
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    ours = set().union(*map(metric_names, exprs))
    variables = [v["definition"] for v in dashboard["templating"]["list"]]
    assert variables == ["label_values(sglang:num_running_reqs, model_name)"]  # checked below
    ours.add("sglang:num_running_reqs")
    assert len(ours) > 30 and not ours - served, sorted(ours - served)
    theirs = {}
    for line in SGLANG_DASHBOARD_NAMES.read_text().splitlines():
        if line and not line.startswith("#"):
            name, *labels = line.split()
            theirs[name] = labels
    assert len(theirs) == 10 and not set(theirs) - served, sorted(set(theirs) - served)
    # the model_name label: SGLang's filters and variable, our filters (all sglang:* names)
    needs_model = {n for n, labels in theirs.items() if labels} | {
        n for n in ours if n.startswith("sglang:")
    }
    args = pair.prefill.proc.args
    model_name = args[args.index("--model-path") + 1]  # no --served-model-name
    for name, labels, _ in samples:
        if name in needs_model:
            assert labels.get("model_name") == model_name, (name, labels)


def test_prefill_counts_a_room_whose_destinations_never_came(stack) -> None:
    """A request prefill gets and decode never hears of: it waits in prefill's prealloc queue,
    then fails at the bootstrap timeout (4 s here): a bootstrap failure."""
    pair, _ = stack
    url = pair.prefill.url
    before = scrape(url)
    body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 4}, **pair.bootstrap()}
    answer: list[httpx.Response] = []
    sender = threading.Thread(
        target=lambda: answer.append(httpx.post(url + "/generate", json=body, timeout=60))
    )
    sender.start()
    wait_until(lambda: total(scrape(url), "sglang:num_prefill_prealloc_queue_reqs") == 1, 10)
    sender.join(60)
    assert answer[0].status_code == 504, answer[0].text
    after = scrape(url)
    moved = {
        name: total(after, name) - total(before, name)
        for name in (
            "sglang:num_bootstrap_failed_reqs_total",
            "sglang:num_transfer_failed_reqs_total",
            "sglang:num_aborted_requests_total",
        )  # fmt: skip
    }
    assert list(moved.values()) == [1, 0, 1], moved
    assert total(after, "sglang:num_prefill_prealloc_queue_reqs") == 0
    pair.prefill.idle_pool(30)


def _post(url: str, body: dict, out: list) -> threading.Thread:
    """POST in a thread; its status (0: no answer, the worker died) is appended to `out`."""

    def run() -> None:
        try:
            out.append(httpx.post(url + "/generate", json=body, timeout=120).status_code)
        except httpx.HTTPError:
            out.append(0)

    thread = threading.Thread(target=run)
    thread.start()
    return thread


def test_a_killed_transfer_moves_the_failure_counters(stack) -> None:
    """Decode's side: prefill frozen (SIGSTOP) after decode sent its destinations; decode's
    heartbeat finds prefill dead and fails the rooms whose KV was on its way (transfer
    failures); a new room cannot find prefill (a bootstrap failure). Prefill's side: decode
    killed (kill -9, its scheduler process too) once its destinations went to a frozen
    prefill, which then resumes and writes into nothing (transfer failures). Decode is dead
    after this test."""
    pair, _ = stack
    prefill, decode = pair.prefill, pair.decode
    body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 4, "ignore_eos": True}}
    transfer_queue = "sglang:num_decode_transfer_queue_reqs"
    failed = ("sglang:num_bootstrap_failed_reqs_total", "sglang:num_transfer_failed_reqs_total")
    before = scrape(decode.url)
    statuses: list[int] = []
    os.kill(prefill.proc.pid, signal.SIGSTOP)
    try:
        threads = [_post(decode.url, {**body, **pair.bootstrap()}, statuses) for _ in range(2)]
        wait_until(lambda: total(scrape(decode.url), transfer_queue) == 2, 30)
        for t in threads:
            t.join(120)
        assert statuses == [502, 502]  # the heartbeat's verdict: prefill stopped answering
        after = scrape(decode.url)
        assert [total(after, n) - total(before, n) for n in failed] == [0, 2]
        assert total(after, transfer_queue) == 0
        _post(decode.url, {**body, **pair.bootstrap()}, statuses).join(120)
        assert statuses[-1] == 503  # the lookup of the frozen prefill timed out
        assert total(scrape(decode.url), failed[0]) - total(before, failed[0]) == 1
    finally:
        os.kill(prefill.proc.pid, signal.SIGCONT)
    decode.idle_pool(30)  # the rooms' memory is back: prefill was gone, no write can come

    answers = pair.dispatch("/generate", body, timeout=120)  # decode finds prefill again
    assert [r.status_code for r in answers] == [200, 200]
    before = scrape(prefill.url)
    statuses.clear()
    os.kill(prefill.proc.pid, signal.SIGSTOP)
    try:
        threads = []
        for _ in range(2):
            full = {**body, **pair.bootstrap()}
            threads += [_post(decode.url, full, []), _post(prefill.url, full, statuses)]
        wait_until(lambda: total(scrape(decode.url), transfer_queue) == 2, 30)
        # the scheduler process holds decode's KV memory and Mooncake engine: it goes first
        for pid in [*decode.children(), decode.proc.pid]:
            os.kill(pid, signal.SIGKILL)
        decode.proc.wait()
    finally:
        os.kill(prefill.proc.pid, signal.SIGCONT)
    for t in threads:
        t.join(120)
    assert statuses == [502, 502]  # "KV transfer to decode failed"
    after = scrape(prefill.url)
    assert [total(after, n) - total(before, n) for n in failed] == [0, 2]
    prefill.idle_pool(30)
