"""EAGLE speculative decoding with the NextN draft (in-process scheduler, tiny checkpoint).

The checkpoint's target speaks a synthetic first-order language (its lm_head refitted by
training/fit_target_head.py) and its draft is distilled on that target
(training/distill_nextn.py --fit-target-head), so drafts are accepted on prompts the draft
never saw: accepted runs, rejections and kpool boundaries inside verify chunks are all exercised.
Greedy output must equal plain decoding token for token; sampled output must follow the same
distribution.
"""

from __future__ import annotations

import pytest
import torch

from serving.engine import scheduler as scheduler_mod
from serving.engine.admission import Admission
from serving.engine.build import build_engine
from serving.engine.decode_batch import DecodeManager
from serving.protocol import GenerateRequest
from serving.sampling_params import SamplingParams
from serving.server_args import ServerArgs
from tests.conftest import DISTILL_PROMPT_LEN as PROMPT_LEN
from tests.server_proc import eagle_flags
from training.distill_nextn import training_prompts


@pytest.fixture(autouse=True)
def check_every_step(monkeypatch):
    monkeypatch.setattr(scheduler_mod, "CHECK_INVARIANTS", True)


@pytest.fixture(scope="module")
def distilled(distilled_ckpt):
    return distilled_ckpt


def engine(path, steps: int = 0, *flags: str):
    args = ServerArgs.from_cli(
        [
            "--model-path",
            str(path),
            "--page-size",
            "16",
            "--skip-server-warmup",
            *eagle_flags(steps),
            *flags,
        ]
    )
    args.validate()
    return build_engine(args)[0]


def run(sched, requests) -> dict[str, list[int]]:
    for r in requests:
        sched.add(r)
    out: dict[str, list[int]] = {}
    while sched.has_work:
        for o in sched.step():
            out.setdefault(o.rid, []).extend(o.new_token_ids)
    sched.check_invariants()
    assert sched.flush_cache() is None  # the prefix cache's pages and states go back too
    pool = sched.pool
    assert not pool.rows.used and not pool.pages.used and not pool.state_slots.used, "leak"
    return out


def new_prompts(lengths: tuple[int, ...], seed: int = 99) -> list[list[int]]:
    """Random prompts from the distillation's token range, none of them a distillation prompt."""
    seen = training_prompts(1024, 256, PROMPT_LEN, seed=0)
    g = torch.Generator().manual_seed(seed)
    out = [torch.randint(0, 1000, (n,), generator=g).tolist() for n in lengths]
    assert not any(p in seen for p in out)
    return out


def prompts() -> list[list[int]]:
    return new_prompts((PROMPT_LEN,) * 6 + (5, 37, 70))


def greedy(i: int, p: list[int], n: int = 40) -> GenerateRequest:
    return GenerateRequest(
        f"r{i}", p, SamplingParams(max_new_tokens=n, temperature=0, ignore_eos=True)
    )


# accept length on these new prompts: 1.78 / 2.26 / 2.73 (steps 1 / 2 / 3) with the fixture
def record_verifies(monkeypatch) -> list[tuple[int, int]]:
    """(position n of y, drafts accepted) of every verify committed, sync or overlapped."""
    verified: list[tuple[int, int]] = []
    real = DecodeManager._verified

    def recording(self, req, tokens):
        verified.append((req.cached, len(tokens) - 1))
        real(self, req, tokens)

    monkeypatch.setattr(DecodeManager, "_verified", recording)
    return verified


@pytest.mark.parametrize("steps, min_accept", [(1, 1.4), (2, 1.6), (3, 1.8)])
def test_greedy_with_speculation_equals_without(distilled, steps, min_accept, monkeypatch):
    verified = record_verifies(monkeypatch)
    ps = prompts()
    plain = run(engine(distilled), [greedy(i, p) for i, p in enumerate(ps)])
    sched = engine(distilled, steps)
    spec = run(sched, [greedy(i, p) for i, p in enumerate(ps)])
    assert spec == plain
    accept = sched.stats.spec_committed_tokens / sched.stats.spec_verify_steps
    assert accept > min_accept, (
        f"drafts were hardly accepted ({accept:.2f}): the test proves little"
    )
    # The cases the KDA roll-back and the indexer's ring must survive: verify positions are
    # n..n+steps, accepted ones n..n+a; a pool closes at positions p with p % kpool == kpool-1.
    kp = sched.runner.model.config.index_kpool

    def closes(lo: int, hi: int) -> bool:  # does a pool close at a position in lo..hi?
        return any(p % kp == kp - 1 for p in range(lo, hi + 1))

    accepted_across = [n for n, a in verified if closes(n, n + a - 1)]
    rejected_after = [n for n, a in verified if a < steps and closes(n + a, n + a)]
    rejected_closing = [n for n, a in verified if a < steps and closes(n + a + 1, n + steps)]
    assert accepted_across and rejected_after and rejected_closing, (
        len(accepted_across),
        len(rejected_after),
        len(rejected_closing),
    )


@pytest.mark.parametrize("steps", [1, 3])
def test_overlapped_speculation_gives_the_tokens_of_the_sync_order(distilled, steps, monkeypatch):
    """EAGLE under the overlap scheduler (the default: the host learns a step's accepted count
    one step later; the next step reads y and n on the device) equals
    --disable-overlap-schedule's tokens, requests stopping while a step is in flight (a stop
    token, possibly inside an accepted run; max_tokens) included; the overlapped path really ran,
    deferred a release, and nothing leaks (run checks). With the prefix cache on, steps near a
    snapshot grid position run sync: the cache's snapshots must be the same too."""
    ps = prompts()
    free = run(engine(distilled), [greedy(0, ps[0], 12)])["r0"]

    def requests():
        return [
            GenerateRequest(
                "stop", ps[0], SamplingParams(max_new_tokens=12, temperature=0,
                                              stop_token_ids=[free[5]], ignore_eos=True)),
            GenerateRequest("eos", ps[1], SamplingParams(max_new_tokens=30, temperature=0)),
            greedy(2, ps[2], 3),
            greedy(3, ps[6], 17),
            greedy(4, ps[7], 40),
            GenerateRequest(
                "hot", ps[3], SamplingParams(max_new_tokens=20, temperature=0.7, top_k=8,
                                            ignore_eos=True)),
        ]  # fmt: skip

    overlapped = {"launched": 0, "deferred": 0}
    real_launch, real_settle = DecodeManager._launch_speculative, Admission.settle

    def counting_launch(self, reqs):
        overlapped["launched"] += 1
        return real_launch(self, reqs)

    def counting_settle(self):
        overlapped["deferred"] += bool(self.deferred)
        real_settle(self)

    monkeypatch.setattr(DecodeManager, "_launch_speculative", counting_launch)
    monkeypatch.setattr(Admission, "settle", counting_settle)
    for cache in ((), ("--disable-radix-cache",)):
        sync = run(engine(distilled, steps, "--disable-overlap-schedule", *cache), requests())
        assert overlapped["launched"] == 0 and overlapped["deferred"] == 0
        got = run(engine(distilled, steps, *cache), requests())
        hot = got.pop("hot"), sync.pop("hot")  # sampled: only its length is comparable
        assert len(hot[0]) == len(hot[1]) == 20
        assert got == sync, cache
        assert sync["stop"] == free[:6]
        assert overlapped["launched"] and overlapped["deferred"]
        overlapped.update(launched=0, deferred=0)


def test_overlapped_speculation_retracts_and_recomputes(distilled):
    """Out of KV pages, an overlapped EAGLE engine retracts (only with no step in flight: the
    growth it asks for covers the step in flight too) and recomputes: plain decoding's tokens,
    nothing leaked (run checks)."""
    ps = [p[:40] for p in prompts()[:6]]
    small = ("--max-total-tokens", "160", "--max-running-requests", "4", "--disable-radix-cache")
    plain = run(engine(distilled, 0, *small), [greedy(i, p) for i, p in enumerate(ps)])
    sched = engine(distilled, 3, *small)
    assert run(sched, [greedy(i, p) for i, p in enumerate(ps)]) == plain
    assert sched.stats.retractions > 0


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "sync"])
def test_requests_that_fill_the_context_finish_under_speculation(distilled, overlap):
    """prompt + max_tokens == the context length: an EAGLE step near the end writes verify
    positions past the context (and, overlapped, the step in flight's too). The request table
    maps them (pool.table_width); before, such a request could not grow, was taken for one out
    of pages, and got a 503 while the others were retracted in a loop that never ended."""
    context = 128
    lengths = range(96, 125, 4)
    ps = [new_prompts((n,), seed=n)[0] for n in lengths]
    flags = ("--context-length", str(context), "--disable-radix-cache")
    flags += () if overlap else ("--disable-overlap-schedule",)
    reqs = [greedy(i, p, context - len(p)) for i, p in enumerate(ps)]
    plain = run(engine(distilled, 0, *flags), reqs)
    sched = engine(distilled, 3, *flags)
    for r in reqs:
        sched.add(r)
    out: dict[str, list[int]] = {}
    for _ in range(1000):  # a livelock fails here instead of hanging
        if not sched.has_work:
            break
        for o in sched.step():
            out.setdefault(o.rid, []).extend(o.new_token_ids)
            assert not o.finished or o.finish_reason.kind == "length", (o.rid, o.finish_reason)
    assert not sched.has_work and sched.stats.retractions == 0
    assert out == plain


def chi_square_homogeneity(a: list[int], b: list[int]) -> tuple[float, float]:
    """Statistic and its p = 1e-3 critical value; categories expected < 5 times are pooled."""
    cats: dict[int, list[int]] = {}
    for i, sample in enumerate((a, b)):
        for t in sample:
            cats.setdefault(t, [0, 0])[i] += 1
    pooled, rare = [], [0, 0]
    for na, nb in cats.values():
        if (na + nb) / 2 < 5:
            rare = [rare[0] + na, rare[1] + nb]
        else:
            pooled.append([na, nb])
    if sum(rare):
        pooled.append(rare)
    stat = sum((n - (na + nb) / 2) ** 2 / ((na + nb) / 2) for na, nb in pooled for n in (na, nb))
    k = max(len(pooled) - 1, 1)  # Wilson-Hilferty quantile, z(1 - 1e-3) = 3.09
    critical = k * (1 - 2 / (9 * k) + 3.09 * (2 / (9 * k)) ** 0.5) ** 3
    return stat, critical


def seeded_tokens(
    path, steps: int, seeds: range, n: int = 3, temperature: float = 1.0
) -> list[list[int]]:
    """n tokens per seed for one prompt, sampled over the top 4."""
    prompt = new_prompts((PROMPT_LEN,), seed=5)[0]
    sampling = {"max_new_tokens": n, "temperature": temperature, "top_k": 4, "ignore_eos": True}
    reqs = [GenerateRequest(f"s{s}", prompt, SamplingParams(seed=s, **sampling)) for s in seeds]
    out = run(engine(path, steps), reqs)
    return [out[f"s{s}"] for s in seeds]


def test_rejection_sampling_keeps_the_target_distribution(distilled):
    """The 2nd and 3rd sampled tokens (decided by verify: accepted draft or correction) follow
    the same distribution with and without speculation (independent seeds, chi-square)."""
    plain = seeded_tokens(distilled, 0, range(0, 400))
    spec = seeded_tokens(distilled, 2, range(10_000, 10_400))
    for position in (1, 2):
        stat, critical = chi_square_homogeneity(
            [t[position] for t in plain], [t[position] for t in spec]
        )
        assert stat < critical, (position, stat, critical)


def test_seeded_sampling_with_speculation_equals_without(distilled):
    """A seeded draw is keyed by output position, so verify's draws at rejected positions do not
    shift later ones: the same seeds give the same tokens with and without speculation."""
    plain = seeded_tokens(distilled, 0, range(24), n=6, temperature=4.0)  # some drafts rejected
    assert len({tuple(t) for t in plain}) >= 8  # the seeds really sample
    assert seeded_tokens(distilled, 2, range(24), n=6, temperature=4.0) == plain


def test_speculative_flags_are_validated(tiny_ckpt):
    from serving.server_args import ArgsError

    for flags, msg in (
        (["--speculative-num-steps", "2", "--speculative-eagle-topk", "4"], "topk"),
        (["--speculative-num-steps", "2", "--speculative-num-draft-tokens", "5"], "num-draft"),
        ([], "--speculative-num-steps None"),
    ):
        args = ServerArgs.from_cli(
            ["--model-path", str(tiny_ckpt), "--speculative-algorithm", "EAGLE", *flags]
        )
        with pytest.raises(ArgsError, match=msg):
            args.validate()


def test_accept_length_is_reported_in_metrics(distilled, tmp_path):
    import httpx

    from tests.server_proc import Server

    srv = Server(
        distilled,
        "--speculative-algorithm",
        "EAGLE",
        "--speculative-num-steps",
        "2",
        log_dir=tmp_path,
    )
    try:
        body = {
            "input_ids": new_prompts((PROMPT_LEN,), seed=6)[0],
            "sampling_params": {"max_new_tokens": 24, "temperature": 0, "ignore_eos": True},
        }
        assert httpx.post(srv.url + "/generate", json=body, timeout=60).status_code == 200
        srv.idle_pool()
        metrics = httpx.get(srv.url + "/metrics").text
        line = next(ln for ln in metrics.splitlines() if ln.startswith("sglang:spec_accept_length"))
        assert float(line.split()[-1]) > 1.0
        assert "sglang:spec_accept_rate" in metrics
    finally:
        srv.stop()
