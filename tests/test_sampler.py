from __future__ import annotations

import math

import pytest
import torch

from serving.executor.logits_processing import apply_penalties
from serving.executor.sampler import Sampler, SamplingState
from serving.sampling_params import SamplingParams

EOS = 5
# chi-square critical values at p = 1e-3 by degrees of freedom
CHI2_CRITICAL_1E3 = {1: 10.828, 2: 13.816, 3: 16.266, 4: 18.467, 5: 20.515}


def state(
    seed: int | None = None,
    prompt: tuple[int, ...] = (),
    output: tuple[int, ...] = (),
    **params: object,
) -> SamplingState:
    return SamplingState(
        params=SamplingParams(seed=seed, **params),
        prompt_ids=list(prompt),
        output_ids=list(output),
        eos_token_ids=frozenset({EOS}),
    )


def draw_counts(sampler: Sampler, logits: torch.Tensor, n: int, **params: object) -> list[int]:
    """Token counts of n unseeded draws from one logits row (one batch of n rows)."""
    tokens, _ = sampler.sample(logits.expand(n, -1), [state(**params) for _ in range(n)])
    return torch.bincount(torch.tensor(tokens), minlength=logits.shape[-1]).tolist()


def chi_square(counts: list[int], probs: list[float]) -> float:
    total = sum(counts)
    return sum((c - total * p) ** 2 / (total * p) for c, p in zip(counts, probs))


def logits_of(probs: list[float]) -> torch.Tensor:
    return torch.tensor(probs).log()


# ---------------------------------------------------------------- greedy


def test_greedy_is_argmax_and_ties_go_to_lowest_id():
    torch.manual_seed(0)
    logits = torch.randn(4, 50)
    logits[0, [7, 3, 40]] = 9.0  # three-way tie
    logits[3, :] = 0.0
    states = [
        state(temperature=0.0),
        state(top_k=1),
        state(seed=3, temperature=0.0),
        state(temperature=0.0),
    ]
    tokens, _ = Sampler(50, "cpu").sample(logits, states)
    assert tokens == [3, int(logits[1].argmax()), int(logits[2].argmax()), 0]


def test_greedy_rows_consume_no_random_numbers():
    logits = torch.randn(1, 20, generator=torch.Generator().manual_seed(1))
    with_greedy = Sampler(20, "cpu", seed=5)
    greedy = [state(seed=11, temperature=0.0), state(temperature=0.0), state(top_k=1)]
    with_greedy.sample(logits.expand(3, -1), greedy)

    alone = Sampler(20, "cpu", seed=5)
    batch = logits.expand(64, -1)
    assert (
        with_greedy.sample(batch, [state() for _ in range(64)])[0]
        == alone.sample(batch, [state() for _ in range(64)])[0]
    )


def test_greedy_rows_unaffected_by_other_rows():
    torch.manual_seed(2)
    logits = torch.randn(5, 30)
    states = [
        state(temperature=0.0, seed=9),
        state(temperature=1.3, top_p=0.5),
        state(temperature=0.0),
        state(seed=4, min_p=0.2),
        state(top_k=1, temperature=2.0),
    ]
    tokens, _ = Sampler(30, "cpu").sample(logits, states)
    assert [tokens[i] for i in (0, 2, 4)] == logits[[0, 2, 4]].argmax(-1).tolist()


# ---------------------------------------------------------------- seeded reproducibility

TARGETS = [
    {"temperature": 0.8},
    {"temperature": 1.2, "top_k": 10, "top_p": 0.9, "min_p": 0.05, "repetition_penalty": 1.3},
]


def seeded_run(params: dict, position: int, others: list[dict], steps: int = 12) -> list[int]:
    """Tokens drawn for a seed-42 row placed at `position` among `others`, over several steps."""
    vocab = 40
    target_logits = torch.randn(vocab, generator=torch.Generator().manual_seed(7))
    target = state(seed=42, prompt=(1, 2, 3), output=(4,), **params)
    sampler = Sampler(vocab, "cpu", seed=position)
    drawn = []
    for step in range(steps):
        rows = [state(prompt=(5,), output=(6, 6), **p) for p in others]
        rows.insert(position, target)
        noise = torch.randn(len(rows), vocab, generator=torch.Generator().manual_seed(step))
        noise[position] = target_logits
        tokens, _ = sampler.sample(noise, rows)
        drawn.append(tokens[position])
        target.output_ids.append(tokens[position])  # as the scheduler does
    return drawn


MIXES = [
    [],
    [{"temperature": 0.0}, {"temperature": 0.5, "top_k": 3}],
    [{"seed": 7, "top_p": 0.3}, {}, {"min_p": 0.5, "frequency_penalty": 1.0}, {"top_k": 1}],
]


@pytest.mark.parametrize("params", TARGETS)
def test_seeded_row_reproducible_across_runs_positions_and_mixes(params: dict):
    reference = seeded_run(params, 0, [])
    assert len(set(reference)) > 1  # the row really samples
    assert seeded_run(params, 0, []) == reference
    for others in MIXES:
        for position in range(len(others) + 1):
            assert seeded_run(params, position, others) == reference


def test_seeded_draw_depends_only_on_seed_and_output_position():
    """A PD decode worker continues prefill's first token with a fresh sampler, and EAGLE's
    verify draws at positions that may be rejected: neither may shift a seeded row's later
    draws, so a draw is keyed by (seed, output position) alone."""
    vocab, steps = 40, 10
    logits = torch.randn(1, vocab, generator=torch.Generator().manual_seed(7))

    def run(sampler: Sampler, output: list[int], extra_draws: int = 0) -> list[int]:
        target = state(seed=42, prompt=(1, 2), output=tuple(output), temperature=1.3)
        while len(target.output_ids) < steps:
            for _ in range(extra_draws):  # draws whose tokens are thrown away
                sampler.sample(logits, [state(seed=42, output=(9,) * 7, temperature=1.3)])
            target.output_ids.append(sampler.sample(logits, [target])[0][0])
        return target.output_ids

    whole = run(Sampler(vocab, "cpu"), [])
    assert len(set(whole)) > 2
    assert run(Sampler(vocab, "cpu", seed=9), whole[:1]) == whole  # PD: decode from token 1
    assert run(Sampler(vocab, "cpu"), whole[:4], extra_draws=2) == whole


# ---------------------------------------------------------------- truncation

# probabilities by rank; RANKED_IDS[r] is the token id holding rank r
RANKED_PROBS = [0.3, 0.2, 0.15, 0.12, 0.1, 0.08, 0.03, 0.02]
RANKED_IDS = [5, 2, 7, 0, 3, 6, 1, 4]


@pytest.mark.parametrize(
    ("params", "kept_ranks"),
    [
        ({"top_k": 3}, 3),
        ({"top_p": 0.6}, 3),  # mass before rank 3 is 0.65
        ({"min_p": 0.3}, 5),  # 0.1 >= 0.09 > 0.08
        ({"top_k": 4, "top_p": 0.8}, 3),  # top_p over the top-k renormalised mass (0.65 / 0.77)
        ({"temperature": 2.0, "min_p": 0.5}, 6),  # min_p after temperature: sqrt(.08 / .3) > .5
        ({"temperature": 0.5, "top_k": 6, "top_p": 0.85, "min_p": 0.1}, 4),  # top_p binds
    ],
)
def test_sampled_tokens_stay_in_allowed_set(params: dict, kept_ranks: int):
    logits = torch.empty(len(RANKED_PROBS))
    logits[RANKED_IDS] = logits_of(RANKED_PROBS)
    counts = draw_counts(Sampler(len(RANKED_PROBS), "cpu", seed=3), logits, 4000, **params)
    seen = {i for i, c in enumerate(counts) if c}
    assert seen == set(RANKED_IDS[:kept_ranks])


# ---------------------------------------------------------------- distribution


def test_temperature_sampling_matches_softmax():
    logits = torch.tensor([1.0, 0.2, -0.5, 0.7, 0.0, -1.0])
    temperature = 0.7
    counts = draw_counts(Sampler(6, "cpu", seed=123), logits, 20000, temperature=temperature)
    expected = torch.softmax(logits / temperature, -1).tolist()
    assert chi_square(counts, expected) < CHI2_CRITICAL_1E3[5]
    # The test has power: the untempered distribution is rejected.
    assert chi_square(counts, torch.softmax(logits, -1).tolist()) > CHI2_CRITICAL_1E3[5]


def test_draws_equal_torch_multinomial_from_the_same_generator():
    """The sampler's sync-free draw is torch.multinomial's one-sample path: the same token from
    the same generator state (rows cut by masks included), so switching changed no seeded
    stream."""
    from serving.executor.sampler import _multinomial

    g = torch.Generator().manual_seed(5)
    for case in range(40):
        rows, vocab = 1 + case % 4, 2 + 37 * case
        logits = torch.randn(rows, vocab, generator=g) * (1 + case % 5)
        if case % 3 == 0:
            logits[:, vocab // 2 :] = float("-inf")
        probs = torch.softmax(logits, -1)
        want = torch.multinomial(probs, 1, generator=torch.Generator().manual_seed(case))
        got = _multinomial(probs, torch.Generator().manual_seed(case))
        assert torch.equal(got, want.squeeze(1)), case


def test_top_p_sampling_matches_truncated_distribution():
    probs = [0.1, 0.35, 0.04, 0.2, 0.06, 0.25]
    counts = draw_counts(Sampler(6, "cpu", seed=321), logits_of(probs), 20000, top_p=0.75)
    kept = [1, 5, 3]  # mass before id 3 is 0.6 < 0.75, before id 0 it is 0.8
    assert sum(counts[i] for i in kept) == 20000
    mass = sum(probs[i] for i in kept)
    statistic = chi_square([counts[i] for i in kept], [probs[i] / mass for i in kept])
    assert statistic < CHI2_CRITICAL_1E3[2]


# ---------------------------------------------------------------- penalties


def test_apply_penalties_exact():
    logits = torch.tensor([2.0, -1.0, 0.5, 3.0, -2.0, 0.0]).expand(3, -1)
    original = logits.clone()
    out = apply_penalties(
        logits,
        prompt_ids=[[0, 1, 5], [2], [3, 4]],
        output_ids=[[1, 3, 3], [2, 2, 4], []],
        repetition=[2.0, 1.0, 0.5],
        frequency=[0.5, 1.0, 0.0],
        presence=[0.25, 0.0, 0.0],
    )
    expected = torch.tensor(
        [
            # seen {0, 1, 3, 5}: 2/2, -1*2 - .5 - .25, 3/2 - 2*.5 - .25, 0*2
            [1.0, -2.75, 0.5, 0.25, -2.0, 0.0],
            # frequency only, output counts {2: 2, 4: 1}; the prompt does not count
            [2.0, -1.0, -1.5, 3.0, -3.0, 0.0],
            # repetition < 1 rewards seen tokens
            [2.0, -1.0, 0.5, 6.0, -1.0, 0.0],
        ]
    )
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    assert torch.equal(logits, original)


def test_sample_applies_penalties_before_greedy_and_keeps_input():
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0, 0.0]]).repeat(3, 1)
    original = logits.clone()
    states = [
        state(temperature=0.0, output=(3, 3), frequency_penalty=1.0),  # 3 - 2 < 2
        state(temperature=0.0, output=(3,), presence_penalty=1.5),  # 3 - 1.5 < 2
        state(temperature=0.0, prompt=(3,), repetition_penalty=2.0),  # 3 / 2 < 2
    ]
    tokens, _ = Sampler(6, "cpu").sample(logits, states)
    assert tokens == [0, 0, 0]
    assert torch.equal(logits, original)


# ---------------------------------------------------------------- min_new_tokens


def test_min_new_tokens_blocks_eos_and_stop_ids_until_reached():
    logits = torch.tensor([[0.0, 1.0, 0.0, 0.0, 2.0, 3.0]])  # eos 5 > stop 4 > token 1
    sampler = Sampler(6, "cpu")

    def greedy(output: tuple[int, ...], **params: object) -> int:
        row = state(temperature=0.0, output=output, stop_token_ids=[4], min_new_tokens=2, **params)
        return sampler.sample(logits, [row])[0][0]

    assert greedy(()) == 1
    assert greedy((0,)) == 1
    assert greedy((0, 0)) == 5
    # ignore_eos: eos is no stop token, so it is not suppressed; stop_token_ids still are.
    assert greedy((), ignore_eos=True) == 5
    logits[0, 5] = -1.0
    assert greedy((), ignore_eos=True) == 1

    logits[0, 5] = 8.0
    counts = draw_counts(sampler, logits, 2000, stop_token_ids=[4], min_new_tokens=1)
    assert counts[4] == counts[5] == 0
    assert draw_counts(sampler, logits, 200, stop_token_ids=[4])[5] > 0


def test_min_new_tokens_ignores_stop_ids_outside_the_vocabulary():
    logits = torch.tensor([[0.0, 1.0, 0.0, 0.0, 2.0, 3.0]])
    row = state(temperature=0.0, stop_token_ids=[4, 6, 10**6], min_new_tokens=1)
    assert Sampler(6, "cpu").sample(logits, [row])[0] == [1]


# ---------------------------------------------------------------- logit_bias


def test_logit_bias_forces_and_forbids_per_row():
    logits = torch.tensor([[0.0, 1.0, 0.5, 3.0, -2.0, 0.0]]).repeat(4, 1)
    original = logits.clone()
    states = [
        state(temperature=0.0),
        state(temperature=0.0, logit_bias={4: 100.0}),  # the least likely token wins
        state(temperature=0.0, logit_bias={3: -100.0}),  # the argmax is gone: 1 is next
        state(temperature=0.0, logit_bias={3: -1.5, 2: 1.2}),  # 1.5 < 1.7: 2 wins, exactly
    ]
    tokens, logprobs = Sampler(6, "cpu").sample(logits, states, [0, 0, 0, 0])
    assert tokens == [3, 4, 1, 2]
    assert torch.equal(logits, original)
    # logprobs stay those of the model's own distribution
    raw = torch.log_softmax(original[0], dim=-1)
    assert logprobs[1].logprob == pytest.approx(raw[4].item())


def test_logit_bias_holds_in_sampling():
    sampler = Sampler(6, "cpu")
    logits = logits_of([0.5, 0.2, 0.1, 0.1, 0.05, 0.05])
    counts = draw_counts(sampler, logits, 2000, logit_bias={0: -100.0, 4: 100.0})
    assert counts[4] == 2000
    counts = draw_counts(sampler, logits, 2000, logit_bias={0: -100.0})
    assert counts[0] == 0 and sum(counts) == 2000


def test_logit_bias_is_validated():
    with pytest.raises(ValueError, match="logit_bias: token 6 is outside the vocabulary"):
        SamplingParams(logit_bias={6: 1.0}).validate(6)
    with pytest.raises(ValueError, match=r"logit_bias: token 2: bias must be in \[-100, 100\]"):
        SamplingParams(logit_bias={2: 101.0}).validate(6)
    SamplingParams(stop_token_ids=[6, 10**9]).validate(6)  # accepted, as SGLang


# ---------------------------------------------------------------- logprobs and shapes


def test_logprobs_are_raw_log_softmax_with_sorted_top_lists():
    torch.manual_seed(4)
    logits = torch.randn(4, 30)
    states = [
        state(temperature=0.0, output=(2, 2), frequency_penalty=2.0),
        state(seed=1, temperature=0.3, top_k=5),
        state(temperature=1.5, repetition_penalty=1.8, prompt=(0, 1)),
        state(top_p=0.2),
    ]
    requested = [0, 1, 5, 30]
    tokens, logprobs = Sampler(30, "cpu").sample(logits, states, requested)
    raw = torch.log_softmax(logits, -1)
    assert logprobs is not None and len(logprobs) == 4
    for row, (token, entry, n) in enumerate(zip(tokens, logprobs, requested)):
        assert entry.token_id == token
        assert entry.logprob == pytest.approx(raw[row, token].item(), abs=1e-6)
        assert len(entry.top) == n
        values = [lp for _, lp in entry.top]
        assert values == sorted(values, reverse=True)
        for token_id, lp in entry.top:
            assert lp == pytest.approx(raw[row, token_id].item(), abs=1e-6)
        assert [t for t, _ in entry.top] == raw[row].topk(n).indices.tolist()
    assert Sampler(30, "cpu").sample(logits, states)[1] is None


def test_padded_vocabulary_columns_are_never_sampled():
    logits = torch.zeros(50, 8)
    logits[:, 6:] = 100.0  # lm_head padding past vocab_size 6
    tokens, logprobs = Sampler(6, "cpu").sample(logits, [state() for _ in range(50)], [0] * 50)
    assert max(tokens) < 6
    assert logprobs is not None
    assert all(math.isclose(e.logprob, -math.log(6), abs_tol=1e-6) for e in logprobs)
