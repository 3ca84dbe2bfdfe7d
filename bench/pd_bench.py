"""Time per output token through the whole PD stack: prefill + decode + router as real
processes (Mooncake over loopback TCP), loaded by serving.tools.bench_serving through the
router, for one or more sets of worker flags (e.g. without and with EAGLE).

    # a bare CUDA machine, with .whl/ filled by bench/gpu_wheels.sh:
    python3 bench/pd_bench.py --wheels .whl --build-checkpoint /tmp/bench --preset bench \\
        --worker-args="--max-total-tokens 65536 --cuda-graph-backend-decode full" \\
        --variant base= --variant eagle="--speculative-algorithm EAGLE \\
            --speculative-num-steps 3 --speculative-num-draft-tokens 4" \\
        --bench 1:4 --bench 16:32 --input-len 512 --output-len 128 --out "$OUT"
    # any machine with the project installed (CPU: the tiny checkpoint):
    python bench/pd_bench.py --build-checkpoint /tmp/tinyck --preset tiny --build-device cpu \\
        --variant base= --input-len 32 --output-len 16
    # TTFT of one-image chats: a checkpoint with a vision tower (the bench preset's is
    # GLM-5.3-Flash's, at the preset's text width: 24 blocks of 1024), 448x448 PNGs (256 image
    # tokens each); graphs up to 16 only, the highest concurrency, to shorten the start-up
    python3 bench/pd_bench.py --wheels .whl --build-checkpoint /tmp/benchv --preset bench \\
        --vision --worker-args="--max-running-requests 16 --cuda-graph-max-bs-decode 16 \\
            --cuda-graph-backend-decode full --chunked-prefill-size 8192 \\
            --max-prefill-tokens 8192 --kv-cache-dtype bf16 --skip-server-warmup" \\
        --variant base= --image-size 448 --bench 1:8 --bench 16:32 --output-len 64 \\
        --timeout 300 --bench-timeout 120 --out "$OUT/pdimg"

--wheels installs the wheels there into --site (pip --target, no index) and puts it on the
workers' PYTHONPATH; Debian packages in WHEELS/deb provide the system libraries Mooncake's
engine.so links, linked in only where the machine lacks them. Each variant: start the stack
with --worker-args + the variant's flags on both workers, wait until all three are healthy, one
bench_serving run per --bench CONCURRENCY:REQUESTS (each with prompts of its own: no run finds
another's in the prefill worker's prefix cache), read the decode worker's /metrics and its
request rows (peak held at once), stop the
stack (router, decode, prefill; process groups killed when they do not exit). Writes
OUT/results.json (rewritten after every run), OUT/VARIANT/{prefill,decode,router}.log and, with
--profile-steps, OUT/VARIANT/profile_summary.json (the workers' traces summarised), then
prints a table and the decode worker's speculative-decoding metric lines. --vision builds the
checkpoint with serving.tools.tiny_model --vision; --image-size N makes every run's requests
chats about one N x N drawn image (bench_serving --image-size: a new image per request, so no
run hits another's in the prefill worker's prefix cache; --input-len does not apply), sent to
/generate as image_data or, --image-api chat, to /v1/chat/completions (whose TTFT is exact only
where every token decodes to text: not on the bench preset, see bench_serving). Exit 1 if
any variant failed (the error and its log tail are in results.json and printed).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import re
import shlex
import shutil
import signal
import site
import subprocess
import sys
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from deploy.launch_local import (  # noqa: E402
    Interrupted,
    Proc,
    StackError,
    _interrupt,
    build,
    check_alive,
    start,
    stop,
    wait_ready,
)

# over the worker's life (its /metrics gauges of the same names cover the last seconds only)
SPEC_METRICS = ("spec_accept_length", "spec_accept_rate")
PROMPT_SEEDS = itertools.count(1)  # one per bench_serving run: no run reuses another's prompts


SHARED_DEVICE_FRACTION = 0.4  # per role, unless the worker args give --mem-fraction-static


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="python bench/pd_bench.py",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    model = ap.add_mutually_exclusive_group(required=True)
    model.add_argument("--model-path", type=Path, help="an existing checkpoint")
    model.add_argument(
        "--build-checkpoint",
        type=Path,
        metavar="DIR",
        help="write serving.tools.tiny_model's --preset checkpoint here (kept if DIR has one)",
    )
    ap.add_argument("--preset", default="bench", help="for --build-checkpoint (tiny | bench)")
    ap.add_argument("--build-device", default="cuda", help="for --build-checkpoint")
    ap.add_argument(
        "--vision", action="store_true", help="for --build-checkpoint: with a vision tower"
    )
    ap.add_argument(
        "--image-size",
        type=int,
        default=0,
        metavar="N",
        help="each request a streaming chat with one N x N PNG and a short text (0: token "
        "prompts of --input-len to /generate)",
    )
    ap.add_argument("--image-api", choices=("generate", "chat"), default="generate")
    ap.add_argument("--wheels", type=Path, help="install these wheels first (a bare GPU image)")
    ap.add_argument("--site", type=Path, default=Path("/tmp/site"), help="where --wheels go")
    ap.add_argument(
        "--worker-args",
        default="",
        help='flags for both workers in every variant (write --worker-args="--flag ...")',
    )
    ap.add_argument("--prefill-args", default="", help="more flags for the prefill worker only")
    ap.add_argument("--decode-args", default="", help="more flags for the decode worker only")
    ap.add_argument(
        "--variant",
        action="append",
        metavar="NAME=FLAGS",
        help="a named set of extra flags for both workers (repeatable; default: base=); leading "
        "VAR=VALUE words are environment for the workers, e.g. "
        "--variant legacy='PDSERVE_DEFAULT_STREAM=1 MC_TCP_SLICE_SIZE=4194304'",
    )
    ap.add_argument(
        "--bench",
        action="append",
        metavar="CONCURRENCY:REQUESTS",
        help="one bench_serving run (repeatable; default: 1:4 and 16:32)",
    )
    ap.add_argument("--input-len", type=int, default=512)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT") or "pd_bench_out"))
    ap.add_argument("--timeout", type=float, default=600, help="seconds to wait for health")
    ap.add_argument("--bench-timeout", type=float, default=600, help="seconds per bench run")
    ap.add_argument(
        "--direct",
        action="store_true",
        help="after each run through the router, the same run straight to the workers "
        "(bench_serving --direct: the client does the router's bootstrap), as VARIANT-direct",
    )
    ap.add_argument(
        "--profile-steps",
        type=int,
        default=0,
        metavar="N",
        help="profile N forward steps of prefill and decode (/start_profile, CPU + GPU, no "
        "stacks) of one highest-concurrency run (--profile-run), from --profile-delay-s after "
        "its start; after it, each trace is "
        "summarised (serving.tools.trace_summary) into OUT/VARIANT/profile_summary.json and "
        "the raw traces in OUT/VARIANT/profile are deleted",
    )
    ap.add_argument(
        "--profile-delay-s",
        type=float,
        default=1.0,
        metavar="S",
        help="with --profile-steps: start profiling S seconds into the run, once the load has "
        "reached the workers (0: from its first request; default 1.0)",
    )
    ap.add_argument(
        "--profile-run",
        type=int,
        default=1,
        metavar="K",
        help="with --profile-steps: profile the K-th run at the highest concurrency (default 1; "
        "2 leaves the first loaded run after start-up unprofiled, to compare with the third)",
    )
    ap.add_argument(
        "--keep-traces",
        action="store_true",
        help="with --profile-steps: keep the raw traces too (large: they seldom fit what a "
        "device call brings back)",
    )
    args = ap.parse_args(argv)
    variants = args.variant or ["base="]
    args.variants = []
    for v in variants:
        name, sep, flags = v.partition("=")
        if not sep or not name or not name.replace("-", "").replace("_", "").isalnum():
            ap.error(f"--variant {v!r}: want NAME=FLAGS, NAME of letters, digits, - and _")
        args.variants.append((name, flags))
    args.benches = []
    for b in args.bench or ["1:4", "16:32"]:
        try:
            c, n = (int(x) for x in b.split(":"))
        except ValueError:
            ap.error(f"--bench {b!r}: want CONCURRENCY:REQUESTS")
        args.benches.append((c, n))
    return args


def install_wheels(wheels: Path, target: Path) -> None:
    """The device README's one-liner, and the workers' PYTHONPATH (inherited by children)."""
    found = sorted(str(w) for w in wheels.glob("*.whl"))
    print(f"installing {len(found)} wheels from {wheels} into {target} ...", flush=True)
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile"]
        + ["--no-cache-dir", "--upgrade", "--target", str(target), *found],
        check=True,
    )
    path = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = f"{target}{os.pathsep}{path}" if path else str(target)


def _not_found(lib: Path) -> list[str]:
    out = subprocess.run(["ldd", str(lib)], capture_output=True, text=True).stdout
    return sorted({ln.split()[0] for ln in out.splitlines() if "not found" in ln})


def link_missing_libs(engine: Path, debs: Path, libdir: Path) -> list[str]:
    """Make the system libraries `engine` links loadable: each soname the loader cannot find is
    linked into libdir (put on LD_LIBRARY_PATH) from the Debian packages in `debs` or from the
    CUDA runtime wheels next to torch. Libraries the machine has are left alone. Returns the
    sonames still missing."""
    root = libdir.parent / "debroot"
    root.mkdir(parents=True, exist_ok=True)
    if shutil.which("dpkg-deb") is None:
        print("warning: no dpkg-deb here; the Debian packages are not unpacked", flush=True)
    else:
        for deb in sorted(debs.glob("*.deb")):
            subprocess.run(["dpkg-deb", "-x", str(deb), str(root)], check=True)
    candidates: dict[str, Path] = {}
    nvidia = [Path(p) / "nvidia" for p in site.getsitepackages()]
    for base in [root, *nvidia]:
        if base.is_dir():
            for f in base.rglob("*.so*"):
                candidates.setdefault(f.name, f)
    libdir.mkdir(parents=True, exist_ok=True)
    path = os.environ.get("LD_LIBRARY_PATH")
    os.environ["LD_LIBRARY_PATH"] = f"{libdir}{os.pathsep}{path}" if path else str(libdir)
    linked: list[str] = []
    while True:  # each round can reveal what the newly linked libraries need
        todo = [s for s in _not_found(engine) if s in candidates and s not in linked]
        if not todo:
            break
        for soname in todo:
            (libdir / soname).unlink(missing_ok=True)
            (libdir / soname).symlink_to(candidates[soname].resolve())
            linked.append(soname)
    print(f"Mooncake engine.so: linked {linked or 'nothing'} into {libdir}", flush=True)
    return _not_found(engine)


def prepare_mooncake(args: argparse.Namespace) -> None:
    engine = args.site / "mooncake" / "engine.so"
    debs = args.wheels / "deb"
    if engine.is_file() and debs.is_dir():
        missing = link_missing_libs(engine, debs, args.site.parent / "pdserve-libs" / "lib")
        if missing:
            print(f"warning: engine.so still misses {missing}", flush=True)
    probe = "import torch; from mooncake.engine import TransferEngine; print('mooncake ok')"
    r = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True)
    if r.returncode != 0:
        raise StackError(f"mooncake.engine does not import:\n{r.stderr[-3000:]}")


def checkpoint(args: argparse.Namespace) -> Path:
    if args.model_path is not None:
        if not (args.model_path / "config.json").is_file():
            raise StackError(f"--model-path {args.model_path}: no config.json there")
        return args.model_path.resolve()
    out = args.build_checkpoint.resolve()
    if not (out / "config.json").is_file():
        t0 = time.monotonic()
        cmd = [sys.executable, "-m", "serving.tools.tiny_model", str(out), "--preset", args.preset]
        cmd += ["--device", args.build_device] + (["--vision"] if args.vision else [])
        subprocess.run(cmd, check=True)
        print(f"checkpoint written in {time.monotonic() - t0:.1f} s", flush=True)
    elif args.vision and "vision_config" not in json.loads((out / "config.json").read_text()):
        raise StackError(f"--vision: the checkpoint kept in {out} has no vision tower")
    return out


def environment() -> dict:
    probe = (
        "import json, torch; c = torch.cuda.is_available(); print(json.dumps({'torch': "
        "torch.__version__, 'device': torch.cuda.get_device_name() if c else 'cpu'}))"
    )
    r = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True)
    return json.loads(r.stdout) if r.returncode == 0 else {"probe_error": r.stderr[-500:]}


def run_bench(
    args: argparse.Namespace,
    url: str,
    concurrency: int,
    requests: int,
    extra: tuple = (),
    under_load=None,
) -> dict:
    """One bench_serving run; `under_load()` is called --profile-delay-s after it starts. Each
    run's prompts are new (its own seed): a run after another on the same workers would
    otherwise find its prompts in the prefill worker's prefix cache and skip most of the
    prefill, and the first loaded run would be the only one that computes its prompts."""
    cmd = [sys.executable, "-m", "serving.tools.bench_serving", "--url", url, *extra]
    cmd += ["--concurrency", str(concurrency), "--requests", str(requests)]
    cmd += ["--seed", str(next(PROMPT_SEEDS))]
    cmd += ["--input-len", str(args.input_len), "--output-len", str(args.output_len)]
    cmd += ["--image-size", str(args.image_size), "--image-api", args.image_api]
    bench = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        if under_load is not None:
            time.sleep(args.profile_delay_s)
            under_load()
        out, err = bench.communicate(timeout=args.bench_timeout)
    except subprocess.TimeoutExpired:
        raise StackError(
            f"bench_serving at concurrency {concurrency}: over {args.bench_timeout} s"
        ) from None
    finally:
        if bench.poll() is None:
            bench.kill()
            bench.communicate()
    if bench.returncode != 0:
        raise StackError(f"bench_serving at concurrency {concurrency} failed:\n{err[-3000:]}")
    return json.loads(out.strip().splitlines()[-1])


def spec_metrics(decode_url: str) -> dict[str, float]:
    """EAGLE's acceptance over the decode worker's life, from its scheduler's counters
    (/server_info), with SGLang's definitions (serving/front/metrics.py)."""
    states = httpx.get(decode_url + "/server_info", timeout=10).json().get("internal_states")
    stats = states[0] if states else {}
    if not stats.get("spec_verify_steps") or not stats.get("spec_num_steps"):
        return {}
    length = stats["spec_committed_tokens"] / stats["spec_verify_steps"]
    return {"spec_accept_length": length,
            "spec_accept_rate": length / (stats["spec_num_steps"] + 1)}  # fmt: skip


def decode_rows(decode_url: str) -> dict:
    """The decode worker's request rows: total, peak held at once, still in use (should be 0)."""
    info = httpx.get(decode_url + "/server_info", timeout=10).json()
    stats = info["internal_states"][0]
    return {k: stats[k] for k in ("total_rows", "peak_used_rows", "used_rows", "used_pages")}


def split_env(flags: str) -> tuple[dict[str, str], str]:
    """A variant's leading VAR=VALUE words (environment) and the flags after them."""
    words, env = shlex.split(flags), {}
    while words and re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", words[0]):
        key, _, value = words.pop(0).partition("=")
        env[key] = value
    return env, shlex.join(words)


def run_variant(args: argparse.Namespace, model: Path, name: str, flags: str, report: dict) -> None:
    log_dir = args.out / name
    log_dir.mkdir(parents=True, exist_ok=True)
    env, flags = split_env(flags)
    report.setdefault("variant_env", {})[name] = env
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)  # the workers inherit it at start (launch_local.start)
    try:
        _run_variant(args, model, name, flags, report, log_dir)
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _run_variant(
    args: argparse.Namespace, model: Path, name: str, flags: str, report: dict, log_dir: Path
) -> None:
    worker = f"{args.worker_args} {flags}"
    if "--mem-fraction-static" not in f"{worker} {args.prefill_args} {args.decode_args}":
        # both roles share one device and each sizes its pools against the device's total
        # memory: two of the default 0.8 do not fit (the decode worker fails at start-up)
        worker += f" --mem-fraction-static {SHARED_DEVICE_FRACTION}"
    ns = argparse.Namespace(
        host="127.0.0.1",
        port=0,
        prefill_port=0,
        bootstrap_port=0,
        decode_port=0,
        prefill_args=f"{worker} {args.prefill_args}",
        decode_args=f"{worker} {args.decode_args}",
    )
    procs: list[Proc] = build(ns, model, model.name, log_dir)
    print(f"\n== {name}: workers get {shlex.split(worker)}", flush=True)
    try:
        t0 = time.monotonic()
        for p in procs:
            start(p)
            print(p.describe(), flush=True)
        wait_ready(procs, args.timeout, t0)
        report["startup_s"][name] = round(time.monotonic() - t0, 1)
        router, decode = procs[-1], procs[1]
        top = max(c for c, _ in args.benches)
        top_runs = 0
        for concurrency, requests in args.benches:
            top_runs += concurrency == top
            profiled = concurrency == top and top_runs == args.profile_run and args.profile_steps
            under_load = None
            if profiled:  # once the load is running: its steady state, not its first arrivals
                under_load = lambda: start_profiles(procs, log_dir / "profile", args.profile_steps)  # noqa: E731
            res = run_bench(args, router.url, concurrency, requests, under_load=under_load)
            check_alive(procs)
            report["runs"].append({"variant": name, "flags": flags, **res})
            print(f"  {name} c={concurrency}: {json.dumps(res)}", flush=True)
            write_report(args, report)
            if profiled:
                stop_profiles(procs)
                summarize_profiles(log_dir, args.keep_traces)
            if args.direct:  # the same load without the router: what the router adds
                prefill = procs[0]
                port = prefill.cmd[prefill.cmd.index("--disaggregation-bootstrap-port") + 1]
                extra = ("--direct", prefill.url, port)
                res = run_bench(args, decode.url, concurrency, requests, extra)
                check_alive(procs)
                report["runs"].append({"variant": f"{name}-direct", "flags": flags, **res})
                print(f"  {name}-direct c={concurrency}: {json.dumps(res)}", flush=True)
                write_report(args, report)
        report["metrics"][name] = spec_metrics(decode.url)
        report["decode_rows"][name] = decode_rows(decode.url)
    except StackError as e:
        tails = {p.role: p.log_tail(40) for p in procs if p.log_path.is_file()}
        report["errors"][name] = {"error": str(e), "log_tails": tails}
        print(f"\nerror in {name}: {e}", flush=True)
        for role, tail in tails.items():
            print(f"  -- {role} log, last lines:\n{tail}", flush=True)
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):  # a second signal must not cut the stop short
            signal.signal(sig, signal.SIG_IGN)
        stop(procs)
        write_report(args, report)
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, _interrupt)


def start_profiles(procs: list[Proc], out: Path, steps: int) -> None:
    """Both workers profile their next `steps` forward steps and write the traces themselves
    when those are done (SGLang's num_steps)."""
    out.mkdir(parents=True, exist_ok=True)
    body = {"output_dir": str(out), "num_steps": steps, "with_stack": False}
    for p in procs:
        if p.role in ("prefill", "decode"):
            r = httpx.post(p.url + "/start_profile", json={**body, "profile_prefix": p.role})
            if r.status_code != 200:
                raise StackError(f"{p.role} /start_profile answered {r.status_code}: {r.text}")


def stop_profiles(procs: list[Proc]) -> None:
    """Make sure both workers' traces are written: a worker still profiling (the run took
    fewer steps than asked) stops now; one that stopped by itself answers 400, and only after
    its trace was written (the scheduler writes it before it reads the next command)."""
    for p in procs:
        if p.role in ("prefill", "decode"):
            r = httpx.post(p.url + "/stop_profile", timeout=600)
            if r.status_code != 200 and "not in progress" not in r.text:
                raise StackError(f"{p.role} /stop_profile answered {r.status_code}: {r.text}")


def summarize_profiles(log_dir: Path, keep_traces: bool) -> None:
    """Summarise every trace in log_dir/profile into log_dir/profile_summary.json, keyed by
    role, then rank ({"decode": {"TP-0": summary}}), print each one's top lines and, unless
    `keep_traces`, delete the traces that were summarised (a trace that failed is kept)."""
    from serving.tools.trace_summary import format_summary, summarize_file

    summaries: dict[str, dict] = {}
    traces = sorted((log_dir / "profile").glob("*.trace.json.gz"))
    for trace in traces:
        # <role>-<profile id>-TP-<rank>[-EP-<rank>].trace.json.gz (the id is a time: no "-")
        role, _, rank = trace.name.removesuffix(".trace.json.gz").split("-", 2)
        try:
            summary = summarize_file(trace)
        except (OSError, ValueError) as e:
            summaries.setdefault(role, {})[rank] = {"file": trace.name, "error": str(e)}
            print(f"  [{log_dir.name}] {trace.name}: not summarised: {e}", flush=True)
            continue
        summaries.setdefault(role, {})[rank] = summary
        print(f"\n  [{log_dir.name}] {role} {rank}:\n{format_summary(summary, top=8)}", flush=True)
        if not keep_traces:
            trace.unlink()
    if not traces:
        print(f"  [{log_dir.name}] no traces in {log_dir / 'profile'}", flush=True)
    (log_dir / "profile_summary.json").write_text(json.dumps(summaries, indent=2) + "\n")
    if not keep_traces and not any((log_dir / "profile").iterdir()):
        (log_dir / "profile").rmdir()


def write_report(args: argparse.Namespace, report: dict) -> None:
    path = args.out / "results.json"
    path.write_text(json.dumps(report, indent=2) + "\n")


def summary(report: dict) -> None:
    cols = ("concurrency", "requests", "output_tok_per_s", "ttft_ms_mean", "ttft_ms_p50")
    cols += ("ttft_ms_p99", "tpot_ms", "image_tokens_mean")
    cols += ("tpot_ms_p50", "decode_tok_per_s_per_req", "itl_ms_mean", "itl_ms_p50")
    print("\n" + " | ".join(("variant", *cols)), flush=True)
    for run in report["runs"]:
        print(" | ".join([run["variant"], *(str(run.get(c)) for c in cols)]), flush=True)
    for name, err in report["errors"].items():
        print(f"{name}: FAILED ({err['error'].splitlines()[0]})", flush=True)
    for name, rows in report["decode_rows"].items():
        print(f"  [{name}] decode request rows: {rows}", flush=True)
    print("\ndecode worker's EAGLE acceptance over each variant:", flush=True)
    for name, metrics in report["metrics"].items():
        for metric in SPEC_METRICS:
            print(f"  [{name}] {metric} {metrics.get(metric, 'absent')}", flush=True)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    os.chdir(REPO)  # the workers run `python -m serving.launch_server` from here
    os.environ["PYTHONUNBUFFERED"] = "1"
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, _interrupt)
    args.out.mkdir(parents=True, exist_ok=True)
    report: dict = {
        "args": {k: str(v) for k, v in vars(args).items() if k not in ("variants", "benches")},
        "runs": [],
        "metrics": {},
        "decode_rows": {},
        "startup_s": {},
        "errors": {},
    }
    t0 = time.monotonic()
    try:
        if args.wheels is not None:
            install_wheels(args.wheels, args.site)
            prepare_mooncake(args)
        report["environment"] = environment()
        print(f"environment: {report['environment']}", flush=True)
        model = checkpoint(args)
        for name, flags in args.variants:
            run_variant(args, model, name, flags, report)
    except Interrupted as e:
        print(f"\n{e}: stopped.", flush=True)
        report["errors"]["interrupted"] = {"error": str(e), "log_tails": {}}
    except (StackError, subprocess.CalledProcessError) as e:
        print(f"\nerror: {e}", flush=True)
        report["errors"]["setup"] = {"error": str(e), "log_tails": {}}
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, signal.SIG_IGN)
        report["total_s"] = round(time.monotonic() - t0, 1)
        write_report(args, report)
    summary(report)
    print(f"\n{args.out / 'results.json'} ({report['total_s']} s in all)", flush=True)
    return 1 if report["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
