"""The decode step's Triton kernels (and the prefill's mHC) compile for the H200 (sm_90a) at rank
0's real shapes, PDL on, with no register spills (bench/sm90_compile.py, in a process of its
own): what the interpreter's tests cannot see, and what a CPU-only CI would otherwise first learn
on a GPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")

from bench.sm90_compile import SHARED_MAX  # noqa: E402

KERNELS = {
    "_kda_decode_layer_kernel",
    "_skinny_kernel",
    "_route_kernel",
    "_gate_up_kernel",  # the small MoE's and, past it, kernels/triton/moe.py's
    "_down_kernel",
    "_router_logits_kernel",  # past the small MoE: the router, align, combine, FP8's quantization
    "_router_select_kernel",
    "_align_kernel",
    "_combine_kernel",
    "_quant_kernel",
    "_mhc_boundary_kernel",
    "_swiglu_kernel",
    "_mhc_pre_partial_kernel",  # the prefill's mHC pre (both logit dots) and post
    "_mhc_pre_finish_kernel",
    "_split_bf16x3_kernel",  # its fn split once a call
    "_mhc_post_kernel",
    "_kda_roll_back_kernel",  # EAGLE's roll-back
    "_rms_norm_kernel",  # every RMSNorm on the fast path (the draft's with its residual adds)
}


def test_decode_kernels_compile_for_sm90_without_spills(tmp_path):
    out = tmp_path / "compile.jsonl"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # compile, not run
    proc = subprocess.run(
        [sys.executable, "-m", "bench.sm90_compile", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    rows = [json.loads(line) for line in out.read_text().splitlines()] if out.exists() else []
    # shared memory past an sm_90 program's 227 KB compiles, then fails at launch (session 29)
    big = [r for r in rows if r["shared_bytes"] > SHARED_MAX]
    failed = [r for r in rows if not r["ok"] or r["local_bytes"]] + big
    assert proc.returncode == 0 and not failed, (failed, proc.stderr[-3000:])
    assert {r["kernel"] for r in rows} == KERNELS, rows
    assert all(r["pdl_waits"] >= 1 for r in rows), rows  # launched with PDL: each one waits
    # in-grid waits poll with acquire loads, never volatile ones (bench/sm90_compile.py's doc):
    # the boundary's split finish polls (one variant: a token a program, T not a parameter)
    assert not any(r["volatile_loads"] for r in rows), rows
    boundary = [r for r in rows if r["kernel"] == "_mhc_boundary_kernel"]
    assert len(boundary) == 1 and all(r["acquire_loads"] >= 1 for r in boundary), boundary
    # KDA's split core: one variant per split count the batch sizes meet (4, 2, 1)
    kda = [r for r in rows if r["kernel"] == "_kda_decode_layer_kernel"]
    assert len(kda) == 7, kda
