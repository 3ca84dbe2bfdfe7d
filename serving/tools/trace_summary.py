"""A torch-profiler Chrome trace (what /start_profile writes: `.trace.json.gz`, or plain `.json`)
as a small dict: where the window's time went on the GPU and on the host.

    python -m serving.tools.trace_summary TRACE... [--out F.json] [--top N]

- window: wall time of the traced window (first event's start to last event's end);
- gpu: busy time (union of kernel, memcpy and memset intervals over all streams), its fraction
  of the window, busy time per stream ("device:stream"), GPU idle before the first and after the
  last GPU event;
- kernels: the top kernels by total device time (name cut to NAME_CHARS);
- cpu_ops: the top host ranges by self time: CPU ops, record_function ranges and CUDA runtime/
  driver calls, each one's duration less that of those directly inside it on the same thread
  (python_function events, written with with_stack, are left out of both);
- memcpy: calls, device time and bytes per kind (HtoD, DtoH, DtoD, ...; memset as "memset");
  bytes is None where the trace carries none;
- gaps: the longest GPU-idle intervals between GPU events (start offset in the window) and the
  host ranges that spent most of each in themselves rather than in a range inside them: where
  the host kept the GPU waiting, and on what;
- steps: the scheduler's STEP_RANGE ranges (serving/engine/profiler.py): count, wall per step,
  and the GPU busy time inside them.

Times are in the trace's microseconds, reported in ms (and us for per-call means).
"""

from __future__ import annotations

import argparse
import bisect
import gzip
import json
import statistics
import sys
from collections import defaultdict
from pathlib import Path

from serving.engine.profiler import STEP_RANGE

GPU_CATS = frozenset({"kernel", "gpu_memcpy", "gpu_memset"})
HOST_CATS = frozenset({"cpu_op", "user_annotation", "cuda_runtime", "cuda_driver"})
NAME_CHARS = 120
TOP = 25
GAPS = 10
GAP_HOST_RANGES = 3
EPS_US = 1e-3  # exported timestamps are rounded: a child may end this much after its parent


def load(path: str | Path) -> dict:
    """The trace's JSON, gzipped or not (told by its first bytes, not its name)."""
    raw = Path(path).read_bytes()
    if raw[:2] == b"\x1f\x8b":
        raw = gzip.decompress(raw)
    trace = json.loads(raw)
    if isinstance(trace, list):  # the bare-array form of the Chrome trace format
        trace = {"traceEvents": trace}
    if not isinstance(trace, dict) or not isinstance(trace.get("traceEvents"), list):
        raise ValueError(f"{path}: not a Chrome trace (no traceEvents list)")
    return trace


def _number(v) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


def union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Sorted, disjoint intervals covering exactly the given (start, end) ones."""
    merged: list[tuple[float, float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            if end > merged[-1][1]:
                merged[-1] = (merged[-1][0], end)
        else:
            merged.append((start, end))
    return merged


def covered(intervals: list[tuple[float, float]]) -> float:
    return sum(end - start for start, end in intervals)


def intersect(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    """Length of the intersection of two sorted, disjoint interval lists."""
    i = j = 0
    total = 0.0
    while i < len(a) and j < len(b):
        lo, hi = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        total += max(0.0, hi - lo)
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


def short(name: str) -> str:
    return name if len(name) <= NAME_CHARS else name[: NAME_CHARS - 3] + "..."


def _ms(us: float) -> float:
    return round(us / 1000, 3)


def _us(durations: list[float]) -> float:
    return round(statistics.fmean(durations), 2)


def nest(host: list[dict]) -> tuple[list[int | None], list[float]]:
    """Each host range's parent (the innermost range around it on the same (pid, tid), or None)
    and self time (its duration less its direct children's)."""
    parent: list[int | None] = [None] * len(host)
    own = [float(e["dur"]) for e in host]
    by_thread: dict[tuple, list[int]] = defaultdict(list)
    for i, e in enumerate(host):
        by_thread[(e.get("pid"), e.get("tid"))].append(i)
    for indices in by_thread.values():
        indices.sort(key=lambda i: (host[i]["ts"], -host[i]["dur"]))
        stack: list[tuple[int, float]] = []  # (index, end)
        for i in indices:
            start = float(host[i]["ts"])
            end = start + float(host[i]["dur"])
            while stack and start >= stack[-1][1] - EPS_US:
                stack.pop()
            if stack:
                parent[i], parent_end = stack[-1]
                own[parent[i]] -= min(end, parent_end) - start
            stack.append((i, end))
    return parent, [max(0.0, t) for t in own]


def _gaps(
    busy: list[tuple[float, float]], host: list[dict], parent: list[int | None], origin: float
) -> list[dict]:
    """The GAPS longest idle stretches between busy intervals, longest first, each with the
    host ranges that spent most of it in themselves (not in a range inside them)."""
    idle = [(a[1], b[0]) for a, b in zip(busy, busy[1:], strict=False)]
    idle = sorted(sorted(idle, key=lambda g: g[0] - g[1])[:GAPS])  # the longest, in time order
    inside: list[dict[int, float]] = [defaultdict(float) for _ in idle]  # range -> self time
    ends = [end for _, end in idle]
    for i, e in enumerate(host):
        start = float(e["ts"])
        end = start + float(e["dur"])
        k = bisect.bisect_right(ends, start)
        while k < len(idle) and idle[k][0] < end:
            over = min(end, idle[k][1]) - max(start, idle[k][0])
            if over > 0:
                inside[k][i] += over
                if parent[i] is not None:
                    inside[k][parent[i]] -= over
            k += 1
    out = []
    for (start, end), spent in sorted(
        zip(idle, inside, strict=True), key=lambda pair: pair[0][0] - pair[0][1]
    ):
        most = sorted(spent.items(), key=lambda kv: -kv[1])[:GAP_HOST_RANGES]
        ranges = [
            {"name": short(host[i].get("name", "")), "self_ms": _ms(t)} for i, t in most if t > 0
        ]
        out.append({"start_ms": _ms(start - origin), "dur_ms": _ms(end - start), "host": ranges})
    return out


def summarize(trace: dict, step_range: str = STEP_RANGE, top: int = TOP) -> dict:
    """The summary of one loaded trace (see the module's docstring)."""
    events = [
        e
        for e in trace["traceEvents"]
        if isinstance(e, dict)
        and e.get("ph") == "X"
        and _number(e.get("ts"))
        and _number(e.get("dur"))
    ]
    if not events:
        raise ValueError("the trace has no complete (ph X) events")
    origin = min(float(e["ts"]) for e in events)
    window = max(float(e["ts"]) + float(e["dur"]) for e in events) - origin
    gpu = [e for e in events if e.get("cat") in GPU_CATS]
    host = [e for e in events if e.get("cat") in HOST_CATS]

    streams: dict[str, list[tuple[float, float]]] = defaultdict(list)
    kernels: dict[str, list[float]] = defaultdict(list)
    copies: dict[str, dict] = {}
    for e in gpu:
        start, dur = float(e["ts"]), float(e["dur"])
        args = e.get("args") or {}
        stream = f"{args.get('device', e.get('pid'))}:{args.get('stream', e.get('tid'))}"
        streams[stream].append((start, start + dur))
        name = e.get("name", "")
        if e["cat"] == "kernel":
            kernels[short(name)].append(dur)
            continue
        kind = "memset" if e["cat"] == "gpu_memset" else (name.split() + ["?", "?"])[1]
        row = copies.setdefault(kind, {"calls": 0, "total_us": 0.0, "bytes": None})
        row["calls"] += 1
        row["total_us"] += dur
        if _number(args.get("bytes")):
            row["bytes"] = (row["bytes"] or 0) + int(args["bytes"])
    busy = union([iv for ivs in streams.values() for iv in ivs])
    busy_us = covered(busy)

    kernel_rows = sorted(kernels.items(), key=lambda kv: -sum(kv[1]))[:top]
    parent, selfs = nest(host)
    ops: dict[str, list[float]] = defaultdict(lambda: [0, 0.0, 0.0])  # calls, self, total
    for e, own in zip(host, selfs, strict=True):
        row = ops[short(e.get("name", ""))]
        row[0] += 1
        row[1] += own
        row[2] += float(e["dur"])
    op_rows = sorted(ops.items(), key=lambda kv: -kv[1][1])[:top]

    step_walls = [
        (float(e["ts"]), float(e["ts"]) + float(e["dur"]))
        for e in host
        if e.get("cat") == "user_annotation" and e.get("name") == step_range
    ]
    walls = [end - start for start, end in step_walls]
    in_steps = union(step_walls)
    steps = {"range": step_range, "count": len(walls)}
    if walls:
        steps.update(
            total_ms=_ms(sum(walls)),
            mean_ms=_ms(statistics.fmean(walls)),
            p50_ms=_ms(statistics.median(walls)),
            max_ms=_ms(max(walls)),
            gpu_busy_fraction=round(intersect(busy, in_steps) / max(covered(in_steps), 1e-9), 4),
        )
    return {
        "window_ms": _ms(window),
        "gpu": {
            "events": len(gpu),
            "busy_ms": _ms(busy_us),
            "busy_fraction": round(busy_us / window, 4) if window > 0 else 0.0,
            "idle_before_first_ms": _ms(busy[0][0] - origin) if busy else None,
            "idle_after_last_ms": _ms(origin + window - busy[-1][1]) if busy else None,
            "streams": {s: _ms(covered(union(ivs))) for s, ivs in sorted(streams.items())},
        },
        "kernels": [
            {"name": n, "calls": len(d), "total_ms": _ms(sum(d)), "mean_us": _us(d)}
            for n, d in kernel_rows
        ],
        "cpu_ops": {
            "by": "self",
            "top": [
                {"name": n, "calls": c, "self_ms": _ms(s), "total_ms": _ms(t)}
                for n, (c, s, t) in op_rows
            ],
        },
        "memcpy": {
            k: {"calls": r["calls"], "total_ms": _ms(r["total_us"]), "bytes": r["bytes"]}
            for k, r in sorted(copies.items())
        },
        "gaps": _gaps(busy, host, parent, origin),
        "steps": steps,
    }


def summarize_file(path: str | Path, step_range: str = STEP_RANGE, top: int = TOP) -> dict:
    return {"file": Path(path).name, **summarize(load(path), step_range, top)}


def format_summary(s: dict, top: int = 10) -> str:
    """Readable lines: the headline, steps, then the first `top` rows of each table."""
    g = s["gpu"]
    lines = [
        f"{s.get('file', 'trace')}: window {s['window_ms']:.1f} ms, GPU busy {g['busy_ms']:.1f} ms"
        f" ({100 * g['busy_fraction']:.1f}%), {g['events']} GPU events, streams "
        + (", ".join(f"{k} {v:.1f} ms" for k, v in g["streams"].items()) or "none")
    ]
    st = s["steps"]
    if st["count"]:
        gpu = f"; GPU busy {100 * st['gpu_busy_fraction']:.1f}% of step time" if g["events"] else ""
        lines.append(
            f"  steps ({st['range']}): {st['count']}, mean {st['mean_ms']:.2f} ms, p50 "
            f"{st['p50_ms']:.2f}, max {st['max_ms']:.2f}{gpu}"
        )
    else:
        lines.append(f"  steps ({st['range']}): none in the trace")
    if s["kernels"]:
        lines.append("  GPU kernels: total ms | calls | mean us | name")
        lines += [
            f"    {k['total_ms']:10.3f} | {k['calls']:6d} | {k['mean_us']:9.2f} | {k['name']}"
            for k in s["kernels"][:top]
        ]
    lines.append(f"  host ranges by {s['cpu_ops']['by']} time: self ms | total ms | calls | name")
    lines += [
        f"    {o['self_ms']:10.3f} | {o['total_ms']:10.3f} | {o['calls']:6d} | {o['name']}"
        for o in s["cpu_ops"]["top"][:top]
    ]
    for kind, m in s["memcpy"].items():
        size = "" if m["bytes"] is None else f", {m['bytes'] / 2**20:.2f} MiB"
        lines.append(f"  {kind}: {m['calls']} calls, {m['total_ms']:.3f} ms{size}")
    if s["gaps"]:
        lines.append("  longest GPU idle gaps: at ms | length ms | host ranges over it")
        lines += [
            f"    {gap['start_ms']:10.3f} | {gap['dur_ms']:8.3f} | "
            + ", ".join(f"{h['name']} ({h['self_ms']:.3f})" for h in gap["host"])
            for gap in s["gaps"][:top]
        ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m serving.tools.trace_summary",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("traces", nargs="+", type=Path, metavar="TRACE")
    ap.add_argument("--out", type=Path, help="write {trace file name: summary} here as JSON")
    ap.add_argument("--top", type=int, default=TOP, help="rows per table kept (printed: 10)")
    ap.add_argument("--step-range", default=STEP_RANGE, help="record_function name of a step")
    args = ap.parse_args(argv)
    summaries, failed = {}, 0
    for path in args.traces:
        try:
            s = summarize_file(path, args.step_range, args.top)
        except (OSError, ValueError) as e:  # json.JSONDecodeError is a ValueError
            print(f"{path}: {e}", file=sys.stderr)
            failed += 1
            continue
        summaries[path.name] = s
        print(format_summary(s, min(10, args.top)), flush=True)
    if args.out is not None:
        args.out.write_text(json.dumps(summaries, indent=2) + "\n")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
