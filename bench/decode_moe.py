"""One MoE layer of rank 0 of GLM-5.3-Flash at TP8/EP8 (issue 43) at decode batches 1, 4 and 8:
the align path against the small path, bf16 and block FP8.

    python -m bench.decode_moe                # one JSON line per row, < 60 s on an H200
    python -m bench.decode_moe --shared-fp8   # + the fp8_all rows (more kernels to compile)
    python -m bench.decode_moe --sweep        # the small path's program targets, for its constants

A row: {"name", "batch", "dtype", "us_old", "us_new", "floor_us", "launches_old",
"launches_new", "new_over_floor", "rel_err"}, microseconds per layer call.
- us_old: serving/layers/mlp.MoE with SMALL_MOE_MAX_TOKENS 0, as the layer ran before the small
  path: the router in two launches (kernels/triton/route.py), the fused align MoE
  (kernels/triton/moe.py: align, gate/up, down, combine; FP8 adds two activation quantizations)
  and the shared expert's DenseMLP (stacked gate/up GEMM, the SwiGLU's torch ops, down GEMM),
  then the add;
- us_new: the same layer with SMALL_MOE_MAX_TOKENS 16: MoE._forward_small, three launches
  (kernels/triton/moe_small.py);
- floor_us: the bytes the layer must read (the router, each distinct local expert the inputs
  pick, the shared expert; FP8 with its block scales) at 4.23 TB/s, the H200's measured copy
  bandwidth, averaged over the layer copies;
- launches_*: kernels of one eager call (torch.profiler); rel_err: max |new - old| over max |old|
  of one eager call (a wrong kernel makes fast numbers meaningless).
dtype: bf16; fp8: the routed experts block FP8, the shared expert bf16 (what the timed FP8 load
keeps at TP8: serving/models/fp8_choice.py); fp8_all (--shared-fp8): the shared expert's Linears
FP8 too.

Shapes: hidden 4096, 288 experts of which rank 0 holds 36 (ids 0..35), top-8, expert
intermediate 2048, shared expert 2048 / 8 = 256, random weights and inputs. The all-reduce is
left out of both paths (one rank alone).

--sweep times the small path alone for each (GATE_UP_PROGRAMS[_FP8], DOWN_PROGRAMS[_FP8]) of
SWEEP_GATE_UP x SWEEP_DOWN, the GEMV form's GEMV_GATE_UP_PROGRAMS and GEMV_DOWN_PROGRAMS alike
(kernels/triton/moe_small.py's grid sizes: they decide the K splits), one row each with those
two fields: the fastest pair per dtype and form is what the constants should say.
In bf16 at 1 and 2 tokens (GEMV_MAX_TOKENS 2 while it runs) it crosses them with the GEMV form's
(GEMV_PAIR, GEMV_BLOCK_K) of SWEEP_GEMV, fields gemv_pair and gemv_block_k.

Timing: each path is captured in one CUDA graph over LAYERS layer copies (distinct weights and
inputs; 1.8 GB of bf16 experts each, so no layer's weights survive in L2 until its next call),
replayed REPLAYS times; the median replay over LAYERS is the time per layer.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics

import torch

DEVICE = "cuda"
BANDWIDTH = 4.23e12  # bytes/s
BATCHES = (1, 4, 8)
LAYERS = 4
REPLAYS = 20
TP = EP = 8
SWEEP_GATE_UP = (264, 396, 528, 660)
SWEEP_DOWN = (264, 528, 792)
SWEEP_GEMV = ((False, 128), (True, 128), (False, 256), (True, 256))


def _config():
    from serving.config import ModelConfig
    from serving.tools.tiny_model import build_config

    specials = {"<|endoftext|>": 0, "<|user|>": 1, "<|observation|>": 2}
    return ModelConfig.from_dict(build_config("real", specials))


def _layer(config, fp8: bool, gen: torch.Generator):
    """Rank 0's MoE layer with random weights (routed experts in block FP8 if fp8)."""
    from kernels.fp8 import quantize_weight
    from serving.layers.mlp import MoE
    from serving.layers.stacked_projections import stack_projections

    with torch.device(DEVICE):
        moe = MoE(config, torch.bfloat16)
    hidden = config.hidden_size

    def rand(shape, std):
        return torch.randn(shape, device=DEVICE, generator=gen) * std

    moe.gate.weight.data.copy_(rand(moe.gate.weight.shape, hidden**-0.5))
    moe.gate.e_score_correction_bias.data.copy_(
        torch.rand(config.n_routed_experts, device=DEVICE, generator=gen) * 0.1
    )
    w13_std, w2_std = 2 * hidden**-0.5, moe.w2.shape[2] ** -0.5
    if fp8:
        moe.hold_fp8()
        for e in range(moe.w13.shape[0]):  # I is a multiple of 128: gate and up blocks apart
            moe.w13.data[e], moe.w13_scale_inv.data[e] = quantize_weight(
                rand(moe.w13.shape[1:], w13_std)
            )
            moe.w2.data[e], moe.w2_scale_inv.data[e] = quantize_weight(
                rand(moe.w2.shape[1:], w2_std)
            )
    else:
        for w, std in ((moe.w13, w13_std), (moe.w2, w2_std)):
            for e in range(w.shape[0]):
                w.data[e] = rand(w.shape[1:], std)
    for lin in _shared_linears(moe):
        lin.weight.data.copy_(rand(lin.weight.shape, lin.weight.shape[1] ** -0.5))
    stack_projections(moe)  # the loader stacks the bf16 shared gate/up into one GEMM
    return moe


def _shared_linears(moe):
    mlp = moe.shared_experts
    return (mlp.gate_proj, mlp.up_proj, mlp.down_proj)


def _shared_to_fp8(moe) -> None:
    from kernels.fp8 import quantize_weight

    for lin in _shared_linears(moe):
        w = lin.weight.data.float()
        lin.hold_fp8()
        lin.weight.data, lin.weight_scale_inv.data = quantize_weight(w)


def _weight_bytes(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.numel() * t.element_size()


def _floor_us(moe, xs) -> float:
    """The bytes one call on each input must read, averaged, at BANDWIDTH."""
    from kernels.moe_small import route_slots

    c = moe.config
    num_local = moe.w13.shape[0]
    per_expert = sum(
        _weight_bytes(t) for t in (moe.w13, moe.w2, moe.w13_scale_inv, moe.w2_scale_inv)
    )
    per_expert //= num_local
    fixed = _weight_bytes(moe.gate.weight) + _weight_bytes(moe.gate.e_score_correction_bias)
    for lin in _shared_linears(moe):
        fixed += _weight_bytes(lin.weight) + _weight_bytes(lin.weight_scale_inv)
    picked = []
    for x in xs:
        slot_expert, _ = route_slots(
            x,
            moe.gate.weight,
            moe.gate.e_score_correction_bias,
            c.num_experts_per_tok,
            c.norm_topk_prob,
            c.routed_scaling_factor,
            (0, num_local),
        )
        picked.append(int((slot_expert < num_local).sum()))
    return (fixed + statistics.mean(picked) * per_expert) / BANDWIDTH * 1e6


def _launches(fn) -> int:
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sum(
        1
        for e in prof.events()
        if e.device_type == DeviceType.CUDA and not e.name.startswith(("Memcpy", "Memset"))
    )


def _graph_us(calls) -> float:
    """Median device microseconds per call, all calls captured in one graph and replayed."""
    from kernels.triton.fp8 import graph_time_us

    return graph_time_us(lambda call: call(), calls, REPLAYS)


def _rows(dtype: str, layers, gen: torch.Generator):
    from serving.layers import mlp

    hidden = layers[0].config.hidden_size
    launches = {}
    for batch in BATCHES:
        xs = [
            torch.randn(batch, hidden, device=DEVICE, generator=gen).to(torch.bfloat16)
            for _ in layers
        ]
        calls = [lambda moe=moe, x=x: moe(x) for moe, x in zip(layers, xs)]
        row = {"name": "moe_layer", "batch": batch, "dtype": dtype}
        outs = {}
        for path, limit in (("old", 0), ("new", 16)):
            mlp.SMALL_MOE_MAX_TOKENS = limit
            outs[path] = calls[0]().float()
            row[f"us_{path}"] = round(_graph_us(calls), 2)
            if path not in launches:  # the same kernels at every batch size
                launches[path] = _launches(calls[0])
            row[f"launches_{path}"] = launches[path]
        floor = statistics.mean(_floor_us(moe, [x]) for moe, x in zip(layers, xs))
        row["floor_us"] = round(floor, 2)
        row["new_over_floor"] = round(row["us_new"] / floor, 2)
        err = (outs["new"] - outs["old"]).abs().max() / outs["old"].abs().max()
        row["rel_err"] = float(f"{err.item():.3g}")
        print(json.dumps(row), flush=True)


def _sweep_rows(dtype: str, layers, gen: torch.Generator):
    from kernels.triton import moe_small
    from serving.layers import mlp

    hidden = layers[0].config.hidden_size
    mlp.SMALL_MOE_MAX_TOKENS = 16
    fp8 = "" if dtype == "bf16" else "_FP8"
    grids = (
        f"GATE_UP_PROGRAMS{fp8}",
        f"DOWN_PROGRAMS{fp8}",
        "GEMV_GATE_UP_PROGRAMS",
        "GEMV_DOWN_PROGRAMS",
    )
    saved = [getattr(moe_small, name) for name in grids]
    saved_gemv = moe_small.GEMV_MAX_TOKENS, moe_small.GEMV_PAIR, moe_small.GEMV_BLOCK_K
    moe_small.GEMV_MAX_TOKENS = 2
    try:
        for batch in BATCHES:
            xs = [
                torch.randn(batch, hidden, device=DEVICE, generator=gen).to(torch.bfloat16)
                for _ in layers
            ]
            calls = [lambda moe=moe, x=x: moe(x) for moe, x in zip(layers, xs)]
            floor = statistics.mean(_floor_us(moe, [x]) for moe, x in zip(layers, xs))
            gemv_forms = SWEEP_GEMV if dtype == "bf16" and batch <= 2 else (None,)
            for gemv, gate_up, down in itertools.product(gemv_forms, SWEEP_GATE_UP, SWEEP_DOWN):
                for name, value in zip(grids, (gate_up, down, gate_up, down)):
                    setattr(moe_small, name, value)  # the GEMV form's grids too (1 token)
                row = {"name": "moe_layer_small", "batch": batch, "dtype": dtype}
                if gemv is not None:
                    moe_small.GEMV_PAIR, moe_small.GEMV_BLOCK_K = gemv
                    row.update(gemv_pair=gemv[0], gemv_block_k=gemv[1])
                us = _graph_us(calls)
                row.update(gate_up_programs=gate_up, down_programs=down, us_new=round(us, 2))
                row.update(floor_us=round(floor, 2), new_over_floor=round(us / floor, 2))
                print(json.dumps(row), flush=True)
    finally:
        for name, value in zip(grids, saved):
            setattr(moe_small, name, value)
        moe_small.GEMV_MAX_TOKENS, moe_small.GEMV_PAIR, moe_small.GEMV_BLOCK_K = saved_gemv


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sweep", action="store_true", help="the small path's program targets")
    ap.add_argument("--shared-fp8", action="store_true", help="also the shared expert in FP8")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench.decode_moe needs a CUDA device")
    rows = _sweep_rows if args.sweep else _rows
    from serving.distributed import ParallelState, set_state
    from serving.layers import mlp

    set_state(ParallelState(rank=0, tp_size=TP, ep_size=EP))
    saved = mlp.SMALL_MOE_MAX_TOKENS, mlp.all_reduce
    mlp.all_reduce = lambda t: t  # one rank alone: no collective in either path
    try:
        with torch.no_grad():
            config = _config()
            gen = torch.Generator(device=DEVICE).manual_seed(0)
            layers = [_layer(config, False, gen) for _ in range(LAYERS)]
            rows("bf16", layers, gen)
            layers = None  # free the bf16 copies first
            layers = [_layer(config, True, gen) for _ in range(LAYERS)]
            rows("fp8", layers, gen)
            if args.shared_fp8:
                for moe in layers:
                    _shared_to_fp8(moe)
                rows("fp8_all", layers, gen)
    finally:
        mlp.SMALL_MOE_MAX_TOKENS, mlp.all_reduce = saved
        set_state(ParallelState())


if __name__ == "__main__":
    main()
