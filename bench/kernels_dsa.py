"""GPU benchmark of the Triton DSA kernels against their torch references, at the real
GLM-5.3-Flash shapes (MLA 64 heads x kv_lora 512, W = index_topk + kpool - 1 = 2063; indexer
32 heads x 128, kpool 16, top 128 pools).

    python -m bench.kernels_dsa [--out results.json] [--quick] [--sweep]
        [--only decode|extend|rank_prefill|indexer]

Rows:
- sparse MLA decode, batch 1/32/128, contexts 8k..64k: achieved GB/s (latent rows gathered +
  q + out + slot ids, over the CUDA-graph replay time, which is what a decode step sees)
  against the 4.23 TB/s copy ceiling; eager time beside it (includes launch overhead).
- sparse MLA extend, 8,192 queries (a prefill chunk at the start of a request, and one at the
  end of a 64k context): TFLOP/s counted on valid slots only (4 * H * R per slot).
- sparse MLA prefill at rank 0 of TP8 (8 heads), an 8,192-token chunk with no prefix and after
  8k and 24k cached (--quick: no prefix only): the gather kernel against the union kernel
  (kernels/triton/sparse_mla_union.py) alone (whole pages of 64: blocks addressed from their
  first slot; beside it a slot load a block), with skip_empty, and with the selection mask it
  needs per layer (what dsa.sparse_mla runs; beside it fe81f4e's way); useful TFLOP/s on valid
  slots, the union's dense rate, 11 layers' total, and which one union_pays picks.
- indexer scoring at contexts 8k..64k (decode batches, and 8,192-query extend chunks at 8k and
  64k): GB/s (pooled keys read) and TFLOP/s; top-k selection; scoring + selection against the
  reference pipeline (gather + score_pools + select_tokens).
Times are medians of triton.testing.do_bench (L2 flushed before every run) after warm-up;
"graph ms" is triton.testing.do_bench_cudagraph (replays, no L2 flush). GB/s of the decode rows
use the graph time.
A Markdown table goes to stdout, everything to --out as JSON.
"""

from __future__ import annotations

import argparse
import functools
import json
import math

import torch

COPY_TBPS = 4.23  # H200 device-to-device copy, measured (read + write) on the lent machines
H, R, TOPK, KPOOL = 64, 512, 2048, 16
H_RANK = 8  # rank 0 of TP8
CHUNK = 8192  # a prefill chunk
W = TOPK + KPOOL - 1
HI, DI = 32, 128
PAGE = 64


def _bench(fn) -> float:
    import triton

    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def _bench_graph(fn) -> float:
    import triton

    return triton.testing.do_bench_cudagraph(fn, rep=100, return_mode="median")


def _table(batch: int, ctx: int, gen: torch.Generator) -> torch.Tensor:
    """req_to_token [batch, ctx] over shuffled pages (no padding row: rows 0..batch-1 used)."""
    pages = ctx // PAGE
    ids = torch.randperm(batch * pages, generator=gen) + 1
    offs = torch.arange(PAGE)
    return (ids.view(batch, pages, 1) * PAGE + offs).view(batch, ctx).cuda()


def _decode_positions(table: torch.Tensor, positions: torch.Tensor, gen) -> torch.Tensor:
    """Positions like the indexer's: top pools at random among the complete ones, plus the
    tail (-1 = empty)."""
    from kernels.indexer import select_tokens

    scores = torch.rand(positions.numel(), table.shape[1] // KPOOL, generator=gen).cuda()
    return select_tokens(scores, positions, KPOOL, TOPK // KPOOL, True)


def _slots_at(table: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """The cache slots at positions [N, W]: decode one query per request row, extend every
    query in request row 0."""
    if table.shape[0] == pos.shape[0]:
        rows = torch.arange(table.shape[0], device="cuda")
    else:
        rows = torch.zeros(pos.shape[0], dtype=torch.int64, device="cuda")
    return torch.where(pos >= 0, table[rows[:, None], pos.clamp(min=0)], -1)


def _decode_slots(table: torch.Tensor, positions: torch.Tensor, gen) -> torch.Tensor:
    """Slots like the indexer's (_decode_positions' at the table)."""
    return _slots_at(table, _decode_positions(table, positions, gen))


def _sweep(fn, configs, timer=None, check=None) -> tuple[float, str] | None:
    """Times fn(**kwargs) per config; check(result), where given, says how a config's result
    stands against the default's (printed beside its time)."""
    timer = timer or _bench
    best = None
    for label, kwargs in configs:
        run = functools.partial(fn, **kwargs)
        try:
            note = f" ({check(run())})" if check else ""
            t = timer(run)
        except Exception as exc:  # noqa: BLE001 - out of resources for a config etc.
            print(f"  skip {label}: {type(exc).__name__}")
            continue
        print(f"  {label}: {t:.4f} ms{note}")
        if best is None or t < best[0]:
            best = (t, label)
    return best


def _mla_decode_case(batch: int, ctx: int, sweep: bool, gen) -> dict:
    from kernels.sparse_mla import sparse_mla_attention as ref
    from kernels.triton.sparse_mla import plan
    from kernels.triton.sparse_mla import sparse_mla_attention as tri

    table = _table(batch, ctx, gen)
    latent = torch.randn(batch * ctx + PAGE, R, device="cuda", dtype=torch.bfloat16)
    positions = torch.full((batch,), ctx - 1, dtype=torch.int64, device="cuda")
    slots = _decode_slots(table, positions, gen)
    q = torch.randn(batch, H, R, generator=gen).cuda().bfloat16()
    args = (q, latent, slots, 192**-0.5)
    valid = int((slots >= 0).sum())
    nbytes = valid * R * 2 + 2 * q.numel() * 2 + slots.numel() * 8
    t = _bench(lambda: tri(*args))
    tg = _bench_graph(lambda: tri(*args))
    pl = plan(batch, H, W, R, q.dtype, q.device)
    row = dict(
        kernel="sparse_mla decode",
        case=f"batch {batch}, ctx {ctx // 1024}k",
        ms=t,
        graph_ms=tg,
        torch_ms=_bench(lambda: ref(*args)),
        gbps=nbytes / tg / 1e6,
        plan=f"BH{pl.block_h} BW{pl.block_w} s{pl.num_splits} w{pl.num_warps} st{pl.num_stages}",
    )
    if sweep:
        splits = {1: (8, 16, 32), 32: (2, 4, 8)}.get(batch, (1, 2))
        configs = [
            (
                f"BH{h} BW{w} s{ns} w{nw} st{st}",
                dict(block_h=h, block_w=w, num_splits=ns, num_warps=nw, num_stages=st),
            )
            for h in (32, 64)
            for w in (32, 64)
            for ns in splits
            for nw in (4, 8)
            for st in (1, 2, 3)
        ]
        best = _sweep(lambda **kw: tri(*args, **kw), configs, _bench_graph)
        if best:
            row["sweep_best"] = f"{best[1]}: {best[0] * 1e3:.1f} us (graph)"
    return row


def bench_mla_decode(results, quick: bool, sweep: bool) -> None:
    gen = torch.Generator().manual_seed(0)
    batches = [1, 32] if quick else [1, 32, 128]
    contexts = [8192, 65536] if quick else [8192, 16384, 32768, 65536]
    for batch in batches:
        for ctx in contexts:
            results.append(_mla_decode_case(batch, ctx, sweep and ctx == contexts[-1], gen))
            torch.cuda.empty_cache()


def _mla_extend_case(name: str, ctx: int, start: int, sweep: bool, gen) -> dict:
    from kernels.sparse_mla import sparse_mla_attention as ref
    from kernels.triton.sparse_mla import sparse_mla_attention as tri

    n = 8192
    table = _table(1, ctx, gen)
    latent = torch.randn(ctx + PAGE, R, device="cuda", dtype=torch.bfloat16)
    positions = torch.arange(start, start + n, device="cuda")
    slots = _decode_slots(table, positions, gen)
    q = torch.randn(n, H, R, generator=gen).cuda().bfloat16()
    args = (q, latent, slots, 192**-0.5)
    flops = 4.0 * H * R * int((slots >= 0).sum())
    t = _bench(lambda: tri(*args))
    row = dict(
        kernel="sparse_mla extend",
        case=f"{n} queries, {name}",
        ms=t,
        torch_ms=_bench(lambda: ref(*args)),
        tflops=flops / t / 1e9,
    )
    if sweep:
        configs = [
            (f"BH{h} BW{w} w{nw} st{st}", dict(block_h=h, block_w=w, num_warps=nw, num_stages=st))
            for h in (32, 64)
            for w in (32, 64, 128)
            for nw in (4, 8)
            for st in (1, 2, 3)
        ]
        best = _sweep(lambda **kw: tri(*args, **kw), configs)
        if best:
            row["sweep_best"] = f"{best[1]}: {best[0]:.3f} ms"
    return row


def bench_mla_extend(results, quick: bool, sweep: bool) -> None:
    gen = torch.Generator().manual_seed(1)
    results.append(_mla_extend_case("8k-token prefill chunk", 8192, 0, sweep, gen))
    if not quick:
        results.append(_mla_extend_case("8k chunk at 56k..64k", 65536, 65536 - 8192, False, gen))


def _rank_prefill_case(start: int, sweep: bool, gen) -> list[dict]:
    """Rank 0 of TP8 (8 heads): an 8,192-token chunk after `start` cached tokens, the gather
    kernel (head block padded to 16) against the union kernel, alone and with the per-layer
    selection mask it needs (what dsa.sparse_mla pays: the Triton mask from the indexer's
    positions; beside it fe81f4e's way, the positions made slots at the indexer and the slots
    made positions again for the torch mask). Useful TFLOP/s count valid slots."""
    from kernels import sparse_mla_union as union
    from kernels.triton.sparse_mla import sparse_mla_attention as gather
    from kernels.triton.sparse_mla_union import selection_mask as tri_mask
    from kernels.triton.sparse_mla_union import sparse_mla_union as tri_union

    n, ctx = CHUNK, start + CHUNK
    table = _table(1, ctx, gen)
    latent = torch.randn(ctx + PAGE, R, device="cuda", dtype=torch.bfloat16)
    positions = torch.arange(start, ctx, device="cuda")
    pos = _decode_positions(table, positions, gen)
    slots = _slots_at(table, pos)
    q = torch.randn(n, H_RANK, R, generator=gen).cuda().bfloat16()
    scale = 192**-0.5
    mask = tri_mask(pos, ctx)
    assert torch.equal(mask, union.selection_mask(pos, ctx))
    block_q = union.block_queries(H_RANK, q.dtype)
    tiles = union.union_tiles([start], [n], block_q).to(q.device)
    rows = torch.zeros(n, dtype=torch.int64, device="cuda")
    u_args = (q, latent, mask, scale, table, rows, tiles)
    positions_of = torch.full((latent.shape[0],), -1, dtype=torch.int64, device="cuda")
    positions_of[table[0, :ctx]] = torch.arange(ctx, device="cuda")

    def with_mask():
        return tri_union(q, latent, tri_mask(pos, ctx), scale, table, rows, tiles, page_size=PAGE)

    def with_slot_mask():  # fe81f4e: select_slots' conversion, the mask from the slots, gathers
        sl = _slots_at(table, pos)
        back = torch.where(sl >= 0, positions_of[sl.clamp(min=0)], ctx)
        m = torch.zeros(n, ctx + 1, dtype=torch.uint8, device="cuda").scatter_(1, back, 1)
        return tri_union(q, latent, m[:, :ctx], scale, table, rows, tiles)

    useful = 4.0 * H_RANK * R * int((slots >= 0).sum())
    dense = (
        4.0 * H_RANK * R * sum(key_end * (end - first) for first, end, key_end in tiles.tolist())
    )
    picks = "union" if union.union_pays(H_RANK, W, [start], [n]) else "gather"
    case = f"8k chunk after {start // 1024}k cached (rule: {picks})"
    t_gather = _bench(lambda: gather(q, latent, slots, scale))
    t_union = _bench(lambda: tri_union(*u_args, page_size=PAGE))
    t_slotwise = _bench(lambda: tri_union(*u_args))
    t_skip = _bench(lambda: tri_union(*u_args, skip_empty=True))
    t_full = _bench(with_mask)
    t_before = _bench(with_slot_mask)
    t_mask = _bench(lambda: tri_mask(pos, ctx))
    t_twin = _bench(lambda: union.selection_mask(pos, ctx))
    rows_out = [
        dict(kernel="sparse_mla 8 heads, gather", case=case, ms=t_gather, x11_ms=11 * t_gather),
        dict(kernel="sparse_mla 8 heads, union", case=case, ms=t_union, vs=t_gather / t_union,
             dense_tflops=dense / t_union / 1e9),
        dict(kernel="sparse_mla 8 heads, union, a slot load a block (page_size 1)", case=case,
             ms=t_slotwise, vs=t_gather / t_slotwise),
        dict(kernel="sparse_mla 8 heads, union skip_empty", case=case, ms=t_skip,
             vs=t_gather / t_skip),
        dict(kernel="sparse_mla 8 heads, mask + union", case=case, ms=t_full,
             vs=t_gather / t_full, x11_ms=11 * t_full),
        dict(kernel="sparse_mla 8 heads, slots' mask + union (fe81f4e)", case=case, ms=t_before,
             vs=t_gather / t_before, x11_ms=11 * t_before),
        dict(kernel="selection mask, Triton from positions", case=case, ms=t_mask,
             torch_ms=t_twin),
    ]  # fmt: skip
    for r in rows_out[:-1]:
        r["torch_ms"] = None
        r["tflops"] = useful / r["ms"] / 1e9
    if sweep:
        # 8 warps (at 4 the [64, 512] fp32 accumulator alone is 256 registers a thread); from 3
        # stages the slot loads are asynchronous copies too (sm_90a TTGIR); contiguous blocks
        # (pages of PAGE hold whole blocks) keep a latent copy in flight from 3 stages
        configs = [
            (f"BN{bn} w8 st{st}{' contiguous' if c else ''}",
             dict(block_n=bn, num_warps=8, num_stages=st, page_size=PAGE if c else 1))
            for bn, st, c in ((64, 2, 0), (64, 3, 0), (32, 2, 0), (32, 3, 0), (32, 4, 0),
                              (64, 2, 1), (32, 3, 1), (32, 4, 1), (16, 4, 1))
        ]  # fmt: skip
        base = tri_union(*u_args).float()

        def against_default(got: torch.Tensor) -> str:
            rel = ((got.float() - base).norm() / base.norm()).item()
            return f"relative difference to the default {rel:.2e}"

        best = _sweep(lambda **kw: tri_union(*u_args, **kw), configs, check=against_default)
        if best:
            rows_out[1]["sweep_best"] = f"{best[1]}: {best[0]:.3f} ms"
    return rows_out


def bench_rank_prefill(results, quick: bool, sweep: bool) -> None:
    gen = torch.Generator().manual_seed(3)
    for start in (0,) if quick else (0, 8192, 24576):
        results.extend(_rank_prefill_case(start, sweep, gen))
        torch.cuda.empty_cache()


def _indexer_case(results, batch: int, ctx: int, chunk: int | None, sweep: bool, gen):
    from kernels import indexer as ref
    from kernels.triton import indexer as tri

    scale = DI**-0.5
    table = _table(batch, ctx, gen)
    keys = torch.randn(batch * ctx // KPOOL + PAGE, DI, device="cuda", dtype=torch.bfloat16)
    n = batch if chunk is None else chunk
    if chunk is None:
        positions = torch.full((n,), ctx - 1, dtype=torch.int64, device="cuda")
        rows = torch.arange(batch, device="cuda")
    else:
        positions = torch.arange(ctx - chunk, ctx, device="cuda")
        rows = torch.zeros(n, dtype=torch.int64, device="cuda")
    q = torch.randn(n, HI, DI, generator=gen).cuda().bfloat16()
    w = torch.randn(n, HI, generator=gen).cuda() * HI**-0.5
    pools = ctx // KPOOL
    sel = TOPK // KPOOL
    dst_rows = rows[:, None] if chunk is None else rows[:1, None]

    def ours_score():
        return tri.score_pools_paged(q, w, keys, table, rows, positions, KPOOL, pools, scale)

    def ref_score():
        dst = table[dst_rows, torch.arange(pools, device="cuda")[None] * KPOOL] // KPOOL
        return ref.score_pools(q, w, keys[dst], scale)

    scores = ours_score()
    t = _bench(ours_score)
    best = None
    if sweep:
        configs = [
            (f"QB{qb} BP{bp} w{nw}", dict(query_block=qb, block_p=bp, num_warps=nw))
            for qb in ((1, 2, 4, 8) if chunk else (1,))
            for bp in (32, 64, 128)
            for nw in (4, 8)
        ]
        best = _sweep(
            lambda **kw: tri.score_pools_paged(
                q, w, keys, table, rows, positions, KPOOL, pools, scale, **kw
            ),
            configs,
        )
    key_bytes = (batch if chunk is None else 1) * pools * DI * 2
    nbytes = key_bytes + q.numel() * 2 + n * pools * 4
    label = f"batch {batch}, ctx {ctx // 1024}k"
    if chunk is not None:
        label = f"{chunk} queries, ctx {ctx // 1024}k"
    tg = _bench_graph(ours_score) if chunk is None else None
    results.append(
        dict(
            kernel="indexer score",
            case=label,
            ms=t,
            graph_ms=tg,
            torch_ms=_bench(ref_score),
            gbps=nbytes / tg / 1e6 if chunk is None else None,
            tflops=2.0 * n * HI * pools * DI / t / 1e9,
            sweep_best=f"{best[1]}: {best[0]:.4f} ms" if best else None,
        )
    )
    select_args = (scores, positions, KPOOL, sel, True)
    results.append(
        dict(
            kernel="indexer select (top-k)",
            case=label,
            ms=_bench(lambda: tri.select_tokens(*select_args)),
            torch_ms=_bench(lambda: ref.select_tokens(*select_args)),
        )
    )
    fused_args = (q, w, keys, table, rows, positions, KPOOL, pools, scale, sel, True)
    results.append(
        dict(
            kernel="indexer score+select",
            case=label,
            ms=_bench(lambda: tri.index_select_paged(*fused_args)),
            graph_ms=_bench_graph(lambda: tri.index_select_paged(*fused_args))
            if chunk is None
            else None,
            torch_ms=_bench(lambda: ref.select_tokens(ref_score(), positions, KPOOL, sel, True)),
        )
    )


def bench_indexer(results, quick: bool, sweep: bool) -> None:
    gen = torch.Generator().manual_seed(2)
    batches = [1, 32] if quick else [1, 32, 128]
    contexts = [8192, 65536] if quick else [8192, 16384, 32768, 65536]
    for batch in batches:
        for ctx in contexts:
            _indexer_case(results, batch, ctx, None, sweep and ctx == contexts[-1], gen)
            torch.cuda.empty_cache()
    # issue 44 point 2: a rank's first 8k chunk (no prefix), then an 8k chunk ending a 64k context
    _indexer_case(results, 1, 8192, 8192, sweep, gen)
    torch.cuda.empty_cache()
    _indexer_case(results, 1, 65536, 8192, sweep, gen)
    torch.cuda.empty_cache()


def _markdown(results) -> str:
    lines = [
        "| kernel | case | ours ms | graph ms | torch ms | speedup | GB/s | % of 4.23 TB/s "
        "| TFLOP/s | plan / sweep |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]

    def f(x, fmt):
        return "" if x is None or (isinstance(x, float) and math.isnan(x)) else fmt.format(x)

    for r in results:
        gbps = r.get("gbps")
        pct = None if gbps is None else 100 * gbps / (COPY_TBPS * 1e3)
        notes = [r.get("plan"), r.get("sweep_best")]
        if r.get("vs") is not None:
            notes.append(f"{r['vs']:.2f}x the gather kernel")
        if r.get("dense_tflops") is not None:
            notes.append(f"{r['dense_tflops']:.0f} TFLOP/s counted densely")
        if r.get("x11_ms") is not None:
            notes.append(f"11 DSA layers: {r['x11_ms']:.1f} ms")
        note = " ; ".join(x for x in notes if x)
        speedup = None if r["torch_ms"] is None else r["torch_ms"] / r["ms"]
        lines.append(
            f"| {r['kernel']} | {r['case']} | {f(r['ms'], '{:.4f}')} | "
            f"{f(r.get('graph_ms'), '{:.4f}')} | {f(r['torch_ms'], '{:.3f}')} | "
            f"{f(speedup, '{:.1f}x')} | {f(gbps, '{:.0f}')} | "
            f"{f(pct, '{:.0f}%')} | {f(r.get('tflops'), '{:.1f}')} | {note} |"
        )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", help="write the results as JSON here")
    ap.add_argument("--quick", action="store_true", help="fewer batches and contexts")
    ap.add_argument("--sweep", action="store_true", help="also sweep launch parameters (slow)")
    ap.add_argument(
        "--only", choices=["decode", "extend", "rank_prefill", "indexer"], action="append"
    )
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA device")
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.manual_seed(0)  # large tensors are drawn on the GPU
    results: list[dict] = []
    only = set(args.only or ["decode", "extend", "rank_prefill", "indexer"])
    if "decode" in only:
        bench_mla_decode(results, args.quick, args.sweep)
    if "extend" in only:
        bench_mla_extend(results, args.quick, args.sweep)
    if "rank_prefill" in only:
        bench_rank_prefill(results, args.quick, args.sweep)
    if "indexer" in only:
        bench_indexer(results, args.quick, args.sweep)
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}")
    print(_markdown(results))
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(dict(device=torch.cuda.get_device_name(), results=results), fh, indent=1)


if __name__ == "__main__":
    main()
