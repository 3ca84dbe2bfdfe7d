"""A DSA layer's fused step (kernels/triton/dsa_decode.py) against its torch references
(kernels/dsa_decode.py), op by op and as a whole layer (serving/models/dsa.py's step path on
the fast path vs the torch path).

CPU cases run under TRITON_INTERPRET=1 (tests/triton_interp): tiny shapes, several requests
with different contexts (no complete pool, fewer pools than the selection, many more), a pool
closing at the first and at the last token of a step, step_len 1, 2 and 5 (a pool entirely
inside the step), heavy score ties. GPU cases run rank 0 of TP8 at the real shapes (8 heads,
R 512, indexer 32 x 128, kpool 16, 128 pools + the tail) at 4k and 64k contexts, batch 1/8/32,
step_len 1 and 2, bf16.

What must be equal, what close:
- The selection is compared as a set per token (the fused kernel lists pools by index, the
  reference by score). Exactly equal where scores are exact in any summation order (small
  integers, power-of-two scales: the CPU cases) or when the reference selects on the kernel's
  own scores (GPU); against the reference's own scores, different pools only at near-ties
  (within 1e-3 of the largest score, GPU bf16) or never (float32 with integer scores).
- float32: 1e-5 relative (norm-wise) for every tensor; only summation orders differ.
- bf16: q_lora, latents, ring keys, pooled keys, q_abs within 1e-2 (one bf16 ulp where an fp32
  sum lands on a rounding boundary); the attention output within 1e-2 of the float32 reference
  run on the same bf16 inputs (the kernel rounds the softmax's P to bf16, as the existing
  kernel does); pool scores within 1e-4 (fp32 accumulation of exact bf16 products); the whole
  layer within 2e-2.
"""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("triton")

from kernels import dsa_decode as ref  # noqa: E402
from kernels import indexer as ref_idx  # noqa: E402
from kernels.dsa_decode import IndexQuery, IndexWrite, StepLayout  # noqa: E402
from kernels.triton import dsa_decode as tri  # noqa: E402
from tests.test_triton_kernels_dsa import _paged_table, _rel  # noqa: E402
from tests.triton_interp import patch_triton_interpreter  # noqa: E402

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
interp_only = pytest.mark.skipif(not INTERPRET, reason="CPU case: set TRITON_INTERPRET=1")
gpu = pytest.mark.gpu
if INTERPRET:
    patch_triton_interpreter()

# (MLA heads, nope, v, R, q_lora, indexer heads, index dim, kpool, select pools)
TINY = (4, 16, 16, 32, 48, 16, 16, 4, 3)
REAL = (8, 256, 256, 512, 1536, 32, 128, 16, 128)  # rank 0 of TP8


class Case:
    """One step's inputs and caches: requests whose contexts end at `lengths` after the step,
    step_len tokens each, on request rows far past a small running count, pages shuffled.
    integer: small-integer queries, keys and head weights (exact scores in any order)."""

    def __init__(self, shape, lengths, step_len, dtype, device, seed=0, integer=False):
        heads, nope, v, rank, ql, hi, d, kp, sel = shape
        self.shape, self.step_len, self.dtype = shape, step_len, dtype
        b = len(lengths)
        page = 4 * kp
        max_ctx = -(-max(lengths) // page) * page
        num_rows = b + 4
        cpu_gen = torch.Generator().manual_seed(seed)
        self.table, num_slots = _paged_table(num_rows, max_ctx, page, cpu_gen, device)
        gen = torch.Generator(device=device).manual_seed(seed)  # big tensors: made on the device
        self.rows = torch.arange(num_rows - b, num_rows, device=device)
        pos = [n - step_len + i for n in lengths for i in range(step_len)]
        self.positions = torch.tensor(pos, dtype=torch.int64, device=device)
        t = len(pos)
        tok_rows = self.rows.repeat_interleave(step_len)
        self.layout = StepLayout(
            self.table,
            self.rows,
            self.positions,
            self.table[tok_rows, self.positions],
            step_len,
            max(1, max(lengths) // kp),
        )

        def rnd(*size, scale=1.0, as_dtype=dtype):
            return (torch.randn(*size, generator=gen, device=device) * scale).to(as_dtype)

        def ints(*size, lo=-2, hi_=2):
            return torch.randint(lo, hi_ + 1, size, generator=gen, device=device).to(dtype)

        ring = kp - 1 + step_len
        self.latent = rnd(num_slots, rank)
        self.index_keys = ints(num_slots // kp, d) if integer else rnd(num_slots // kp, d)
        self.tail_keys = rnd(num_rows, ring, d)
        self.tail_gates = rnd(num_rows, ring, d)
        # the projections' outputs as views of one stacked GEMM output
        stacked = rnd(t, ql + rank + d + d)
        self.q_a, self.kv_a, self.wk, self.gates = stacked.split([ql, rank, d, d], dim=1)
        self.q_norm = 1 + rnd(ql, scale=0.1)
        self.kv_norm = 1 + rnd(rank, scale=0.1)
        self.k_norm_w = 1 + rnd(d, scale=0.1)
        self.k_norm_b = rnd(d, scale=0.1)
        self.ape = rnd(kp, d, scale=0.5, as_dtype=torch.float32)
        self.q = rnd(t, heads, nope)
        self.kv_b = rnd(heads, nope + v, rank, scale=rank**-0.5)
        if integer:
            self.qi = ints(t, hi, d)
            self.head_w = ints(t, hi, lo=-3, hi_=3)
        else:
            self.qi = rnd(t, hi, d)
            self.head_w = rnd(t, hi)

    def caches(self):
        return {
            "latent": self.latent.clone(),
            "index_keys": self.index_keys.clone(),
            "tail_keys": self.tail_keys.clone(),
            "tail_gates": self.tail_gates.clone(),
        }

    def write(self, ops, caches):
        index = IndexWrite(
            self.wk, self.gates, self.k_norm_w, self.k_norm_b, 1e-6, self.ape,
            caches["index_keys"], caches["tail_keys"], caches["tail_gates"],
        )  # fmt: skip
        return ops.write_step(
            self.q_a, self.kv_a, self.q_norm, self.kv_norm, 1e-5, caches["latent"], self.layout,
            index,
        )  # fmt: skip

    def query(self, index_keys):
        *_, hi, d, kp, sel = self.shape
        return IndexQuery(self.qi, self.head_w, hi**-0.5, index_keys, kp, sel, True)

    def kv_b_nope(self):
        return self.kv_b[:, : self.shape[1]]

    def kv_b_v(self):
        return self.kv_b[:, self.shape[1] :]


def _same_sets(got: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    """Per row: whether the two selections hold the same slots."""
    return (got.sort(dim=1).values == want.sort(dim=1).values).all(dim=1)


def _near_tie_only(case: Case, got, want, scores, tol_rel=1e-3) -> None:
    """Rows whose selections differ: every differing pool's reference score sits at the
    selection threshold, within tol_rel of the row's largest score."""
    kp = case.shape[7]
    r2t, rows = case.table, case.rows.repeat_interleave(case.step_len)
    for i in torch.nonzero(~_same_sets(got, want)).flatten().tolist():
        n_vis = (case.positions[i].item() + 1) // kp
        slot_pool = {
            r2t[rows[i], p * kp].item(): p for p in range(n_vis)
        }  # first slot of each pool -> pool
        pools_got = {slot_pool[s] for s in got[i].tolist() if s in slot_pool}
        pools_want = {slot_pool[s] for s in want[i].tolist() if s in slot_pool}
        diff = pools_got ^ pools_want
        assert len(pools_got) == len(pools_want), i
        vals = scores[i, list(diff)]
        tol = tol_rel * scores[i, :n_vis].abs().max().item()
        assert (vals.max() - vals.min()).item() <= tol, (i, sorted(diff), vals.tolist())


def _check_write(case: Case, tol: float) -> None:
    want_c, got_c = case.caches(), case.caches()
    want = case.write(ref, want_c)
    got = case.write(tri, got_c)
    assert _rel(got, want) <= tol
    slots = case.layout.token_slots
    assert _rel(got_c["latent"][slots], want_c["latent"][slots]) <= tol
    got_c["latent"][slots] = want_c["latent"][slots] = 0
    assert torch.equal(got_c["latent"], want_c["latent"]), "a latent outside the step's slots"
    for name in ("tail_keys", "tail_gates"):
        assert _rel(got_c[name], want_c[name]) <= tol, name
    # pooled row 0 is the padding page's: the reference parks non-closing tokens' writes there
    assert _rel(got_c["index_keys"][1:], want_c["index_keys"][1:]) <= tol
    closes = (case.positions % case.shape[7] == case.shape[7] - 1).any().item()
    changed = not torch.equal(got_c["index_keys"][1:], case.index_keys[1:])
    assert changed == closes, "a closing pool must be written, and only then"


def _check_queries(case: Case, tol: float, plans=(None,), exact=True):
    caches = case.caches()
    t = case.positions.numel()
    want_scores = torch.empty(t, case.layout.max_pools, device=case.q.device)
    want_abs, want = ref.step_queries(
        case.q, case.kv_b_nope(), case.query(caches["index_keys"]), case.layout,
        scores=want_scores,
    )  # fmt: skip
    kp = case.shape[7]
    visible = (torch.arange(case.layout.max_pools, device=case.q.device) + 1) * kp - 1
    visible = visible[None, :] <= case.positions[:, None]
    for plan in plans:
        counters = torch.zeros(t + 3, dtype=torch.int32, device=case.q.device)
        scores = torch.full_like(want_scores, float("nan"))
        got_abs, got = tri.step_queries(
            case.q, case.kv_b_nope(), case.query(caches["index_keys"]), case.layout,
            counters, scores, plan,
        )  # fmt: skip
        assert got.dtype == torch.int32 and got.shape == want.shape
        assert not torch.isnan(got_abs).any() and _rel(got_abs, want_abs) <= tol, plan
        assert torch.count_nonzero(counters) == 0, "counters must be left at zero"
        assert not torch.isnan(scores[visible]).any()
        assert _rel(scores[visible], want_scores[visible]) <= max(tol, 1e-4) / 10, plan
        # the selection on the kernel's own scores: the reference's set, exactly
        pos = ref_idx.select_tokens(scores, case.positions, kp, case.shape[8], True)
        rows = case.rows.repeat_interleave(case.step_len)[:, None]
        on_own = torch.where(pos >= 0, case.table[rows, pos.clamp(min=0)], -1)
        assert _same_sets(got, on_own).all(), plan
        if exact:
            assert _same_sets(got, want).all(), plan
        else:
            _near_tie_only(case, got, want, want_scores)
        # no slot twice, -1 padding only
        for row in got.tolist():
            real = [s for s in row if s >= 0]
            assert len(real) == len(set(real))
    return got


def _check_attention(case: Case, slots: torch.Tensor, tol: float, plans=(None,)) -> None:
    heads, nope, v, rank = case.shape[:4]
    gen = torch.Generator().manual_seed(7)
    q_abs = torch.randn(slots.shape[0], heads, rank, generator=gen).to(case.q.device, case.dtype)
    scale = (rank // 2) ** -0.5
    kv_b_v = case.kv_b_v()
    want = ref.step_attention(q_abs.float(), case.latent.float(), slots, scale, kv_b_v.float())
    for plan in plans:
        got = tri.step_attention(q_abs, case.latent, slots, scale, kv_b_v, plan)
        assert got.shape == (slots.shape[0], heads * v) and got.dtype == case.dtype
        assert not torch.isnan(got).any()
        assert _rel(got, want) <= tol, (plan, _rel(got, want))


# ---------------------------------------------------------------- CPU (interpreter) cases

# contexts after the step: no complete pool (3), fewer pools than selected (9), a pool closing
# at the step's first token (kp * 5 + 1 with step_len 2), at its last (kp * 9), many pools (in
# several pool blocks of 16)
TINY_LENGTHS = [3, 9, 21, 36, 150]


@interp_only
@pytest.mark.parametrize("step_len", [1, 2, 5])
def test_write_step_interp(step_len):
    lengths = [n + step_len for n in TINY_LENGTHS]
    _check_write(Case(TINY, lengths, step_len, torch.float32, "cpu", seed=step_len), 1e-5)


@interp_only
def test_write_step_interp_bf16():
    _check_write(Case(TINY, TINY_LENGTHS, 2, torch.bfloat16, "cpu", seed=3), 1e-2)


@interp_only
@pytest.mark.parametrize("step_len", [1, 2])
def test_queries_interp_exact_ties(step_len):
    """Integer scores: heavy ties, equal in any summation order; several plans (one pool block
    or many, one scan chunk or many, 1-, 2- and 4-bit radix passes)."""
    case = Case(
        TINY, TINY_LENGTHS, step_len, torch.float32, "cpu", seed=10 + step_len, integer=True
    )
    plans = [
        None,
        tri.QueryPlan(block_p=16, chunk=8, radix_bits=1, block_ra=16, num_warps=4),
        tri.QueryPlan(block_p=16, chunk=16, radix_bits=2, block_ra=32, num_warps=4),
    ]
    _check_queries(case, 1e-5, plans)


@interp_only
def test_queries_interp_long_row_plan():
    """A long-row plan (scan chunk past SHORT_CHUNK): a token past SHORT_CHUNK pools takes the
    long scan, a short one the short scan, both exact."""
    case = Case(TINY, [2100, 40], 1, torch.float32, "cpu", seed=12, integer=True)
    plan = tri.QueryPlan(block_p=64, chunk=1024, radix_bits=2, block_ra=32, num_warps=8)
    assert plan.chunk > tri.SHORT_CHUNK and 2100 // TINY[7] > tri.SHORT_CHUNK
    _check_queries(case, 1e-5, [plan])


@interp_only
def test_queries_interp_all_tied():
    """Zero head weights: every score 0 (+0 and -0 alike): the lowest pools win."""
    case = Case(TINY, [70, 45], 1, torch.float32, "cpu", seed=4)
    case.head_w = torch.zeros_like(case.head_w)
    case.head_w[0, ::2] = -0.0
    slots = _check_queries(case, 1e-5)
    kp, sel = TINY[7], TINY[8]
    row = case.rows[0]
    want = case.table[row, : sel * kp].tolist()
    assert sorted(s for s in slots[0, : sel * kp].tolist()) == sorted(want)


@interp_only
def test_queries_interp_random_bf16():
    case = Case(TINY, TINY_LENGTHS, 2, torch.bfloat16, "cpu", seed=5)
    _check_queries(case, 1e-2, exact=False)


@interp_only
def test_queries_interp_shared_layer():
    """No indexer: only the absorbed queries."""
    case = Case(TINY, TINY_LENGTHS, 1, torch.float32, "cpu", seed=6)
    want, _ = ref.step_queries(case.q, case.kv_b_nope(), None, case.layout)
    got, none = tri.step_queries(case.q, case.kv_b_nope(), None, case.layout)
    assert none is None and _rel(got, want) <= 1e-5


@interp_only
@pytest.mark.parametrize("step_len", [1, 2])
def test_attention_interp(step_len):
    case = Case(TINY, TINY_LENGTHS, step_len, torch.float32, "cpu", seed=20 + step_len)
    _, slots = ref.step_queries(case.q, case.kv_b_nope(), case.query(case.index_keys), case.layout)
    plans = [None] + [
        tri.attention_plan(slots.shape[0], slots.shape[1], torch.float32, torch.device("cpu"), n)
        for n in (1, 3)
    ]
    _check_attention(case, slots, 1e-5, plans)


@interp_only
def test_attention_interp_token_blocks():
    """18 tokens: the combine's 16-token blocks (a partial second one) instead of one token per
    program."""
    lengths = [5 + 7 * i for i in range(9)]
    case = Case(TINY, lengths, 2, torch.float32, "cpu", seed=30)
    _, slots = ref.step_queries(case.q, case.kv_b_nope(), case.query(case.index_keys), case.layout)
    plans = [
        tri.attention_plan(slots.shape[0], slots.shape[1], torch.float32, torch.device("cpu"), n)
        for n in (1, 2)
    ]
    _check_attention(case, slots, 1e-5, plans)


@interp_only
def test_layer_step_interp(monkeypatch):
    """The tiny model's DSA layers (one with an indexer, one shared) over a prefill, then a
    decode step and a verify of 2 tokens per request (pools closing at the decode token, at a
    verify's first and at its second token): the fused path (forced on the CPU) gives the
    torch path's outputs, caches and selections (float32; random scores have no near-ties at
    these sizes)."""
    _layer_step(monkeypatch, "cpu", torch.float32, preset="tiny", lengths=[39, 22, 9], tol=1e-5)


# ---------------------------------------------------------------- the whole layer


def _layer_step(monkeypatch, device, dtype, preset, lengths, tol, tp_size=1, steps=(1, 2)):
    import serving.layers.attention.dsa as dsa_layer
    from serving.config import ModelConfig
    from serving.distributed import ParallelState, set_state
    from serving.forward_batch import ForwardBatch
    from serving.layers.stacked_projections import stack_projections
    from serving.memory.cache import allocate_model_cache
    from serving.models.dsa import DSAttention
    from serving.models.random_init import init_module
    from serving.tools.tiny_model import build_config

    specials = {"<|endoftext|>": 0, "<|user|>": 1, "<|observation|>": 2}
    config = ModelConfig.from_dict(build_config(preset, specials))
    gen = torch.Generator(device=device).manual_seed(0)
    set_state(ParallelState(rank=0, tp_size=tp_size))
    try:
        layers = [DSAttention(config, dtype, True), DSAttention(config, dtype, False)]
    finally:
        set_state(ParallelState())
    for layer in layers:
        layer.to(device)
        init_module(layer, config, gen)
        stack_projections(layer)
    max_ctx = -(-(max(lengths) + 4) // 64) * 64
    rows = len(lengths) + 3
    r2t = torch.zeros(rows, max_ctx, dtype=torch.int64, device=device)
    perm = torch.randperm(rows * max_ctx // 16 - 1, generator=torch.Generator().manual_seed(1))
    pages = (perm + 1)[: (rows - 1) * max_ctx // 16].view(rows - 1, -1).to(device)
    r2t[1:] = (pages[:, :, None] * 16 + torch.arange(16, device=device)).flatten(1)
    num_slots = rows * max_ctx + 16
    dsa = "deepseek_sparse_attention"
    caches = allocate_model_cache(
        config, r2t, num_slots, dtype, device, layers=[1, 2], layer_types={1: dsa, 2: dsa},
        num_draft_tokens=max(steps),
    ).layers  # fmt: skip
    cache = [caches[1], caches[2]]  # layer 2 of the tiny preset is a shared one (no index keys)
    for c in cache:
        c.latent.normal_(generator=gen)  # latents of positions the prefill leaves unwritten
    req_rows = list(range(rows - len(lengths), rows))

    def forward(batch, on_fast):
        monkeypatch.setattr(dsa_layer, "fast_path", lambda t: on_fast)
        x = torch.randn(batch.num_tokens, config.hidden_size, generator=gen, device=device)
        x = x.to(dtype)
        out0, sel = layers[0](x, batch, cache[0], None)
        out1, _ = layers[1](x, batch, cache[1], sel)
        return out0, out1, sel

    ids = [1] * sum(lengths)
    prefill = ForwardBatch.build(ids, req_rows, [0] * len(lengths), lengths, r2t)
    with torch.no_grad():
        forward(prefill, on_fast=False)
    starts = torch.tensor(lengths, device=device)
    for step_len in steps:
        batch = ForwardBatch.uniform(
            torch.ones(len(lengths) * step_len, dtype=torch.int64, device=device),
            torch.tensor(req_rows, device=device), starts, step_len, r2t,
            max(lengths) + step_len,
        )  # fmt: skip
        before = _cache_state(cache)
        seed = int(torch.randint(1 << 30, (1,), generator=gen, device=device).item())
        gen.manual_seed(seed)
        with torch.no_grad():
            want = forward(batch, on_fast=False)
        after = _cache_state(cache)
        for (i, k), v in before.items():
            getattr(cache[i], k).copy_(v)
        gen.manual_seed(seed)
        with torch.no_grad():
            got = forward(batch, on_fast=True)
        # float32: the same selection; bf16: a pool this step closes may round its key one
        # ulp apart and cross the threshold, so a token or two may differ
        same = _same_sets(got[2], want[2])
        assert same.all() if dtype == torch.float32 else same.float().mean() >= 0.9, step_len
        for g, w in zip(got[:2], want[:2]):
            assert _rel(g[same], w[same]) <= tol, step_len
        for (i, k), v in after.items():
            mine = getattr(cache[i], k)
            if k == "index_keys":  # row 0: the reference's parking row
                mine, v = mine[1:], v[1:]
            assert _rel(mine, v) <= tol, (step_len, i, k)
        starts = starts + step_len


def _cache_state(cache) -> dict:
    return {
        (i, k): v.clone()
        for i, c in enumerate(cache)
        for k, v in vars(c).items()
        if isinstance(v, torch.Tensor)
    }


# ---------------------------------------------------------------- GPU cases (rank 0 of TP8)

GPU_BATCHES = pytest.mark.parametrize(
    "context, batch, step_len",
    [(4096, 1, 1), (4096, 8, 2), (4096, 32, 1), (65536, 1, 2), (65536, 8, 1), (65536, 32, 2)],
)


def _gpu_lengths(context: int, batch: int, step_len: int) -> list[int]:
    """Contexts near `context`, the first closing a pool at the step's first token."""
    kp = REAL[7]
    base = [context - 7 * i for i in range(batch)]
    base[0] = (context // kp) * kp + step_len - 1 if step_len > 1 else (context // kp) * kp
    return base


@gpu
@GPU_BATCHES
def test_write_step_gpu(context, batch, step_len):
    case = Case(REAL, _gpu_lengths(context, batch, step_len), step_len, torch.bfloat16, "cuda")
    _check_write(case, 1e-2)


@gpu
@GPU_BATCHES
def test_queries_gpu(context, batch, step_len):
    lengths = _gpu_lengths(context, batch, step_len)
    case = Case(REAL, lengths, step_len, torch.bfloat16, "cuda", seed=batch + step_len)
    _check_queries(case, 1e-2, exact=False)


@gpu
def test_queries_gpu_ties():
    """Every pooled key of the first request equal (all its pools tie) and pairs equal in the
    second: the lower pool index wins, as the reference's stable sort."""
    case = Case(REAL, [8192, 4001, 300], 1, torch.bfloat16, "cuda", seed=3)
    kp = REAL[7]
    for i, pair in enumerate((False, True)):
        pools = case.table[case.rows[i], torch.arange(8192 // kp, device="cuda") * kp] // kp
        if pair:
            case.index_keys[pools[1::2]] = case.index_keys[pools[0::2]].clone()
        else:
            case.index_keys[pools] = case.index_keys[pools[0]].clone()
    slots = _check_queries(case, 1e-2, exact=False)
    first = sorted(slots[0, : REAL[8] * kp].tolist())
    assert first == sorted(case.table[case.rows[0], : REAL[8] * kp].tolist())


@gpu
@GPU_BATCHES
def test_attention_gpu(context, batch, step_len):
    lengths = _gpu_lengths(context, batch, step_len)
    case = Case(REAL, lengths, step_len, torch.bfloat16, "cuda", seed=11)
    _, slots = ref.step_queries(case.q, case.kv_b_nope(), case.query(case.index_keys), case.layout)
    _check_attention(case, slots, 1e-2)


@gpu
def test_step_cuda_graph():
    """The three ops captured, inputs changed in place, replayed: the eager results, the
    counters back at zero."""
    case = Case(REAL, _gpu_lengths(65536, 8, 2), 2, torch.bfloat16, "cuda", seed=5)
    caches = case.caches()
    counters = torch.zeros(64, dtype=torch.int32, device="cuda")

    def run():
        q_lora = case.write(tri, caches)
        q_abs, slots = tri.step_queries(
            case.q, case.kv_b_nope(), case.query(caches["index_keys"]), case.layout, counters
        )
        o = tri.step_attention(q_abs, caches["latent"], slots, 0.0625, case.kv_b_v())
        return q_lora, slots, o

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        run()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = run()
    gen = torch.Generator().manual_seed(6)
    for trial in range(2):
        for x in (case.q, case.qi, case.q_a, case.kv_a, case.wk):
            x.copy_(torch.randn(x.shape, generator=gen).to("cuda", x.dtype))
        for o in outs:
            o.fill_(-7 if o.dtype == torch.int32 else float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.count_nonzero(counters) == 0, trial
        eager = run()
        for g, e in zip(outs, eager):
            assert torch.equal(g, e), trial


@gpu
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-4), (torch.bfloat16, 2e-2)])
def test_layer_step_gpu(monkeypatch, dtype, tol):
    """The real rank-0 DSA layer (TP8 shapes, random weights) over a prefill of 3 requests
    past index_topk, then a decode step and a verify step (pools closing at the decode token
    and at a verify's first token): fused vs torch path."""
    _layer_step(monkeypatch, "cuda", dtype, preset="real", lengths=[2607, 2094, 700], tol=tol,
                tp_size=8)  # fmt: skip
