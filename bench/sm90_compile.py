"""Compile the decode step's Triton kernels (and the prefill's mHC, EAGLE's KDA roll-back and
the draft's norms) for the H200 (sm_90a) on a CPU, at rank 0 of TP8/EP8's real shapes, with
programmatic dependent launch on as the H200 runs them:

    python -m bench.sm90_compile [--out compile.jsonl]

Triton's interpreter runs a kernel's Python, not its compilation: a kernel can pass every
interpreter test and still fail to compile (a constexpr rebound in a static loop, a variable
retyped inside a run-time branch; both happened). Here each kernel launch of the cases below is
intercepted: the wrapper runs on CPU tensors (its launches skipped; the outputs are never
read), and the kernel with the launch's specialization is compiled by Triton's own sm_90a
backend (ptxas ships with Triton), its cubin's resource usage read by cuobjdump.

One JSON line per compiled variant: {"case", "kernel", "ok", "registers", "local_bytes",
"shared_bytes", "pdl_waits", "acquire_loads", "volatile_loads", "error"}; local_bytes > 0 is a
register spill. A program that waits on another of its grid (the mHC boundary's split finish)
polls with acquire loads (`ld.global.gpu.acquire`, tl.atomic_add(ptr, 0, sem="acquire") with
its value used); a volatile load (`ld.volatile`) orders nothing after it: ptxas moved a load
above such a loop in session 28's fused router, so it is flagged too. Exit status 1 if a
variant fails to compile, spills, polls with a volatile load or holds more shared memory than
an sm_90 program may (SHARED_MAX: it would fail at launch). tests/test_sm90_compile.py runs it
in a subprocess (it patches torch.cuda's device queries for PDL, so it gets a process of its
own).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from pathlib import Path

SHARED_MAX = 232448  # bytes of shared memory a program may hold on sm_90 (227 KB)
RANK0 = dict(hidden=4096, heads=8, dim=128, rank=128, conv=4, experts=288, local=36, inter=2048,
             shared_inter=256, top_k=8)  # fmt: skip


def _intercept(rows: list[dict], case: list[str]) -> None:
    """JITFunction.run compiles for sm_90a instead of launching; one row per new variant."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend
    from triton.runtime.jit import JITFunction, create_function_from_signature

    target = GPUTarget("cuda", 90, 32)
    cuobjdump = Path(triton.__file__).parent / "backends/nvidia/bin/cuobjdump"
    seen: set = set()

    def run(self, *args, grid, warmup, **kwargs):
        kwargs.setdefault("debug", False)
        backend = make_backend(target)
        binder = create_function_from_signature(self.signature, self.params, backend)
        bound, spec, opts = binder(*args, **kwargs)
        opts, sig, constexprs, attrs = self._pack_args(backend, kwargs, bound, spec, opts)
        key = (self.__name__, str(sorted((str(k), str(v)) for k, v in constexprs.items())),
               opts.num_warps)  # fmt: skip
        if key in seen:
            return None
        seen.add(key)
        row = {"case": case[0], "kernel": self.__name__, "ok": False}
        try:
            compiled = triton.compile(
                ASTSource(self, sig, constexprs, attrs), target=target, options=opts.__dict__
            )
        except Exception as e:  # noqa: BLE001 - reported, the run goes on
            cause = e.__cause__ or e.__context__
            row["error"] = f"{type(e).__name__}: {str(e)[-400:]} | {cause!r}"[:2000]
            rows.append(row)
            return None
        cubin = Path(os.environ.get("TMPDIR", "/tmp")) / f"sm90_{os.getpid()}.cubin"
        cubin.write_bytes(compiled.asm["cubin"])
        usage = subprocess.run(
            [cuobjdump, "-res-usage", cubin], capture_output=True, text=True
        ).stdout
        cubin.unlink()
        found = {k: int(v) for k, v in re.findall(r"(REG|LOCAL|SHARED):(\d+)", usage)}
        row.update(
            ok=True,
            registers=found.get("REG"),
            local_bytes=found.get("LOCAL"),
            shared_bytes=compiled.metadata.shared,
            pdl_waits=compiled.asm["ptx"].count("griddepcontrol.wait"),
            acquire_loads=compiled.asm["ptx"].count("ld.global.gpu.acquire"),
            volatile_loads=compiled.asm["ptx"].count("ld.volatile"),
        )
        rows.append(row)
        return None

    JITFunction.run = run


def _cases(case: list[str]) -> None:
    """Each decode kernel at rank 0's shapes, the variants the step's batch sizes meet."""
    import torch

    from kernels.fp8 import quantize_weight
    from kernels.kda import KDAWeights
    from kernels.moe_small import Experts, SharedExpert
    from kernels.triton import kda as tkda
    from kernels.triton import mhc
    from kernels.triton import moe_small as tms
    from kernels.triton.kda_roll_back import kda_roll_back
    from kernels.triton.mhc import mhc_boundary
    from kernels.triton.moe_small import counters_size, moe_small
    from kernels.triton.norm import add_rms_norm, rms_norm
    from kernels.triton.skinny_gemm import gemv_config, skinny_linear
    from kernels.triton.swiglu import swiglu
    from serving.memory.cache import KDALayerCache

    r = RANK0
    bf = torch.bfloat16
    hd, h, d, rk, kc = r["hidden"], r["heads"], r["dim"], r["rank"], r["conv"]
    for batch, step_len, dtype, fp8 in (
        (1, 1, bf, False), (8, 1, bf, False), (32, 1, bf, False), (1, 2, bf, False),
        (32, 2, bf, False), (3, 1, torch.float32, False), (3, 1, bf, True),
    ):  # fmt: skip
        case[0] = f"kda core, batch {batch}, step {step_len}, {dtype}, fp8 gates {fp8}"
        n = batch * step_len
        proj = torch.empty(n, 3 * h * d + 2 * rk + h, dtype=dtype)
        q, k, v = (proj[:, i * h * d : (i + 1) * h * d] for i in range(3))
        f_a, g_a = (proj[:, 3 * h * d + i * rk : 3 * h * d + (i + 1) * rk] for i in range(2))
        wdt = torch.float8_e4m3fn if fp8 else dtype
        scale = torch.ones(h * d // 128, 1) if fp8 else None
        weights = KDAWeights(
            conv=torch.empty(3 * h * d, kc), dt_bias=torch.empty(h * d), a_log=torch.empty(h),
            o_norm=torch.empty(d), lower_bound=-5.0 if batch != 3 else None, eps=1e-5,
            f_b=torch.empty(h * d, rk, dtype=wdt), f_b_scale=scale,
            g_b=torch.empty(h * d, rk, dtype=wdt), g_b_scale=scale,
        )  # fmt: skip
        tkda.kda_decode_layer(
            q, k, v, f_a, proj[:, -h:], g_a, weights,
            torch.empty(64, 3 * h * d, kc - 1, dtype=dtype), torch.empty(64, h, d, d),
            torch.arange(batch), step_len, [] if step_len > 1 else None,
        )  # fmt: skip
    for rows, n, k in ((1, 3336, 4096), (1, 19360, 4096), (1, 4096, 1024), (2, 2048, 1536),
                       (8, 4096, 1024)):  # fmt: skip
        case[0] = f"skinny dense, {rows} rows, {n} x {k}"
        x = torch.empty(rows, k, dtype=bf)
        skinny_linear(x, torch.empty(n, k, dtype=bf))
        skinny_linear(x, torch.empty(n, k, dtype=bf), add=torch.empty(rows, n, dtype=bf))
    for rows, n, k in (
        (2, 3336, 4096), (4, 4096, 1024), (8, 19360, 4096), (8, 2048, 1536), (1, 3336, 4096),
        (1, 4096, 1024),
    ):  # fmt: skip
        case[0] = f"skinny dense, the GEMV form, {rows} rows, {n} x {k}"
        skinny_linear(torch.empty(rows, k, dtype=bf), torch.empty(n, k, dtype=bf),
                      config=gemv_config(n, k, rows=rows))  # fmt: skip
    w8, s8 = quantize_weight(torch.randn(3344, hd))
    for rows in (1, 8, 32):
        case[0] = f"skinny FP8, {rows} rows"
        x8 = torch.empty(rows, hd, dtype=torch.float8_e4m3fn)
        skinny_linear(x8.to(bf), w8, s8, x_fp8=(x8, torch.empty(rows, hd // 128)))
    e, el, i, si = r["experts"], r["local"], r["inter"], r["shared_inter"]
    experts = Experts(torch.empty(el, 2 * i, hd, dtype=bf), torch.empty(el, hd, i, dtype=bf))
    shared = SharedExpert(*(torch.empty(si, hd, dtype=bf) for _ in range(2)),
                          torch.empty(hd, si, dtype=bf))  # fmt: skip

    def small_moe(tokens, routed):
        moe_small(
            torch.empty(tokens, hd, dtype=bf), torch.empty(e, hd, dtype=bf), torch.empty(e),
            r["top_k"], True, 2.5, (0, el), routed, shared, 7.0,
            torch.zeros(counters_size(hd, i, si), dtype=torch.int32),
        )  # fmt: skip

    saved = tms.GEMV_MAX_TOKENS, tms.GEMV_PAIR, tms.GEMV_BLOCK_K
    for tokens, gemv_tokens, pair, block_k in (
        (1, 1, saved[1], saved[2]), (4, 1, False, 128), (16, 1, False, 128), (2, 8, False, 128),
        (8, 8, False, 128), (1, 1, True, 256), (2, 8, True, 256), (1, 1, False, 128),
    ):  # fmt: skip
        tms.GEMV_MAX_TOKENS, tms.GEMV_PAIR, tms.GEMV_BLOCK_K = gemv_tokens, pair, block_k
        case[0] = f"small MoE, {tokens} tokens, GEMV up to {gemv_tokens}, {pair=}, {block_k=}"
        small_moe(tokens, experts)
    tms.GEMV_MAX_TOKENS, tms.GEMV_PAIR, tms.GEMV_BLOCK_K = saved
    e4m3 = torch.float8_e4m3fn
    experts8 = Experts(
        torch.empty(el, 2 * i, hd, dtype=e4m3),
        torch.empty(el, hd, i, dtype=e4m3),
        torch.empty(el, 2 * i // 128, hd // 128),
        torch.empty(el, hd // 128, i // 128),
    )
    case[0] = "small MoE, 1 token, routed FP8"
    small_moe(1, experts8)
    # past the small path (decode 8-32 rows, EAGLE's verify): the router's two kernels, align,
    # gate/up, down, combine; FP8 with the activations' quantization
    from kernels.triton.moe import experts as moe_experts
    from kernels.triton.moe import experts_fp8 as moe_experts_fp8
    from kernels.triton.route import route

    for tokens in (8, 16, 32):
        case[0] = f"MoE past the small path, {tokens} tokens"
        x = torch.empty(tokens, hd, dtype=bf)
        ids = torch.zeros(tokens, r["top_k"], dtype=torch.int64)
        weights = torch.empty(tokens, r["top_k"])
        route(x, torch.empty(e, hd, dtype=bf), torch.empty(e), r["top_k"], 1, 1, True, 2.5,
              (0, el))  # fmt: skip
        moe_experts(x, experts.w13, experts.w2, weights, ids, 7.0)
    case[0] = "MoE past the small path, 8 tokens, FP8"
    moe_experts_fp8(
        torch.empty(8, hd, dtype=bf), *experts8, torch.empty(8, r["top_k"]),
        torch.zeros(8, r["top_k"], dtype=torch.int64), 7.0,
    )  # fmt: skip
    for tokens in (1, 8):
        case[0] = f"mHC boundary, {tokens} tokens"
        mix = 24
        mhc_boundary(
            torch.empty(tokens, hd, dtype=bf), torch.empty(tokens, 4, hd, dtype=bf),
            torch.empty(tokens, 4), torch.empty(tokens, 4, 4), torch.empty(mix, 4 * hd),
            torch.empty(mix), torch.empty(3), 20, 1e-6, 1e-5, torch.empty(hd, dtype=bf), 1e-5,
            torch.zeros(8, dtype=torch.int32),
        )  # fmt: skip
    # tf32x3, bf16_split logits; 32: the Sinkhorn a program a token
    for tokens, dtype in ((32, bf), (1000, torch.float32), (8192, bf)):
        case[0] = f"mHC pre + post, {tokens} tokens, {dtype}"
        streams = torch.empty(tokens, 4, hd, dtype=dtype)
        out, weight = torch.empty(tokens, hd, dtype=dtype), torch.empty(hd, dtype=dtype)
        mixing = (torch.empty(24, 4 * hd), torch.empty(24), torch.empty(3), 20, 1e-6, 1e-5)
        mhc.mhc_pre(streams, *mixing, weight, 1e-5)
        mhc.mhc_post(out, streams, torch.empty(tokens, 4), torch.empty(tokens, 4, 4))
    case[0] = "EAGLE's KDA roll-back, batch 2, 2 verify positions"
    caches = [KDALayerCache(torch.empty(8, 3 * h * d, 3, dtype=bf), torch.empty(8, h, d, d))] * 2
    history = [[torch.empty(2, 3 * h * d, 5, dtype=bf), torch.empty(2, 2, h, d, d)]] * 2
    at = torch.zeros(2, dtype=torch.int64)
    kda_roll_back(caches, history, at, at)
    case[0] = "SwiGLU, dense MLP at TP8"
    gate_up = torch.empty(1, 2 * 1536, dtype=bf)
    swiglu(gate_up[:, :1536], gate_up[:, 1536:], 7.0)
    case[0] = "RMSNorm and the residual add + RMSNorm, EAGLE's draft at batch 1"
    x, w = torch.empty(2, hd, dtype=bf), torch.empty(hd, dtype=bf)
    rms_norm(x, w, 1e-5, out=torch.empty(2, 2 * hd, dtype=bf)[:, hd:])
    add_rms_norm(x, x, w, 1e-5)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", help="also write the JSON lines here")
    args = ap.parse_args(argv)
    os.environ.pop("TRITON_INTERPRET", None)
    import torch

    # PDL's support check (kernels/triton/pdl.py, at import): the H200's answers
    torch.cuda.is_available = lambda: True
    torch.cuda.get_device_capability = lambda *a, **k: (9, 0)
    from kernels.triton import pdl

    assert pdl.ENABLED, "kernels.triton.pdl was imported before the patch (or PDSERVE_PDL=0)"
    rows: list[dict] = []
    case = ["?"]
    _intercept(rows, case)
    _cases(case)
    lines = [json.dumps(row) for row in rows]
    print("\n".join(lines), flush=True)
    if args.out:
        Path(args.out).write_text("".join(line + "\n" for line in lines))
    bad = [r for r in rows if not r["ok"] or r.get("local_bytes") or r.get("volatile_loads")]
    bad += [r for r in rows if (r.get("shared_bytes") or 0) > SHARED_MAX]
    return 1 if bad or not rows else 0


if __name__ == "__main__":
    sys.exit(main())
