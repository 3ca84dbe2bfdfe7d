"""serving.tools.trace_summary: the GPU busy union, per-stream time, idle gaps and their host
ranges, memcpy totals and steps on a hand-written trace whose answers are worked out below; the
host self times on a real torch.profiler trace against the profiler's own key_averages; the CLI
over a gzipped trace. (test_server_e2e.py's profile test summarises a worker's real trace.)"""

from __future__ import annotations

import gzip
import json

import pytest

from serving.engine.profiler import STEP_RANGE
from serving.tools.trace_summary import intersect, load, main, summarize, union


def x(cat: str, name: str, ts: float, dur: float, tid: int = 1, **args) -> dict:
    return {"ph": "X", "cat": cat, "name": name, "pid": 0, "tid": tid, "ts": ts, "dur": dur,
            "args": args}  # fmt: skip


def kernel(name: str, ts: float, dur: float, stream: int) -> dict:
    return x("kernel", name, ts, dur, tid=stream, device=0, stream=stream)


# times in us from 1000. GPU: stream 7 runs A [0,10] and A [20,30]; stream 8 runs B [5,15]
# (overlapping A), an HtoD copy [40,45] of 4096 bytes and a memset [50,52]. Busy union:
# [0,15] [20,30] [40,45] [50,52] = 32 us; idle gaps 30-40 (10 us), 15-20 and 45-50 (5 us).
# Host thread 1: two steps [0,60] and [62,72]; in the first, aten::mm [1,31] with two
# cudaLaunchKernel [2,4] [21,23] inside, then cudaStreamSynchronize [31,41].
T0 = 1000.0
TRACE = {
    "traceEvents": [
        {"ph": "M", "name": "process_name", "pid": 0, "tid": 0, "args": {"name": "python"}},
        x("Trace", "PyTorch Profiler (0)", T0, 100),
        kernel("A", T0 + 0, 10, 7),
        kernel("A", T0 + 20, 10, 7),
        kernel("B" * 300, T0 + 5, 10, 8),
        x("gpu_memcpy", "Memcpy HtoD (Pageable -> Device)", T0 + 40, 5, 8, stream=8, bytes=4096),
        x("gpu_memset", "Memset (Device)", T0 + 50, 2, 8, stream=8, bytes=64),
        x("gpu_user_annotation", STEP_RANGE, T0, 60, 7),  # GPU-side copy: not busy time
        x("user_annotation", STEP_RANGE, T0 + 0, 60),
        x("cpu_op", "aten::mm", T0 + 1, 30),
        x("cuda_runtime", "cudaLaunchKernel", T0 + 2, 2),
        x("cuda_runtime", "cudaLaunchKernel", T0 + 21, 2),
        x("cuda_runtime", "cudaStreamSynchronize", T0 + 31, 10),
        x("user_annotation", STEP_RANGE, T0 + 62, 10),
        {"ph": "s", "cat": "ac2g", "name": "ac2g", "pid": 0, "tid": 1, "ts": T0 + 2, "id": 1},
    ]
}


def test_interval_arithmetic():
    assert union([(5, 15), (0, 10), (20, 30), (30, 31), (40, 41)]) == [(0, 15), (20, 31), (40, 41)]
    assert union([(0, 10), (2, 3)]) == [(0, 10)]
    assert intersect([(0, 10), (20, 30)], [(5, 25)]) == 10
    assert intersect([(0, 1)], [(2, 3)]) == 0


def test_summary_of_a_hand_written_trace():
    s = summarize(TRACE)
    assert s["window_ms"] == 0.1
    g = s["gpu"]
    assert (g["events"], g["busy_ms"], g["busy_fraction"]) == (5, 0.032, 0.32)
    assert g["streams"] == {"0:7": 0.02, "0:8": 0.017}
    assert (g["idle_before_first_ms"], g["idle_after_last_ms"]) == (0.0, 0.048)

    assert [k["name"] for k in s["kernels"]] == ["A", "B" * 117 + "..."]
    assert s["kernels"][0] == {"name": "A", "calls": 2, "total_ms": 0.02, "mean_us": 10.0}
    assert s["memcpy"] == {
        "HtoD": {"calls": 1, "total_ms": 0.005, "bytes": 4096},
        "memset": {"calls": 1, "total_ms": 0.002, "bytes": 64},
    }

    ops = {o["name"]: o for o in s["cpu_ops"]["top"]}
    assert s["cpu_ops"]["by"] == "self"
    assert set(ops) == {STEP_RANGE, "aten::mm", "cudaLaunchKernel", "cudaStreamSynchronize"}
    assert ops[STEP_RANGE] == {"name": STEP_RANGE, "calls": 2, "self_ms": 0.03, "total_ms": 0.07}
    assert (ops["aten::mm"]["self_ms"], ops["cudaLaunchKernel"]["calls"]) == (0.026, 2)

    # longest first; the 10 us gap is spent in the synchronize (9) and aten::mm's tail (1),
    # not in the step around them
    assert [(gap["start_ms"], gap["dur_ms"]) for gap in s["gaps"]] == [
        (0.03, 0.01), (0.015, 0.005), (0.045, 0.005),
    ]  # fmt: skip
    assert s["gaps"][0]["host"] == [
        {"name": "cudaStreamSynchronize", "self_ms": 0.009},
        {"name": "aten::mm", "self_ms": 0.001},
    ]
    assert s["gaps"][1]["host"] == [{"name": "aten::mm", "self_ms": 0.005}]
    assert s["gaps"][2]["host"] == [{"name": STEP_RANGE, "self_ms": 0.005}]

    # steps: 60 and 10 us; the GPU is busy 32 of their 70 us (all of it in the first)
    st = s["steps"]
    assert (st["count"], st["mean_ms"], st["max_ms"], st["total_ms"]) == (2, 0.035, 0.06, 0.07)
    assert st["gpu_busy_fraction"] == round(32 / 70, 4)
    assert summarize(TRACE, step_range="nothing")["steps"] == {"range": "nothing", "count": 0}


def test_self_times_match_the_profilers_own(tmp_path):
    torch = pytest.importorskip("torch")
    from torch.profiler import ProfilerActivity, profile, record_function

    model = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.GELU(), torch.nn.Linear(32, 4))
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(3):
            with record_function(STEP_RANGE):
                model(torch.randn(4, 32)).softmax(-1)
    trace = tmp_path / "t.trace.json.gz"
    prof.export_chrome_trace(str(trace))  # gzipped, as the workers' traces
    s = summarize(load(trace))
    expected = {e.key: e for e in prof.key_averages()}
    assert s["window_ms"] > 0 and s["gpu"]["events"] == 0 and s["kernels"] == []
    assert s["steps"]["count"] == 3 and s["steps"]["mean_ms"] > 0
    top = s["cpu_ops"]["top"]
    assert any(o["name"].startswith("aten::") for o in top)
    for o in top:
        e = expected[o["name"]]
        assert o["calls"] == e.count, o
        assert o["self_ms"] == pytest.approx(e.self_cpu_time_total / 1000, abs=2e-3), o


def test_cli_reads_gzip_and_writes_json(tmp_path, capsys):
    trace = tmp_path / "decode-1.5-TP-0.trace.json.gz"
    trace.write_bytes(gzip.compress(json.dumps(TRACE).encode()))
    out = tmp_path / "summary.json"
    assert main([str(trace), "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "GPU busy 0.0 ms (32.0%)" in printed and "cudaStreamSynchronize" in printed
    assert json.loads(out.read_text())[trace.name]["gpu"]["busy_ms"] == 0.032

    bad = tmp_path / "bad.json"
    bad.write_text('{"traceEvents": 3}')
    assert main([str(bad), str(trace)]) == 1  # the bad one named on stderr, the good one still
    captured = capsys.readouterr()
    assert "bad.json: not a Chrome trace" in captured.err and "decode-1.5" in captured.out
