"""Sampler on crafted float32 logits over a small vocabulary.

Greedy and random rows, seeded reproducibility and batch independence, the probability
filters (temperature, top_k, top_p, min_p), penalties, min_tokens masking and logprobs.
"""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch

from tokenfleet.backends.torch.sampler import Sampler, apply_penalties, filtered_probs
from tokenfleet.engine.request import Request
from tokenfleet.engine.sampling_params import SamplingParams

CPU = torch.device("cpu")
VOCAB = 8


def make_req(
    request_id: str = "r",
    prompt_token_ids: tuple[int, ...] = (0,),
    eos_token_ids: tuple[int, ...] = (),
    output_token_ids: tuple[int, ...] = (),
    **params: object,
) -> Request:
    params.setdefault("max_tokens", 64)
    r = Request(
        request_id=request_id,
        prompt_token_ids=list(prompt_token_ids),
        sampling_params=SamplingParams(**params),  # type: ignore[arg-type]
        eos_token_ids=tuple(eos_token_ids),
    )
    r.output_token_ids = list(output_token_ids)
    return r


def logits_from_probs(probs: list[float]) -> torch.Tensor:
    """float32 logits whose softmax is ``probs`` (0 -> -inf)."""
    return torch.tensor([math.log(p) if p > 0 else float("-inf") for p in probs], dtype=torch.float32)


def kept(probs: torch.Tensor) -> list[int]:
    return torch.nonzero(probs > 0).flatten().tolist()


# A distribution with clear gaps between cumulative masses: 0.40, 0.65, 0.80, 0.90, 0.95, 0.98, 0.995, 1.0
PROBS = [0.40, 0.25, 0.15, 0.10, 0.05, 0.03, 0.015, 0.005]


# ---------------------------------------------------------------- greedy


def test_greedy_picks_argmax():
    logits = torch.tensor([[0.1, -1.0, 2.5, 0.3, 2.4, -3.0, 0.0, 1.0]], dtype=torch.float32)
    out = Sampler(CPU).sample(logits.clone(), [make_req(temperature=0.0)])
    assert out.token_ids == [2]
    assert out.logprobs == [None]


def test_greedy_rows_ignore_top_k_top_p_and_seed():
    logits = torch.tensor([[0.0, 1.0, 3.0, 2.0, 0.0, 0.0, 0.0, 0.0]], dtype=torch.float32)
    r = make_req(temperature=0.0, top_k=2, top_p=0.5, min_p=0.5, seed=3)
    assert Sampler(CPU).sample(logits.clone(), [r]).token_ids == [2]


def test_mixed_batch_of_greedy_and_random_rows():
    g = torch.Generator().manual_seed(1234)
    logits = torch.randn(5, VOCAB, generator=g, dtype=torch.float32)
    # row 3 is random with top_k=1: it must also give the argmax
    reqs = [
        make_req("g0", temperature=0.0),
        make_req("s1", temperature=1.0, seed=11),
        make_req("g2", temperature=0.0),
        make_req("k3", temperature=1.3, top_k=1, seed=5),
        make_req("s4", temperature=0.8, seed=12),
    ]
    out = Sampler(CPU).sample(logits.clone(), reqs)
    argmax = logits.argmax(dim=-1).tolist()
    assert len(out.token_ids) == 5
    assert out.token_ids[0] == argmax[0]
    assert out.token_ids[2] == argmax[2]
    assert out.token_ids[3] == argmax[3]
    assert all(0 <= t < VOCAB for t in out.token_ids)
    # the seeded random rows are the same as when sampled alone
    for i in (1, 4):
        alone = Sampler(CPU).sample(logits[i : i + 1].clone(), [reqs[i]])
        assert out.token_ids[i] == alone.token_ids[0]


# ---------------------------------------------------------------- seeds


def _seeded_draws(seed: int, request_id: str, with_others: bool, n: int = 20) -> list[int]:
    base = torch.tensor([[0.3, 0.1, 0.0, 0.2, -0.1, 0.25, 0.05, 0.15]], dtype=torch.float32)
    sampler = Sampler(CPU)
    seeded = make_req(request_id, temperature=1.0, seed=seed)
    others = [make_req("other-a", temperature=1.0), make_req("other-b", temperature=0.7, top_p=0.9)]
    tokens = []
    for step in range(n):
        if with_others:
            noise = torch.randn(2, VOCAB, dtype=torch.float32)
            # vary the position of the seeded request in the batch as well
            if step % 2:
                rows, reqs, idx = torch.cat([noise[:1], base, noise[1:]]), [others[0], seeded, others[1]], 1
            else:
                rows, reqs, idx = torch.cat([base, noise]), [seeded, *others], 0
            tokens.append(sampler.sample(rows.clone(), reqs).token_ids[idx])
        else:
            tokens.append(sampler.sample(base.clone(), [seeded]).token_ids[0])
        seeded.output_token_ids.append(tokens[-1])
    return tokens


def test_same_seed_same_sequence_with_fresh_samplers():
    first = _seeded_draws(42, "a", with_others=False)
    second = _seeded_draws(42, "b", with_others=False)
    assert first == second
    assert len(set(first)) > 1  # it really samples (the distribution is nearly flat)


def test_seeded_sampling_independent_of_batch_composition():
    alone = _seeded_draws(7, "seeded", with_others=False)
    in_batch = _seeded_draws(7, "seeded", with_others=True)
    assert alone == in_batch


def test_different_seeds_give_different_sequences():
    assert _seeded_draws(1, "x", with_others=False) != _seeded_draws(2, "x", with_others=False)


def test_release_restarts_the_seeded_stream():
    base = torch.zeros(1, 1000, dtype=torch.float32)
    sampler = Sampler(CPU)
    r = make_req("rel", temperature=1.0, seed=99)
    first = [sampler.sample(base.clone(), [r]).token_ids[0] for _ in range(5)]
    sampler.release("rel")
    again = [sampler.sample(base.clone(), [r]).token_ids[0] for _ in range(5)]
    assert first == again


# ---------------------------------------------------------------- filtered_probs


@pytest.mark.parametrize("k", [1, 2, 3, 5, 7])
def test_top_k_keeps_exactly_k(k):
    probs = filtered_probs(logits_from_probs(PROBS), 1.0, top_k=k, top_p=1.0, min_p=0.0)
    assert kept(probs) == list(range(k))
    expected = torch.tensor(PROBS[:k]) / sum(PROBS[:k])
    assert torch.allclose(probs[:k], expected, atol=1e-6)
    assert math.isclose(float(probs.sum()), 1.0, rel_tol=1e-6)


@pytest.mark.parametrize("k", [0, -1, VOCAB, VOCAB + 3])
def test_top_k_disabled_or_larger_than_vocab_keeps_all(k):
    probs = filtered_probs(logits_from_probs(PROBS), 1.0, top_k=k, top_p=1.0, min_p=0.0)
    assert kept(probs) == list(range(VOCAB))
    assert torch.allclose(probs, torch.tensor(PROBS), atol=1e-6)


def test_top_k_on_unsorted_logits_keeps_the_k_largest():
    row = torch.tensor([0.5, 3.0, -1.0, 2.0, 2.5, 0.0, 1.0, -2.0], dtype=torch.float32)
    assert kept(filtered_probs(row, 1.0, top_k=3, top_p=1.0, min_p=0.0)) == [1, 3, 4]


@pytest.mark.parametrize(
    ("top_p", "expected_count"),
    [
        (1e-6, 1),  # always at least the top token
        (0.30, 1),  # 0.40 already reaches it
        (0.45, 2),  # 0.40 < 0.45 <= 0.65
        (0.70, 3),  # 0.65 < 0.70 <= 0.80
        (0.85, 4),  # 0.80 < 0.85 <= 0.90
        (0.93, 5),
        (0.97, 6),
        (0.99, 7),
    ],
)
def test_top_p_keeps_smallest_prefix_reaching_p(top_p, expected_count):
    probs = filtered_probs(logits_from_probs(PROBS), 1.0, top_k=0, top_p=top_p, min_p=0.0)
    assert kept(probs) == list(range(expected_count))
    expected = torch.tensor(PROBS[:expected_count]) / sum(PROBS[:expected_count])
    assert torch.allclose(probs[:expected_count], expected, atol=1e-6)


def test_top_p_on_unsorted_logits():
    # probabilities 0.05, 0.5, 0.1, 0.3, 0.05 in vocabulary order; 0.5 + 0.3 = 0.8 < 0.85 -> add 0.1
    row = logits_from_probs([0.05, 0.5, 0.1, 0.3, 0.05])
    assert kept(filtered_probs(row, 1.0, 0, top_p=0.85, min_p=0.0)) == [1, 2, 3]
    assert kept(filtered_probs(row, 1.0, 0, top_p=0.6, min_p=0.0)) == [1, 3]


def test_top_p_with_a_dominant_token_keeps_only_it():
    row = logits_from_probs([0.01, 0.97, 0.01, 0.01])
    assert kept(filtered_probs(row, 1.0, 0, top_p=0.9, min_p=0.0)) == [1]


def test_top_k_then_top_p_uses_renormalized_mass():
    # after top_k=3 the masses are 0.40/0.80, 0.25/0.80, 0.15/0.80 = 0.5, 0.3125, 0.1875
    probs = filtered_probs(logits_from_probs(PROBS), 1.0, top_k=3, top_p=0.75, min_p=0.0)
    assert kept(probs) == [0, 1]


@pytest.mark.parametrize(
    ("min_p", "expected"),
    [
        (0.0, list(range(VOCAB))),
        (0.05, [0, 1, 2, 3, 4, 5]),  # threshold 0.02: drops 0.015, 0.005
        (0.2, [0, 1, 2, 3]),  # threshold 0.08: drops 0.05 and below
        (0.5, [0, 1]),  # threshold 0.20
        (0.9, [0]),  # threshold 0.36
    ],
)
def test_min_p_removes_tokens_below_fraction_of_max(min_p, expected):
    probs = filtered_probs(logits_from_probs(PROBS), 1.0, top_k=0, top_p=1.0, min_p=min_p)
    assert kept(probs) == expected
    assert math.isclose(float(probs.sum()), 1.0, rel_tol=1e-5)
    kept_mass = sum(PROBS[i] for i in expected)
    assert torch.allclose(probs[expected], torch.tensor([PROBS[i] / kept_mass for i in expected]), atol=1e-6)


def test_temperature_sharpens_and_flattens():
    row = torch.tensor([2.0, 1.0, 0.0, -1.0, 0.5, 0.0, 0.0, 0.0], dtype=torch.float32)
    base = filtered_probs(row, 1.0, 0, 1.0, 0.0)
    cold = filtered_probs(row, 0.5, 0, 1.0, 0.0)
    hot = filtered_probs(row, 2.0, 0, 1.0, 0.0)
    assert torch.allclose(base, torch.softmax(row, dim=-1), atol=1e-6)
    assert torch.allclose(cold, torch.softmax(row * 2.0, dim=-1), atol=1e-6)
    assert torch.allclose(hot, torch.softmax(row / 2.0, dim=-1), atol=1e-6)
    assert float(cold[0]) > float(base[0]) > float(hot[0]) > 1.0 / VOCAB
    assert float(cold[3]) < float(base[3]) < float(hot[3])
    # order of the tokens is preserved
    assert torch.equal(torch.argsort(cold, descending=True), torch.argsort(hot, descending=True))
    # entropy falls as temperature falls
    def entropy(p: torch.Tensor) -> float:
        return float(-(p * p.log()).sum())

    assert entropy(cold) < entropy(base) < entropy(hot)


def test_temperature_applies_before_top_p():
    # at T=1 the top token has 0.40 < 0.5 -> two kept; at T=0.25 it dominates -> one kept
    row = logits_from_probs(PROBS)
    assert kept(filtered_probs(row, 1.0, 0, top_p=0.5, min_p=0.0)) == [0, 1]
    assert kept(filtered_probs(row, 0.25, 0, top_p=0.5, min_p=0.0)) == [0]


# ---------------------------------------------------------------- draws


def test_top_k_sampling_never_leaves_the_top_2():
    row = logits_from_probs(PROBS).unsqueeze(0)
    sampler = Sampler(CPU)
    r = make_req("k2", temperature=1.0, top_k=2, seed=2024)
    counts = Counter(sampler.sample(row.clone(), [r]).token_ids[0] for _ in range(2000))
    assert set(counts) == {0, 1}
    # 0.40 / 0.65 ~= 0.615 after renormalization (seeded, so deterministic)
    assert abs(counts[0] / 2000 - 0.40 / 0.65) < 0.05


def test_unfiltered_sampling_frequencies_follow_probabilities():
    probs = [0.5, 0.3, 0.2, 0.0, 0.0, 0.0, 0.0, 0.0]
    row = logits_from_probs(probs).unsqueeze(0)
    sampler = Sampler(CPU)
    r = make_req("freq", temperature=1.0, seed=7)
    n = 3000
    counts = Counter(sampler.sample(row.clone(), [r]).token_ids[0] for _ in range(n))
    assert set(counts) <= {0, 1, 2}
    for t in (0, 1, 2):
        assert abs(counts[t] / n - probs[t]) < 0.04


def test_min_p_sampling_never_draws_removed_tokens():
    row = logits_from_probs(PROBS).unsqueeze(0)
    sampler = Sampler(CPU)
    r = make_req("mp", temperature=1.0, min_p=0.2, seed=5)
    seen = {sampler.sample(row.clone(), [r]).token_ids[0] for _ in range(1000)}
    assert seen <= {0, 1, 2, 3}
    assert 0 in seen and 1 in seen


# ---------------------------------------------------------------- penalties


def test_repetition_penalty_divides_positive_and_multiplies_negative():
    logits = torch.tensor([[2.0, -2.0, 1.0, 0.5, 3.0, -1.0, 0.0, 4.0]], dtype=torch.float32)
    # prompt has 0 and 1 (1 twice), output has 5 and 0 again; 2,3,4,6,7 never seen
    r = make_req(prompt_token_ids=(0, 1, 1), output_token_ids=(5, 0), repetition_penalty=2.0)
    apply_penalties(logits, [r], [0])
    expected = torch.tensor([[1.0, -4.0, 1.0, 0.5, 3.0, -2.0, 0.0, 4.0]])
    assert torch.equal(logits, expected)


def test_frequency_penalty_subtracts_count_times_penalty():
    logits = torch.zeros(1, VOCAB, dtype=torch.float32)
    # a token seen only in the prompt (6) is not penalized by frequency
    r = make_req(prompt_token_ids=(6,), output_token_ids=(1, 2, 2, 3, 3, 3), frequency_penalty=0.5)
    apply_penalties(logits, [r], [0])
    assert torch.allclose(logits, torch.tensor([[0.0, -0.5, -1.0, -1.5, 0.0, 0.0, 0.0, 0.0]]))


def test_presence_penalty_subtracts_once():
    logits = torch.ones(1, VOCAB, dtype=torch.float32)
    r = make_req(prompt_token_ids=(6,), output_token_ids=(1, 2, 2, 3, 3, 3), presence_penalty=0.75)
    apply_penalties(logits, [r], [0])
    assert torch.allclose(logits, torch.tensor([[1.0, 0.25, 0.25, 0.25, 1.0, 1.0, 1.0, 1.0]]))


def test_negative_frequency_and_presence_penalties_raise_logits():
    logits = torch.zeros(1, VOCAB, dtype=torch.float32)
    r = make_req(output_token_ids=(4, 4), frequency_penalty=-0.5, presence_penalty=-1.0)
    apply_penalties(logits, [r], [0])
    assert torch.allclose(logits, torch.tensor([[0.0, 0.0, 0.0, 0.0, 2.0, 0.0, 0.0, 0.0]]))


def test_all_penalties_combined_exact_values():
    logits = torch.tensor([[2.0, -2.0, 1.0, 0.5, 3.0, -1.0, 0.0, 4.0]], dtype=torch.float32)
    r = make_req(
        prompt_token_ids=(0,), output_token_ids=(1, 2, 2),
        repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25,
    )
    apply_penalties(logits, [r], [0])
    # 0: 2/2; 1: -2*2 - 0.5 - 0.25; 2: 1/2 - 2*0.5 - 0.25; others untouched
    expected = torch.tensor([[1.0, -4.75, -0.75, 0.5, 3.0, -1.0, 0.0, 4.0]])
    assert torch.allclose(logits, expected)


def test_penalties_touch_only_the_given_rows():
    logits = torch.full((3, VOCAB), 2.0, dtype=torch.float32)
    r = make_req(prompt_token_ids=(0,), output_token_ids=(1,), repetition_penalty=4.0, presence_penalty=1.0)
    apply_penalties(logits, [r], [1])
    assert torch.equal(logits[0], torch.full((VOCAB,), 2.0))
    assert torch.equal(logits[2], torch.full((VOCAB,), 2.0))
    assert logits[1].tolist() == [0.5, -0.5, 2.0, 2.0, 2.0, 2.0, 2.0, 2.0]


def test_penalties_change_the_greedy_choice_in_sample():
    logits = torch.tensor([[1.0, 3.0, 2.5, 0.0, 0.0, 0.0, 0.0, 0.0]], dtype=torch.float32)
    plain = make_req(temperature=0.0, output_token_ids=(1,))
    penalized = make_req(temperature=0.0, output_token_ids=(1,), presence_penalty=1.0)
    assert Sampler(CPU).sample(logits.clone(), [plain]).token_ids == [1]
    assert Sampler(CPU).sample(logits.clone(), [penalized]).token_ids == [2]


def test_penalties_apply_per_request_in_a_batch():
    logits = torch.tensor([[1.0, 3.0, 2.5, 0.0, 0.0, 0.0, 0.0, 0.0]] * 2, dtype=torch.float32)
    reqs = [
        make_req("p", temperature=0.0, output_token_ids=(1,), repetition_penalty=2.0),
        make_req("q", temperature=0.0, output_token_ids=(1,)),
    ]
    assert Sampler(CPU).sample(logits.clone(), reqs).token_ids == [2, 1]


# ---------------------------------------------------------------- min_tokens


def test_min_tokens_masks_eos_until_enough_outputs():
    logits = torch.tensor([[0.0, 0.5, 9.0, 1.0, 0.0, 0.0, 0.0, 0.0]], dtype=torch.float32)  # EOS=2 wins
    sampler = Sampler(CPU)
    for n_out in range(3):
        r = make_req(temperature=0.0, eos_token_ids=(2,), min_tokens=3, output_token_ids=(3,) * n_out)
        assert sampler.sample(logits.clone(), [r]).token_ids == [3], n_out
    done = make_req(temperature=0.0, eos_token_ids=(2,), min_tokens=3, output_token_ids=(3, 3, 3))
    assert sampler.sample(logits.clone(), [done]).token_ids == [2]


def test_min_tokens_masks_all_eos_ids_and_stop_token_ids():
    logits = torch.tensor([[0.0, 8.0, 9.0, 1.0, 7.0, 0.0, 0.0, 2.0]], dtype=torch.float32)
    r = make_req(temperature=0.0, eos_token_ids=(2, 1), stop_token_ids=(4,), min_tokens=1)
    assert Sampler(CPU).sample(logits.clone(), [r]).token_ids == [7]


def test_min_tokens_with_ignore_eos_masks_only_stop_token_ids():
    logits = torch.tensor([[0.0, 8.0, 9.0, 1.0, 10.0, 0.0, 0.0, 2.0]], dtype=torch.float32)
    r = make_req(temperature=0.0, eos_token_ids=(2,), stop_token_ids=(4,), min_tokens=2, ignore_eos=True)
    assert Sampler(CPU).sample(logits.clone(), [r]).token_ids == [2]


def test_min_tokens_zero_does_not_mask():
    logits = torch.tensor([[0.0, 0.5, 9.0, 1.0, 0.0, 0.0, 0.0, 0.0]], dtype=torch.float32)
    r = make_req(temperature=0.0, eos_token_ids=(2,), stop_token_ids=(3,))
    assert Sampler(CPU).sample(logits.clone(), [r]).token_ids == [2]


def test_min_tokens_random_sampling_never_draws_eos():
    # EOS (0) holds most of the mass; with min_tokens it must never come out
    logits = logits_from_probs([0.9, 0.02, 0.02, 0.02, 0.01, 0.01, 0.01, 0.01]).unsqueeze(0)
    sampler = Sampler(CPU)
    r = make_req("mt", temperature=1.0, seed=3, eos_token_ids=(0,), min_tokens=50)
    seen = {sampler.sample(logits.clone(), [r]).token_ids[0] for _ in range(300)}
    assert 0 not in seen
    assert len(seen) > 1


def test_min_tokens_masks_only_the_requests_own_row():
    logits = torch.tensor([[0.0, 0.5, 9.0, 1.0, 0.0, 0.0, 0.0, 0.0]] * 2, dtype=torch.float32)
    reqs = [
        make_req("m", temperature=0.0, eos_token_ids=(2,), min_tokens=1),
        make_req("n", temperature=0.0, eos_token_ids=(2,)),
    ]
    assert Sampler(CPU).sample(logits.clone(), reqs).token_ids == [3, 2]


# ---------------------------------------------------------------- logprobs


def test_logprobs_are_raw_log_softmax_before_temperature_and_penalties():
    row = torch.tensor([[1.0, 3.0, 2.0, 0.0, -1.0, 0.5, 2.9, -2.0]], dtype=torch.float32)
    raw = torch.log_softmax(row[0], dim=-1)
    r = make_req(
        "lp", temperature=0.5, seed=1, logprobs=4, output_token_ids=(1, 6),
        repetition_penalty=1.7, frequency_penalty=0.3, presence_penalty=0.2, top_k=5,
    )
    for _ in range(20):
        out = Sampler(CPU).sample(row.clone(), [r])
        lp = out.logprobs[0]
        assert lp is not None
        t = out.token_ids[0]
        assert lp.token_id == t
        assert math.isclose(lp.logprob, float(raw[t]), rel_tol=1e-6, abs_tol=1e-6)
        assert lp.rank == 1 + sum(1 for v in raw.tolist() if v > float(raw[t]))
        assert [i for i, _ in lp.top] == [1, 6, 2, 0]
        for i, v in lp.top:
            assert math.isclose(v, float(raw[i]), rel_tol=1e-6, abs_tol=1e-6)
        r.output_token_ids.append(t)


def test_logprobs_rank_of_a_non_top_token():
    # min_tokens masks EOS (the most likely); greedy picks token 5, the 2nd most likely raw
    row = torch.tensor([[0.0, 1.0, 9.0, 0.5, -1.0, 3.0, 2.0, 0.0]], dtype=torch.float32)
    raw = torch.log_softmax(row[0], dim=-1)
    r = make_req(temperature=0.0, eos_token_ids=(2,), min_tokens=1, logprobs=3)
    out = Sampler(CPU).sample(row.clone(), [r])
    lp = out.logprobs[0]
    assert out.token_ids == [5]
    assert lp is not None and lp.token_id == 5 and lp.rank == 2
    assert math.isclose(lp.logprob, float(raw[5]), rel_tol=1e-6)
    # the masked EOS still leads the alternatives: they come from the raw logits
    assert [i for i, _ in lp.top] == [2, 5, 6]


def test_logprobs_rank_of_lowest_token():
    # every other token is a stop id masked by min_tokens: greedy must take the least likely one
    row = torch.tensor([[7.0, 6.0, 5.0, 4.0, 3.0, 2.0, 1.0, 0.0]], dtype=torch.float32)
    r = make_req(temperature=0.0, logprobs=0, min_tokens=1, stop_token_ids=(0, 1, 2, 3, 4, 5, 6))
    out = Sampler(CPU).sample(row.clone(), [r])
    lp = out.logprobs[0]
    assert out.token_ids == [7]
    assert lp is not None and lp.rank == VOCAB and lp.top == ()
    assert math.isclose(lp.logprob, float(torch.log_softmax(row[0], -1)[7]), rel_tol=1e-6)


@pytest.mark.parametrize("num_top", [0, 1, 3, 5, VOCAB])
def test_logprobs_top_has_requested_length_and_is_sorted(num_top):
    g = torch.Generator().manual_seed(num_top)
    row = torch.randn(1, VOCAB, generator=g, dtype=torch.float32)
    raw = torch.log_softmax(row[0], dim=-1)
    out = Sampler(CPU).sample(row.clone(), [make_req(temperature=1.0, seed=0, logprobs=num_top)])
    lp = out.logprobs[0]
    assert lp is not None
    assert len(lp.top) == num_top
    values = [v for _, v in lp.top]
    assert values == sorted(values, reverse=True)
    assert [i for i, _ in lp.top] == torch.argsort(raw, descending=True)[:num_top].tolist()


def test_logprobs_only_for_requests_that_ask():
    row = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(0), dtype=torch.float32)
    reqs = [make_req("a", temperature=0.0), make_req("b", temperature=0.0, logprobs=2), make_req("c", temperature=0.0)]
    out = Sampler(CPU).sample(row.clone(), reqs)
    assert out.logprobs[0] is None and out.logprobs[2] is None
    assert out.logprobs[1] is not None and out.logprobs[1].token_id == out.token_ids[1]
    assert math.isclose(out.logprobs[1].logprob, float(torch.log_softmax(row[1], -1).max()), rel_tol=1e-6)

