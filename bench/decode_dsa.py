"""One DSA layer's decode step on rank 0 of GLM-5.3-Flash at TP8 (8 MLA heads, R 512, the
indexer's 32 heads x 128, kpool 16, 128 pools + the tail), bf16: today's path (old) against the
fused step path (new), from the layer's input x to o_proj's output.

    python -m bench.decode_dsa

Old is the path before kernels/triton/dsa_decode.py, rebuilt here from the same kernels: torch
norms and index writes, the indexer split over TP (4 local heads, its pool scores all-reduced:
free here, as at a simulated rank), Triton pool scores, key-encoded torch.topk, torch slot
gather, einsums around the 64-head-block sparse MLA kernel. New is DSAttention.forward's step
path. Collectives are no-ops (rank 0 alone), as in serving/tools/bench_fast_path.py
--simulate-rank.

Each row: ROTATE layers with their own weights, caches and inputs in one CUDA graph (more
bytes than the 50 MB L2, so no layer finds its weights there), replayed REPLAYS times; us_* is
the median replay / ROTATE. floor_us: the new layer's weights, its tokens' selected latents and
their requests' pooled keys at 4.23 TB/s. launches_new / launches_old: kernels of one layer
(profiled eager call). One JSON line per row.
"""

from __future__ import annotations

import json
import math
import statistics

import torch
import torch.nn.functional as F

from kernels.triton import indexer as tri_idx
from kernels.triton.sparse_mla import sparse_mla_attention
from serving.config import ModelConfig
from serving.distributed import ParallelState, set_state
from serving.forward_batch import ForwardBatch
from serving.layers.stacked_projections import stack_projections
from serving.memory.cache import DSALayerCache, tail_slots_for
from serving.models.dsa import K_NORM_EPS, DSAttention
from serving.models.random_init import init_module
from serving.tools.tiny_model import build_config

TP = 8
ROTATE = 4
REPLAYS = 30
BANDWIDTH = 4.23e12  # bytes/s: the H200's measured copy bandwidth
PAGE = 64
ROWS = [  # (context, batch, step_len)
    (4096, 1, 1),
    (4096, 8, 1),
    (4096, 32, 1),
    (65536, 1, 1),
    (65536, 8, 1),
    (65536, 32, 1),
    (4096, 1, 2),  # an EAGLE verify of 2 tokens per request
    (65536, 8, 2),
]


def _real_config() -> ModelConfig:
    specials = {"<|endoftext|>": 0, "<|user|>": 1, "<|observation|>": 2}
    return ModelConfig.from_dict(build_config("real", specials))


def _layers(config: ModelConfig, gen: torch.Generator) -> list[DSAttention]:
    set_state(ParallelState(rank=0, tp_size=TP))
    try:  # rank 0's shapes; built, its collectives are no-ops once the state is back at one rank
        layers = [DSAttention(config, torch.bfloat16, True) for _ in range(ROTATE)]
    finally:
        set_state(ParallelState())
    for layer in layers:
        layer.to("cuda")
        init_module(layer, config, gen)
        stack_projections(layer)
    return layers


def _inputs(config, context: int, batch: int, step_len: int, gen: torch.Generator):
    """A batch of `batch` requests whose contexts end at `context` after the step, pages
    shuffled, and one cache per rotated layer with random latents, pooled keys and rings."""
    rows = batch + 1  # row 0: padding
    width = -(-context // PAGE) * PAGE
    pages = torch.randperm(batch * width // PAGE, generator=gen, device="cuda") + 1
    offs = torch.arange(PAGE, device="cuda")
    r2t = torch.zeros(rows, width, dtype=torch.int64, device="cuda")
    r2t[1:] = (pages.view(batch, -1)[:, :, None] * PAGE + offs).flatten(1)
    slots = (batch * width // PAGE + 1) * PAGE
    ring = tail_slots_for(config, step_len)
    kp, d = config.index_kpool, config.index_head_dim

    def rnd(*shape):
        return torch.randn(*shape, generator=gen, device="cuda").to(torch.bfloat16)

    caches = [
        DSALayerCache(
            rnd(slots, config.kv_lora_rank),
            rnd(slots // kp, d),
            rnd(rows, ring, d),
            rnd(rows, ring, d),
        )
        for _ in range(ROTATE)
    ]
    starts = torch.full((batch,), context - step_len, device="cuda")
    fb = ForwardBatch.uniform(
        torch.zeros(batch * step_len, dtype=torch.int64, device="cuda"),
        torch.arange(1, rows, device="cuda"),
        starts,
        step_len,
        r2t,
        context,
    )
    xs = [rnd(batch * step_len, config.hidden_size) for _ in range(ROTATE)]
    return fb, caches, xs


def _old_step(layer: DSAttention, x, batch: ForwardBatch, cache: DSALayerCache):
    """The decode step as it ran before the fused path (the indexer's 4 local heads of 32)."""
    idx = layer.indexer
    hi_local = idx.heads // TP
    q_a, kv_a, wk, gates, head_w = layer.in_proj(x)
    q_lora = layer.q_a_layernorm(q_a)
    q = F.linear(q_lora, layer.q_b_proj.weight).view(-1, layer.heads, layer.nope)
    cache.latent[batch.token_slots] = layer.kv_a_layernorm(kv_a).to(cache.latent.dtype)
    qi = F.linear(q_lora, idx.wq_b.weight[: hi_local * idx.d]).view(-1, hi_local, idx.d)
    k = F.layer_norm(wk, (idx.d,), idx.k_norm_weight, idx.k_norm_bias, eps=K_NORM_EPS)
    hw = head_w[:, :hi_local].float() * idx.scale
    shape, r2t = idx.shape, batch.req_to_token
    kp, ring = shape.kpool, cache.tail_slots
    rows, pos = batch.req_rows[batch.token_req], batch.positions
    cache.tail_keys[rows, pos % ring] = k.to(cache.tail_keys.dtype)
    cache.tail_gates[rows, pos % ring] = gates.to(cache.tail_gates.dtype)
    members = (pos[:, None] - kp + 1 + torch.arange(kp, device=pos.device)) % ring
    pooled = tri_idx.kpool_compress(
        cache.tail_keys[rows[:, None], members],
        cache.tail_gates[rows[:, None], members],
        idx.index_kpool_compress_ape,
    )
    closes = pos % kp == kp - 1
    dst = torch.where(closes, r2t[rows, (pos // kp) * kp] // kp, 0)
    cache.index_keys[dst] = pooled.to(cache.index_keys.dtype)
    max_pools = max(1, batch.max_seq_len // kp)
    per_query = batch.req_rows.repeat_interleave(qi.shape[0] // batch.req_rows.shape[0])
    scores = tri_idx.score_pools_paged(
        qi, hw, cache.index_keys, r2t, per_query, pos, kp, max_pools, shape.head_dim**-0.5
    )
    positions = tri_idx.select_tokens(scores, pos, kp, shape.select_pools, shape.select_tail)
    sel_slots = torch.where(positions >= 0, r2t[rows[:, None], positions.clamp(min=0)], -1)
    kv_b = layer.kv_b_proj.weight.view(layer.heads, layer.nope + layer.v_dim, layer.rank)
    q_abs = torch.einsum("thd,hdr->thr", q, kv_b[:, : layer.nope])
    o_lat = sparse_mla_attention(q_abs, cache.latent, sel_slots, layer.scale)
    o = torch.einsum("thr,hvr->thv", o_lat, kv_b[:, layer.nope :])
    return layer.o_proj(o.flatten(1))


def _new_step(layer: DSAttention, x, batch: ForwardBatch, cache: DSALayerCache):
    return layer(x, batch, cache, None)[0]


def _time(step, layers, xs, batch, caches) -> float:
    """Median us per layer over graph replays of ROTATE layers."""

    def run():
        return [step(layer, x, batch, c) for layer, x, c in zip(layers, xs, caches)]

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream), torch.no_grad():
        for _ in range(2):
            run()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph), torch.no_grad():
        run()
    for _ in range(3):
        graph.replay()
    times = []
    for _ in range(REPLAYS):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / len(layers))
    del graph
    return statistics.median(times)


def _launches(step, layer, x, batch, cache) -> int:
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    with torch.no_grad(), profile(activities=[ProfilerActivity.CUDA]) as prof:
        step(layer, x, batch, cache)
        torch.cuda.synchronize()
    return sum(e.device_type == DeviceType.CUDA for e in prof.events())


def _floor_us(config, layer: DSAttention, context: int, batch: int, step_len: int) -> float:
    weights = sum(p.numel() * p.element_size() for p in layer.parameters())
    width = config.index_topk + config.index_kpool - 1
    latents = batch * step_len * min(context, width) * config.kv_lora_rank * 2
    keys = batch * math.ceil(context / config.index_kpool) * config.index_head_dim * 2
    return (weights + latents + keys) / BANDWIDTH * 1e6


def main() -> None:
    assert torch.cuda.is_available(), "bench.decode_dsa needs a CUDA device"
    config = _real_config()
    gen = torch.Generator(device="cuda").manual_seed(0)
    layers = _layers(config, gen)
    for context, batch, step_len in ROWS:
        fb, caches, xs = _inputs(config, context, batch, step_len, gen)
        us_old = _time(_old_step, layers, xs, fb, caches)
        us_new = _time(_new_step, layers, xs, fb, caches)
        row = {
            "name": f"dsa layer {'decode' if step_len == 1 else 'verify'} ctx {context}",
            "batch": batch,
            "step_len": step_len,
            "dtype": "bf16",
            "us_old": round(us_old, 1),
            "us_new": round(us_new, 1),
            "floor_us": round(_floor_us(config, layers[0], context, batch, step_len), 1),
            "launches_old": _launches(_old_step, layers[0], xs[0], fb, caches[0]),
            "launches_new": _launches(_new_step, layers[0], xs[0], fb, caches[0]),
        }
        print(json.dumps(row), flush=True)
        del fb, caches, xs
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
