"""The prefix cache in the engine (in-process scheduler, tiny checkpoint, float32 on CPU).

Greedy tokens with the cache equal those without it: multi-turn chats, shared system prompts
with short suffixes around every boundary (kpool, page, fla's chunk), prefixes that end inside
a prefill chunk, EAGLE, after retraction. Every cached state and page holds exactly what a
from-scratch prefill of its tokens computes (an off-by-one anywhere fails it). After a flush,
and under eviction pressure, every row, page and state slot is back on its free list; the pool
invariant is checked after every step.
"""

from __future__ import annotations

import pytest
import torch

from serving.engine import scheduler as scheduler_mod
from serving.engine.build import build_engine
from serving.engine.request import Req
from serving.engine.role import Role
from serving.engine.scheduler import Scheduler
from serving.memory.cache import DSALayerCache, KDALayerCache
from serving.protocol import GenerateRequest
from serving.sampling_params import SamplingParams
from serving.server_args import ServerArgs
from tests.server_proc import eagle_flags

PAGE, KPOOL, GRID = 16, 4, 64  # the tiny checkpoint's kpool; grid = lcm(16, 4, 64)


@pytest.fixture(autouse=True)
def check_every_step(monkeypatch):
    monkeypatch.setattr(scheduler_mod, "CHECK_INVARIANTS", True)


def engine(path, *flags: str, role: Role | None = None) -> Scheduler:
    args = ServerArgs.from_cli(
        ["--model-path", str(path), "--page-size", str(PAGE), "--skip-server-warmup", *flags]
    )
    args.validate()
    return build_engine(args, role)[0]


def greedy(rid: str, prompt: list[int], n: int) -> GenerateRequest:
    return GenerateRequest(
        rid, prompt, SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True)
    )


def run(sched: Scheduler, requests: list[GenerateRequest]) -> dict[str, tuple[list[int], int]]:
    """Output tokens and meta cached_tokens per rid, all requests at once."""
    for r in requests:
        sched.add(r)
    out: dict[str, list[int]] = {}
    cached: dict[str, int] = {}
    while sched.has_work:
        for o in sched.step():
            out.setdefault(o.rid, []).extend(o.new_token_ids)
            if o.finished:
                assert o.finish_reason.kind == "length", o.finish_reason
                cached[o.rid] = o.cached_tokens
    sched.check_invariants()
    return {rid: (out.get(rid, []), cached[rid]) for rid in cached}


def one(sched: Scheduler, prompt: list[int], n: int, rid: str = "r") -> tuple[list[int], int]:
    return run(sched, [greedy(rid, prompt, n)])[rid]


def assert_all_free(sched: Scheduler) -> None:
    assert sched.flush_cache() is None
    pool = sched.pool
    assert not pool.rows.used and not pool.pages.used and not pool.state_slots.used
    assert sched.cache.pages_held == sched.cache.states_held == 0


def tokens(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 1000, (n,), generator=g).tolist()


def grid_below(n: int) -> int:
    return n // GRID * GRID


# ---- greedy tokens with the cache equal those without ----
def test_multi_turn_chat(tiny_ckpt):
    on, off = engine(tiny_ckpt), engine(tiny_ckpt, "--disable-radix-cache")
    prompt, n = tokens(150, seed=1), 20
    previous: list[int] = []
    for turn in range(3):
        got, hit = one(on, prompt, n)
        want, none = one(off, prompt, n)
        assert got == want and none == 0
        # the previous turn's end (prompt + output, its last token never in the KV) is cached
        expected = grid_below(len(previous) - 1) if turn else 0
        assert hit == expected, (turn, hit, expected)
        previous = prompt + got
        prompt = previous + tokens(7, seed=10 + turn)
    hits = sum(grid_below(150 + 27 * t + 20 - 1) for t in range(2))
    assert on.stats.cache_hit_tokens_total == hits
    assert_all_free(on)


@pytest.mark.parametrize("system, shared", [(190, 128), (192, 192), (200, 192)])
def test_shared_system_prompt_with_short_suffixes(tiny_ckpt, system, shared):
    """Suffixes of 1, kpool-1, kpool, page-1, page, page+1, 63, 64 and 65 tokens after system
    prompts that end before, on and after a grid position; no suffix starts like another, so a
    state past the shared part (190: the one at 192 covers two suffix tokens) is never served."""
    on, off = engine(tiny_ckpt), engine(tiny_ckpt, "--disable-radix-cache")
    head = tokens(system, seed=2)
    suffixes = [1, KPOOL - 1, KPOOL, PAGE - 1, PAGE, PAGE + 1, 63, 64, 65]
    for i, k in enumerate(suffixes):
        prompt = head + [1000 + i] + tokens(k - 1, seed=100 + i)
        got, hit = one(on, prompt, 6)
        assert got == one(off, prompt, 6)[0], k
        assert hit == (0 if i == 0 else min(shared, grid_below(len(prompt) - 1))), (k, hit)
    assert_all_free(on)


def test_a_shared_prompt_is_cached_where_requests_branch(tiny_ckpt):
    """vllm#45238's trap: a shared 200-token system prompt, then each request's own 64 tokens.
    The first request's only snapshot (256) covers its own tokens; the second finds the
    first's KV up to 192 and snapshots there too, so every later request hits 192."""
    on, off = engine(tiny_ckpt), engine(tiny_ckpt, "--disable-radix-cache")
    head = tokens(200, seed=14)
    hits = []
    for i in range(4):
        prompt = head + [1000 + i] + tokens(63, seed=70 + i)
        got, hit = one(on, prompt, 4)
        assert got == one(off, prompt, 4)[0]
        hits.append(hit)
    assert hits == [0, 0, 192, 192]
    assert_all_free(on)


def test_prefixes_that_end_inside_a_chunk(tiny_ckpt):
    """Chunks of 48: the grid positions 64 and 128 fall inside chunks, where the KDA layers save
    between two passes; concurrent requests share one prefill batch."""
    flags = ("--chunked-prefill-size", "48", "--max-prefill-tokens", "96")
    on, off = engine(tiny_ckpt, *flags), engine(tiny_ckpt, *flags, "--disable-radix-cache")
    head = tokens(150, seed=3)
    first = [greedy("first", head + tokens(9, seed=4), 8)]
    assert run(on, first) == run(off, first)
    batch = [
        greedy(f"r{i}", head + [1000 + i] + tokens(5 + 11 * i, seed=5 + i), 8) for i in range(4)
    ]
    got, want = run(on, batch), run(off, batch)
    assert {r: t for r, (t, _) in got.items()} == {r: t for r, (t, _) in want.items()}
    assert {hit for _, hit in got.values()} == {128}
    assert_all_free(on)


def test_after_retraction(tiny_ckpt):
    """A pool too small for every request to decode at once: the cache gives its pages up
    first, then requests are retracted; a retracted request comes back through the cache."""
    flags = ("--max-total-tokens", "384", "--max-running-requests", "3")
    on, off = engine(tiny_ckpt, *flags), engine(tiny_ckpt, *flags, "--disable-radix-cache")
    head = tokens(130, seed=6)
    one(on, head + [7], 1)  # caches the shared part (state at 128)
    batch = [greedy(f"r{i}", head + [1000 + i] + tokens(3, seed=20 + i), 80) for i in range(4)]
    got, want = run(on, batch), run(off, batch)
    assert on.stats.retractions > 0 and off.stats.retractions > 0
    assert {r: t for r, (t, _) in got.items()} == {r: t for r, (t, _) in want.items()}
    assert all(hit == 128 for _, hit in got.values())
    assert_all_free(on)


def test_eagle_tokens_and_acceptance_unchanged(distilled_ckpt):
    """The draft's KV is cached with the target's, keyed by (token, next token): prompts that
    part right at a grid position (192) share only the state before it (128), since the draft's
    KV at 191 depends on token 192; so acceptance does not move."""
    flags = (*eagle_flags(2), "--chunked-prefill-size", "48")
    on, off = (
        engine(distilled_ckpt, *flags),
        engine(distilled_ckpt, *flags, "--disable-radix-cache"),
    )
    head = tokens(192, seed=7)
    prompts = [head + [1000 + i] + tokens(20, seed=50 + i) for i in range(3)]
    got, want, hits = [], [], []
    for p in prompts + [None]:
        if p is None:  # the first conversation's next turn
            p = prompts[0] + got[0] + tokens(9, seed=30)
        (g, h), (w, _) = one(on, p, 16), one(off, p, 16)
        got.append(g)
        want.append(w)
        hits.append(h)
    assert got == want
    assert hits == [0, 128, 128, 192], hits
    for stat in ("spec_verify_steps", "spec_committed_tokens"):
        assert getattr(on.stats, stat) == getattr(off.stats, stat), stat
    assert on.stats.spec_committed_tokens > 1.3 * on.stats.spec_verify_steps  # drafts accepted
    assert_all_free(on)


def test_prompt_logprobs_past_a_cached_prefix(tiny_ckpt):
    """A request that scores its prompt from position 100 may reuse only what lies before it
    (the state at 64), and scores exactly what a cache-less engine scores."""
    flags = ("--chunked-prefill-size", "64")  # a snapshot at each chunk's end: 64 and 128
    on, off = engine(tiny_ckpt, *flags), engine(tiny_ckpt, *flags, "--disable-radix-cache")
    head = tokens(150, seed=13)
    one(on, head + [1], 2)  # caches the states at 64 and 128
    scored = {}
    for name, sched in (("on", on), ("off", off)):
        request = greedy("s", head + [2, 3], 3)
        request.return_logprob, request.logprob_start_len = True, 100
        sched.add(request)
        while sched.has_work:
            for o in sched.step():
                if o.input_logprobs:
                    scored[name] = [(e.token_id, e.logprob) for e in o.input_logprobs]
                if o.finished:
                    scored[name + " hit"] = o.cached_tokens
    assert scored["on hit"] == 64 and len(scored["on"]) == 52
    assert [t for t, _ in scored["on"]] == [t for t, _ in scored["off"]]
    torch.testing.assert_close([v for _, v in scored["on"]], [v for _, v in scored["off"]])
    assert_all_free(on)


# ---- what the cache holds ----
class HoldRole(Role):
    """Keeps every finished request's row and pages until the test has read them."""

    def __init__(self) -> None:
        self.held: dict[str, Req] = {}

    def finished(self, req: Req) -> bool:
        self.held[req.rid] = req
        return True

    def owned(self) -> list[Req]:
        return list(self.held.values())


def state_nodes(sched: Scheduler):
    """(node, its keys from the root) for every node with a state snapshot."""
    stack = [(child, list(child.key)) for child in sched.cache.root.children.values()]
    while stack:
        node, keys = stack.pop()
        if node.slot is not None:
            yield node, keys
        stack += [(c, keys + list(c.key)) for c in node.children.values()]


def assert_caches_hold_their_tokens(sched: Scheduler, ckpt, *flags: str) -> int:
    """Every snapshot equals the KDA state a fresh, cache-less prefill of exactly its node's
    tokens leaves, and every cached page equals that prefill's KV (latents and pooled index
    keys, target and, with EAGLE, draft): a state taken one token early or late, or KV cached
    before its draft saw the next token, fails. Returns the snapshots checked."""
    hold = HoldRole()
    ref = engine(ckpt, *flags, "--disable-radix-cache", role=hold)
    vocab = sched.pool.config.vocab_size
    pair = sched.pool.draft is not None
    checked = 0
    for node, keys in state_nodes(sched):
        depth = len(keys)
        ids = [k // vocab for k in keys] + [keys[-1] % vocab] if pair else keys
        # the state after exactly `depth` tokens; the KV with each position's next token known
        ref.add(greedy("state", ids[:depth], 1))
        ref.add(greedy("kv", ids[: depth + 1], 1))
        while ref.has_work:
            ref.step()
        state_row, kv_row = hold.held["state"].row, hold.held["kv"].row
        for i, layer in sched.pool.target.layers.items():
            if isinstance(layer, KDALayerCache):
                mine = ref.pool.target.kda(i)
                torch.testing.assert_close(layer.saved_state[node.slot], mine.state[state_row])
                torch.testing.assert_close(layer.saved_conv[node.slot], mine.conv[state_row])
        slots = torch.tensor([p * PAGE + o for p in node.path_pages() for o in range(PAGE)])
        theirs = ref.pool.req_to_token[kv_row, :depth]
        caches = [(sched.pool.target, ref.pool.target)]
        if pair:
            caches.append((sched.pool.draft, ref.pool.draft))
        for cache, mine in caches:
            for i, layer in cache.layers.items():
                if not isinstance(layer, DSALayerCache):
                    continue
                torch.testing.assert_close(layer.latent[slots], mine.dsa(i).latent[theirs])
                if layer.index_keys is not None:
                    pools, their_pools = slots[::KPOOL] // KPOOL, theirs[::KPOOL] // KPOOL
                    want = mine.dsa(i).index_keys[their_pools]
                    torch.testing.assert_close(layer.index_keys[pools], want)
        for req in hold.held.values():
            ref.release_held(req)
        hold.held.clear()
        ref.step()  # checks the reference's pool invariant
        checked += 1
    return checked


def test_every_snapshot_and_page_holds_exactly_its_tokens(tiny_ckpt):
    """States saved inside chunks (48-token chunks; and three fresh prompts in one prefill
    batch, each saved inside itself), at chunk ends, while decoding (every grid crossing
    cached: --mamba-track-interval 64) and at a request's end."""
    flags = ("--chunked-prefill-size", "48", "--mamba-track-interval", "64")
    sched = engine(tiny_ckpt, *flags)
    run(sched, [greedy("a", tokens(150, seed=8), 90), greedy("b", tokens(70, seed=9), 60)])
    assert assert_caches_hold_their_tokens(sched, tiny_ckpt, *flags) == 5
    assert_all_free(sched)
    sched = engine(tiny_ckpt)
    run(sched, [greedy(f"r{n}", tokens(n, seed=n), 1) for n in (100, 90, 70)])
    assert assert_caches_hold_their_tokens(sched, tiny_ckpt) == 3
    assert_all_free(sched)


def test_eagle_snapshots_and_draft_pages_hold_exactly_their_tokens(distilled_ckpt):
    """With EAGLE, decode's snapshots come from the verify's per-position history, and the
    draft's KV is cached too."""
    flags = (*eagle_flags(3), "--chunked-prefill-size", "48", "--mamba-track-interval", "64")
    sched = engine(distilled_ckpt, *flags)
    run(sched, [greedy("a", tokens(100, seed=10), 150)])
    assert assert_caches_hold_their_tokens(sched, distilled_ckpt, *flags) >= 3
    assert_all_free(sched)


def test_a_hit_never_reads_draft_kv_made_for_another_next_token(distilled_ckpt):
    """Two prompts that part right at a grid position (192): the draft's KV at 191 was made
    with token 192, so the second prompt may reuse only what lies before 128; every target and
    draft latent it reads equals a cache-less run's."""
    flags = (*eagle_flags(2), "--chunked-prefill-size", "48")
    roles = HoldRole(), HoldRole()
    on = engine(distilled_ckpt, *flags, role=roles[0])
    off = engine(distilled_ckpt, *flags, "--disable-radix-cache", role=roles[1])
    head = tokens(192, seed=12)
    first, second = (head + [1000 + i] + tokens(20, seed=60 + i) for i in range(2))
    for sched, role, prompts in ((on, roles[0], (first, second)), (off, roles[1], (second,))):
        for i, prompt in enumerate(prompts):
            sched.add(greedy(f"p{i}", prompt, 4))
            while sched.has_work:
                sched.step()
            if i + 1 < len(prompts):
                sched.release_held(role.held.pop(f"p{i}"))
    mine, theirs = roles[0].held["p1"], roles[1].held["p0"]
    assert mine.cached_tokens == 128
    n = len(second)
    for cache_on, cache_off in ((on.pool.target, off.pool.target), (on.pool.draft, off.pool.draft)):
        for i, layer in cache_on.layers.items():
            if isinstance(layer, DSALayerCache):
                got = layer.latent[on.pool.req_to_token[mine.row, :n]]
                want = cache_off.dsa(i).latent[off.pool.req_to_token[theirs.row, :n]]
                torch.testing.assert_close(got, want)
    for sched, role in ((on, roles[0]), (off, roles[1])):
        for req in list(role.held.values()):
            sched.release_held(req)
        role.held.clear()
        sched.step()
    assert_all_free(on)


# ---- memory ----
def test_eviction_under_pressure_leaks_nothing(tiny_ckpt):
    """A 25-page KV pool and 2 snapshot slots for three system prompts, one of them in every
    round: pages and states are evicted (LRU) to admit and grow requests, the hot prompt stays
    cached; the invariant holds after every step and nothing leaks."""
    flags = ("--max-total-tokens", "400", "--max-mamba-cache-size", "2")
    on, off = engine(tiny_ckpt, *flags), engine(tiny_ckpt, *flags, "--disable-radix-cache")
    heads = [tokens(140, seed=40 + h) for h in range(3)]
    hits: dict[int, list[int]] = {0: [], 1: [], 2: []}
    for rnd, other in enumerate((1, 2, 1)):
        batch = [
            greedy(f"{rnd}-{h}", heads[h] + [1000 + rnd] + tokens(4, seed=rnd), 16)
            for h in (0, other)
        ]
        got, want = run(on, batch), run(off, batch)
        assert {r: t for r, (t, _) in got.items()} == {r: t for r, (t, _) in want.items()}
        for h in (0, other):
            hits[h].append(got[f"{rnd}-{h}"][1])
        assert on.cache.states_held <= 2 and on.cache.pages_held <= 25
    assert hits[0] == [0, 128, 128], hits  # the hot prompt survives every eviction
    assert hits[1] == [0, 0] and hits[2] == [0], hits  # h1 was evicted while h2 ran
    assert_all_free(on)


def test_flush_is_refused_while_requests_live(tiny_ckpt):
    sched = engine(tiny_ckpt)
    one(sched, tokens(100, seed=11), 4)
    assert sched.stats.cached_pages == 4 and sched.stats.cached_states == 1
    sched.add(greedy("live", tokens(100, seed=12), 50))
    sched.step()
    assert "running or waiting" in sched.flush_cache()
    sched.abort("live")
    sched.step()
    assert_all_free(sched)


# ---- the kernel warm-up covers what the cache path runs ----
def kda_path(batch, history) -> tuple:
    """What a KDA layer's call does with this batch: the path of serving/layers/attention/kda.py
    (snapshot passes, and whether one takes a gathered token index), several requests or one,
    whether a request continues a state (a snapshot loaded at a hit, or an earlier chunk)."""
    if batch.is_decode:
        kind = "decode"
    elif batch.step_len is not None:
        kind = "uniform"
    elif batch.kda_saves is None:
        kind = "extend"
    elif any(isinstance(p.index, torch.Tensor) for p in batch.kda_saves.passes):
        kind = "passes, gathered"
    else:
        kind = "passes"
    return kind, len(batch.lens_cpu) > 1, any(batch.starts_cpu), history is not None


def test_kernel_warmup_meets_indexer_pool_counts_off_the_multiple_of_16(tiny_ckpt, monkeypatch):
    """Triton specializes the indexer's scoring kernel on its pool count (longest sequence //
    kpool) being a multiple of 16; 2^i (+ 1) token prompts only give multiples from 16 kpool
    tokens up, and a hit on a 4,096-token prefix (260 pools) compiled the kernel under the first
    users' requests on the H200. The warm-up meets the other case too, with >= 1,024 query
    tokens (the kernel's multi-query blocks) at both parities of the token count."""
    from serving.engine.kernel_warmup import prepare_kernels
    from serving.layers.attention import dsa

    seen: set[tuple[int, int]] = set()
    real = dsa._score_ragged  # one scoring launch per extend, over every query of the batch

    def recording(shape, q, head_w, batch, index, cache):
        seen.add((q.shape[0], index.max_pools))
        return real(shape, q, head_w, batch, index, cache)

    monkeypatch.setattr(dsa, "_score_ragged", recording)
    flags = ("--chunked-prefill-size", "2048", "--max-prefill-tokens", "2048")
    sched = engine(tiny_ckpt, *flags, "--context-length", "4096")
    prepare_kernels(sched)
    big = {(n % 16 == 0, pools % 16 == 0) for n, pools in seen if n >= 1024}
    assert big == {(True, True), (False, True), (True, False), (False, False)}, sorted(seen)
    assert_all_free(sched)


def test_kernel_warmup_meets_both_mhc_boundaries(tiny_ckpt, monkeypatch):
    """The warm-up's prefills meet the mHC boundary both ways (kernels/triton/mhc.py): fused up
    to BOUNDARY_MAX_TOKENS, mhc_post then mhc_pre past it."""
    pytest.importorskip("triton")  # the threshold lives beside the kernels
    from kernels.triton.mhc import BOUNDARY_MAX_TOKENS
    from serving.engine.kernel_warmup import prepare_kernels
    from serving.layers.mhc import HyperConnection

    seen: set[int] = set()
    real = HyperConnection.boundary

    def recording(self, out, streams, norm):
        seen.add(out.shape[0])
        return real(self, out, streams, norm)

    monkeypatch.setattr(HyperConnection, "boundary", recording)
    flags = ("--chunked-prefill-size", "48", "--max-prefill-tokens", "96")
    sched = engine(tiny_ckpt, *flags, "--context-length", "1024")
    prepare_kernels(sched)
    assert min(seen) <= BOUNDARY_MAX_TOKENS < max(seen), sorted(seen)
    assert_all_free(sched)


def test_kernel_warmup_runs_every_kda_path_the_cache_serves(tiny_ckpt, monkeypatch):
    """Every KDA path (and flag combination) that chats with a shared system prompt, concurrent
    and single random prompts run with the cache on has run in the start-up warm-up already
    (on CUDA each is compiled and tuned there, not under a user's request); the warm-up leaves
    no request, page, state slot or counter behind."""
    from serving.engine.kernel_warmup import prepare_kernels
    from serving.models import kda as kda_model

    seen: set[tuple] = set()
    real = kda_model.KDAttention.forward

    def recording(self, x, batch, cache, history=None):
        seen.add(kda_path(batch, history))
        return real(self, x, batch, cache, history)

    monkeypatch.setattr(kda_model.KDAttention, "forward", recording)
    flags = ("--chunked-prefill-size", "48", "--max-prefill-tokens", "96")  # saves in chunks
    sched = engine(tiny_ckpt, *flags, "--context-length", "1024")
    assert prepare_kernels(sched) > 10
    assert_all_free(sched)
    assert sched.stats.prompt_tokens_total == sched.stats.cache_lookup_tokens_total == 0
    # the batch lines count from the zeroed counters (an H200 log read "#cached-token: -768")
    assert sched.batch_log.hits == sched.batch_log.decoded == 0
    warm, served = set(seen), seen
    seen.clear()
    system = tokens(150, seed=40)
    chats = {c: system + tokens(9 + 7 * c, seed=41 + c) for c in range(4)}
    for turn in range(2):
        got = run(sched, [greedy(f"c{c}t{turn}", p, 24) for c, p in chats.items()])
        chats = {c: p + got[f"c{c}t{turn}"][0] + tokens(5, seed=60 + c) for c, p in chats.items()}
    run(sched, [greedy(f"x{i}", tokens(60 + 37 * i, seed=70 + i), 2) for i in range(3)])
    one(sched, tokens(200, seed=80), 2)
    assert served - warm == set(), f"served first after the warm-up: {served - warm}"
    assert {"passes", "extend", "decode"} <= {kind for kind, *_ in served}, served
    assert_all_free(sched)
