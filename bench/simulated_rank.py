"""One device call on one H200 (under 9 minutes): rank 0 of GLM-5.3-Flash at TP8/EP8, run as a
simulated rank (--simulate-rank; docs/DEPLOY.md section 6) at the seed's decode flags.

    # the GPU machine, in the repository root, .whl/ filled by bench/gpu_wheels.sh (fla-core for
    # the fast path, Mooncake for the decode role):
    python3 bench/simulated_rank.py --wheels .whl [--parts server,bench] [--budget-s 510]
    python3 bench/simulated_rank.py --wheels .whl --fp8   # the same rank in block FP8
    # any machine (CPU: the tiny checkpoint at a tiny size, the same code paths, no graphs):
    python bench/simulated_rank.py --model-path DIR --device cpu --seed-flags "..." ...

1. server: the worker (decode role with 32 running + 64 extra rows when Mooncake imports, else a
   plain worker) at the seed's flags; start-up time to /health and its log's phase lines and
   memory plan; one /v1/chat/completions and --concurrent (96) /generate requests at once
   (prompts of --prompt-len random tokens, run locally on the decode role through SGLang's fake
   bootstrap host); /get_server_info's request rows (peak_used_rows); the GPU memory in use.
   Then stopped. Local requests are scheduled like a plain worker's: at most
   --max-running-requests (32) rows at once. The 64 extra rows are taken only by PD transfers
   in flight, so the seed's 96 rows at once need a prefill partner (docs/BENCHMARKS.md, call 2).
2. bench: bench.fast_path's rank stages on the same rank (decode steps with graphs
   at batch 1/8/32 after 4k and 64k tokens, EAGLE's step, one 8,192-token prefill chunk, the
   collectives each step issues with the projected TP8 step, the HBM floor, the per-layer-kind
   profile, the top kernels), in the time left.
--fp8: the real preset's config.json with GLM-5.3-Flash's published quantization_config
(`tiny_model --preset real --fp8`), so both parts build rank R's shard as a CUDA load of the FP8
checkpoint holds it (serving/models/random_init.py): e4m3 weights with float32 block scales for
the projections, dense MLP, shared and routed experts, W8A8 GEMMs and the FP8 fused MoE, minus
the projection shapes the start-up timing finds FP8 not faster for (its "FP8 linear" lines, and
results.json's "fp8": /get_server_info's scheduler.fp8). Run it as its own device call.
Writes under $OUT (or --out): results.json (rewritten after each part), worker.log, rank.jsonl,
plan.txt (serving.tools.plan's prediction for the device's memory). Exit 1 if a part failed.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.pd_bench import install_wheels, prepare_mooncake  # noqa: E402
from deploy.launch_local import Proc, StackError, start, stop, take_port, wait_ready  # noqa: E402
from serving.config import ModelConfig  # noqa: E402

SEED = (
    "--tp-size 8 --ep-size 8 --context-length 69632 --mem-fraction-static 0.70 "
    "--max-running-requests 32 --chunked-prefill-size 8192 --cuda-graph-max-bs-decode 32 "
    "--speculative-algorithm EAGLE --speculative-num-steps 1 --speculative-eagle-topk 1 "
    "--speculative-num-draft-tokens 2"
)
DECODE = "--disaggregation-mode decode --disaggregation-decode-extra-slots 64"
BENCH = (
    "--context-fill mapped --contexts 4096,65536 --batch-sizes 1,8,32 --prefill-tokens 8192 "
    "--no-torch-path --spec-steps 1 "
    "--stages decode,eagle,prefill,collectives,floor,layers,profile"
)
FAKE_BOOTSTRAP = {"bootstrap_host": "2.2.2.2", "bootstrap_room": 0}  # serving.protocol's
LOG_MARKS = (
    "start-up:",
    "memory plan",
    "memory built",
    "SIMULATED",
    "weights per GPU",
    "FP8 linear",
)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="python bench/simulated_rank.py",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--model-path", type=Path, help="default: write the real preset's config")
    ap.add_argument(
        "--fp8",
        action="store_true",
        help="the real preset's config in block FP8 (ignored with --model-path: its config.json "
        "decides)",
    )
    ap.add_argument("--wheels", type=Path, help="install these wheels first (a bare GPU image)")
    ap.add_argument("--site", type=Path, default=Path("/tmp/site"), help="where --wheels go")
    ap.add_argument("--parts", default="server,bench", help="server, bench, or both")
    ap.add_argument("--budget-s", type=float, default=510, help="both parts together")
    ap.add_argument("--server-budget-s", type=float, default=330, help="the server part, at most")
    ap.add_argument("--rank", type=int, default=0, help="the simulated rank")
    ap.add_argument("--seed-flags", default=SEED, help="the worker's flags (default: the seed's)")
    ap.add_argument("--decode-flags", default=DECODE, help="the decode role's (with Mooncake)")
    ap.add_argument("--bench-flags", default=BENCH, help="bench.fast_path's flags")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--prompt-len", type=int, default=1024, help="of the concurrent requests")
    ap.add_argument("--concurrent", type=int, default=96, help="/generate requests at once")
    ap.add_argument("--max-new-tokens", type=int, default=32, help="of every request")
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT") or "rank_out"))
    return ap.parse_args(argv)


class Report:
    def __init__(self, path: Path) -> None:
        self.path, self.data = path, {"errors": {}}

    def __setitem__(self, key: str, value) -> None:
        self.data[key] = value
        self.path.write_text(json.dumps(self.data, indent=2) + "\n")


def real_config(args: argparse.Namespace) -> Path:
    if args.model_path is not None:
        return args.model_path.resolve()
    out = Path("/tmp/glm53-flash-fp8-config" if args.fp8 else "/tmp/glm53-flash-config")
    if not (out / "config.json").is_file():
        cmd = [sys.executable, "-m", "serving.tools.tiny_model", str(out), "--preset", "real"]
        subprocess.run([*cmd, *(["--fp8"] if args.fp8 else [])], check=True)
    return out


def device_memory_gib(device: str) -> float | None:
    if device != "cuda":
        return None
    probe = "import torch; print(torch.cuda.get_device_properties(0).total_memory / 2**30)"
    return float(
        subprocess.run(
            [sys.executable, "-c", probe], capture_output=True, text=True, check=True
        ).stdout
    )


def gpu_memory_used() -> str:
    q = ["nvidia-smi", "--query-gpu=name,memory.used,memory.total", "--format=csv,noheader"]
    try:
        return subprocess.run(q, capture_output=True, text=True, timeout=20).stdout.strip()
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"nvidia-smi: {e}"


def write_plan(args: argparse.Namespace, model: Path, decode: bool) -> None:
    gib = device_memory_gib(args.device) or 141.0
    flags = shlex.split(args.seed_flags)
    keep = {
        "--tp-size",
        "--ep-size",
        "--mem-fraction-static",
        "--context-length",
        "--max-running-requests",
        "--speculative-num-steps",
    }
    if decode:
        flags += shlex.split(args.decode_flags)
        keep.add("--disaggregation-decode-extra-slots")
    plan = [f for i, f in enumerate(flags) if f in keep or (i and flags[i - 1] in keep)]
    cmd = [
        sys.executable,
        "-m",
        "serving.tools.plan",
        "--model-path",
        str(model),
        *plan,
        "--gpu-memory-gib",
        f"{gib:.3f}",
    ]
    r = subprocess.run(cmd, capture_output=True, text=True)
    (args.out / "plan.txt").write_text(" ".join(cmd) + "\n" + r.stdout + r.stderr)


def _post(url: str, body: dict, timeout: float) -> dict:
    t0 = time.monotonic()
    try:
        r = httpx.post(url, json=body, timeout=timeout)
        ok = r.status_code == 200
        out = {"status": r.status_code, "s": round(time.monotonic() - t0, 2)}
        if ok:
            data = r.json()
            out["completion_tokens"] = (data.get("usage") or data.get("meta_info") or {}).get(
                "completion_tokens"
            )
        else:
            out["error"] = r.text[:500]
        return out
    except httpx.HTTPError as e:
        return {"status": None, "error": repr(e)[:500], "s": round(time.monotonic() - t0, 2)}


def server_part(args: argparse.Namespace, model: Path, report: Report, budget: float) -> None:
    decode = _mooncake_imports()
    write_plan(args, model, decode)
    port = take_port("127.0.0.1", 0, "worker")
    url = f"http://127.0.0.1:{port}"
    flags = [*shlex.split(args.seed_flags), *(shlex.split(args.decode_flags) if decode else [])]
    cmd = [
        *(sys.executable, "-m", "serving.launch_server", "--model-path", str(model)),
        *("--served-model-name", "rank", "--port", str(port), "--device", args.device),
        *("--simulate-rank", str(args.rank), *flags),
    ]
    proc = Proc("worker", cmd, url, "/health", args.out / "worker.log")
    result: dict = {"cmd": cmd, "role": "decode" if decode else "plain"}
    t0 = time.monotonic()
    try:
        start(proc)
        wait_ready([proc], budget - 60, t0)
        result["startup_s"] = round(time.monotonic() - t0, 1)
        result["gpu_after_startup"] = gpu_memory_used()
        local = FAKE_BOOTSTRAP if decode else {}
        chat = {
            "model": "rank",
            "messages": [{"role": "user", "content": "List three things to check."}],
            "max_tokens": args.max_new_tokens,
            "temperature": 0,
            **local,
        }
        result["chat"] = _post(url + "/v1/chat/completions", chat, 120)
        vocab = ModelConfig.from_pretrained(str(model)).vocab_size
        result["concurrent"] = concurrent(
            url, args.prompt_len, args.max_new_tokens, vocab, local, args.concurrent
        )
        result["server_info"] = server_info(url)
        result["gpu_after_requests"] = gpu_memory_used()
    except StackError as e:
        report.data["errors"]["server"] = str(e)[:3000]
    finally:
        stop([proc])
        lines = proc.log_path.read_text(errors="replace").splitlines()
        result["log_lines"] = [ln for ln in lines if any(m in ln for m in LOG_MARKS)][:80]
        result["part_s"] = round(time.monotonic() - t0, 1)
        report["server"] = result


def server_info(url: str) -> dict:
    """/get_server_info's simulation warning and the scheduler's request rows (peak_used_rows:
    the most held at once). A failed call is a StackError with its body: run 5 parsed a 500's
    error body as the answer and reported both fields as null."""
    r = httpx.get(url + "/get_server_info", timeout=10)
    if r.status_code != 200:
        raise StackError(f"/get_server_info answered {r.status_code}: {r.text[:1000]}")
    info = r.json()
    stats = info["internal_states"][0]
    keys = ("total_rows", "peak_used_rows", "used_rows", "running", "queued")
    return {
        "simulation": info["simulation"],
        "rows": {k: stats[k] for k in keys},
        "fp8": (info.get("scheduler") or {}).get("fp8"),
    }


def concurrent(url: str, prompt_len: int, new: int, vocab: int, local: dict, n: int) -> dict:
    """`n` /generate requests at once, `new` tokens each: wall time and outcomes. Run locally
    (the fake bootstrap host), at most --max-running-requests of them hold a row at once."""
    import random

    rng = random.Random(0)
    out: list[dict] = []
    lock = threading.Lock()

    def one(i: int) -> None:
        body = {
            "input_ids": [rng.randrange(3, vocab) for _ in range(prompt_len)],
            "sampling_params": {"max_new_tokens": new, "temperature": 0, "ignore_eos": True},
            **local,
        }
        res = _post(url + "/generate", body, 240)
        with lock:
            out.append(res)

    t0 = time.monotonic()
    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    wall = time.monotonic() - t0
    ok = [r for r in out if r["status"] == 200]
    return {
        "requests": n,
        "ok": len(ok),
        "wall_s": round(wall, 2),
        "tokens": sum(r.get("completion_tokens") or 0 for r in ok),
        "errors": [r.get("error") for r in out if r["status"] != 200][:3],
    }


def _mooncake_imports() -> bool:
    probe = "from mooncake.engine import TransferEngine"
    return subprocess.run([sys.executable, "-c", probe], capture_output=True).returncode == 0


def bench_part(args: argparse.Namespace, model: Path, report: Report, budget: float) -> None:
    out = args.out / "rank.jsonl"
    cmd = [
        *(sys.executable, "-m", "bench.fast_path", "--out", str(out)),
        *("--budget-s", str(int(budget - 30)), "--model-path", str(model)),
        *("--simulate-rank", str(args.rank), "--device", args.device),
        *_world(args.seed_flags),
        *shlex.split(args.bench_flags),
    ]
    t0 = time.monotonic()
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=budget)
        tail = (r.stdout + r.stderr)[-3000:]
        if r.returncode != 0:
            report.data["errors"]["bench"] = tail
    except subprocess.TimeoutExpired:
        report.data["errors"]["bench"] = f"over {budget:.0f} s"
        tail = ""
    rows = [json.loads(ln) for ln in out.read_text().splitlines()] if out.is_file() else []
    report["bench"] = {
        "cmd": cmd,
        "s": round(time.monotonic() - t0, 1),
        "rows": rows,
        "tail": tail[-1500:],
    }


def _world(flags: str) -> list[str]:
    f = shlex.split(flags)
    return [
        x
        for i, x in enumerate(f)
        if x in ("--tp-size", "--ep-size") or (i and f[i - 1] in ("--tp-size", "--ep-size"))
    ]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    deadline = time.monotonic() + args.budget_s
    os.chdir(REPO)
    os.environ["PYTHONUNBUFFERED"] = "1"
    args.out.mkdir(parents=True, exist_ok=True)
    report = Report(args.out / "results.json")
    parts = args.parts.split(",")
    if args.wheels is not None:
        install_wheels(args.wheels, args.site)
        if "server" in parts:
            try:
                prepare_mooncake(argparse.Namespace(site=args.site, wheels=args.wheels))
            except StackError as e:  # the plain worker then
                report.data["errors"]["mooncake"] = str(e)[:1000]
    report["gpu"] = gpu_memory_used()
    model = real_config(args)
    if "server" in parts:
        left = deadline - time.monotonic()
        budget = min(args.server_budget_s, left - (120 if "bench" in parts else 10))
        server_part(args, model, report, budget)
    if "bench" in parts:
        bench_part(args, model, report, deadline - time.monotonic() - 10)
    report["total_s"] = round(args.budget_s - (deadline - time.monotonic()), 1)
    print(json.dumps({k: v for k, v in report.data.items() if k != "bench"}, indent=2)[:8000])
    return 1 if report.data["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
