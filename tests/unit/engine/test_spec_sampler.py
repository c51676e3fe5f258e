"""Speculative verification in the sampler, on crafted float32 logits over a small vocabulary: greedy rows
accept while the proposal is the argmax; rejection sampling keeps the target's distribution (chi-square with
fixed seeds, at each position of the run); each row is processed as a plain decode step at that point would be
(penalties count the proposals before it)."""

from __future__ import annotations

from collections import Counter

import torch

from tests.unit.engine.test_sampler import make_req
from tokenfleet.backends.torch.sampler import Sampler, filtered_probs

CPU = torch.device("cpu")
VOCAB = 6
CHI2_DF5_P001 = 20.515  # chi-square critical value, 5 degrees of freedom, p = 0.001


def chi_square(counts: Counter, probs: torch.Tensor, total: int) -> float:
    expected = probs * total
    return float(sum((counts.get(t, 0) - e) ** 2 / e for t, e in enumerate(expected.tolist()) if e > 0))


def test_greedy_accepts_while_the_proposal_is_the_argmax():
    logits = torch.tensor([[0.0, 5.0, 1.0, 0, 0, 0], [4.0, 0, 0, 0, 0, 0], [0, 0, 0, 3.0, 0, 0]])
    sampler = Sampler(CPU)
    (out,) = sampler.verify(logits.clone(), [make_req(temperature=0.0)], [[1, 0]])
    assert out.token_ids == [1, 0, 3]  # both accepted, then the target's own
    (out,) = sampler.verify(logits.clone(), [make_req(temperature=0.0)], [[1, 2]])
    assert out.token_ids == [1, 0]  # the second proposal lost to the argmax 0, which replaces it
    (out,) = sampler.verify(logits.clone(), [make_req(temperature=0.0, logprobs=1)], [[2, 0]])
    assert out.token_ids == [1] and out.logprobs[0].token_id == 1 and out.logprobs[0].rank == 1


def test_rows_see_the_proposals_before_them():
    """A frequency penalty at row 1 counts the proposal of row 0, as a decode step after it would."""
    logits = torch.tensor([[0.0, 5.0, 0, 0, 0, 0], [0.0, 3.0, 2.5, 0, 0, 0]])
    request = make_req(temperature=0.0, frequency_penalty=1.0)
    (out,) = Sampler(CPU).verify(logits.clone(), [request], [[1]])
    plain = Sampler(CPU).sample(logits[1:].clone(), [make_req(temperature=0.0, frequency_penalty=1.0,
                                                              output_token_ids=(1,))])
    assert out.token_ids == [1, plain.token_ids[0]] == [1, 2]


def _run(logits: torch.Tensor, draft: list[int], params: dict, trials: int, seed: int) -> list[list[int]]:
    sampler = Sampler(CPU)
    sampler._shared_generator.manual_seed(seed)
    runs: list[list[int]] = []
    batch = 2000
    for _ in range(trials // batch):
        rows = logits.repeat(batch, 1)
        outs = sampler.verify(rows, [make_req(request_id=f"r{i}", **params) for i in range(batch)], [draft] * batch)
        runs += [o.token_ids for o in outs]
    return runs


def test_rejection_sampling_keeps_the_target_distribution():
    torch.manual_seed(0)
    logits = torch.randn(3, VOCAB) * 1.5
    params = dict(temperature=1.0)
    probs = [filtered_probs(row, 1.0, 0, 1.0, 0.0) for row in logits]
    draft = [int(probs[0].argsort()[-2]), int(probs[1].argmax())]  # the second likeliest, then the likeliest
    trials = 20000
    runs = _run(logits, draft, params, trials, seed=1)
    first = Counter(r[0] for r in runs)
    assert chi_square(first, probs[0], trials) < CHI2_DF5_P001
    # the second token, given the first was the proposal: distributed as the target's row 1
    after = [r for r in runs if r[0] == draft[0]]
    second = Counter(r[1] for r in after)
    assert len(after) > 1000 and chi_square(second, probs[1], len(after)) < CHI2_DF5_P001
    # both accepted: the target's own token after them is distributed as its row 2
    full = [r for r in after if r[1] == draft[1]]
    assert len(full) > 500 and chi_square(Counter(r[2] for r in full), probs[2], len(full)) < CHI2_DF5_P001
    # a wrong verifier fails the same statistic: accepting every proposal puts all mass on it
    assert chi_square(Counter({draft[0]: trials}), probs[0], trials) > CHI2_DF5_P001


def test_rejection_sampling_with_filters_keeps_the_filtered_distribution():
    torch.manual_seed(3)
    logits = torch.randn(2, VOCAB)
    params = dict(temperature=0.7, top_k=4, top_p=0.9)
    target = filtered_probs(logits[0], 0.7, 4, 0.9, 0.0)
    outside = int((target == 0).nonzero()[0])  # a token the filters removed: must never come out
    runs = _run(logits, [outside], params, 10000, seed=2)
    counts = Counter(r[0] for r in runs)
    assert counts.get(outside, 0) == 0
    support = int((target > 0).sum())
    stat = chi_square(counts, target, 10000)
    assert stat < {1: 10.83, 2: 13.82, 3: 16.27, 4: 18.47, 5: 20.52}[support - 1]


def test_rejection_sampling_against_a_draft_distribution_keeps_the_target_distribution():
    """A draft model draws its proposal from q; accepting with min(1, p/q) and drawing from max(0, p - q) on a
    rejection leaves the output distributed as p."""
    torch.manual_seed(5)
    logits = torch.randn(2, VOCAB)
    p = filtered_probs(logits[0], 1.0, 0, 1.0, 0.0)
    q = torch.softmax(torch.randn(VOCAB) * 2, dim=-1)  # a poor draft
    sampler = Sampler(CPU)
    sampler._shared_generator.manual_seed(11)
    draws = torch.multinomial(q, 20000, replacement=True, generator=torch.Generator().manual_seed(12)).tolist()
    firsts = []
    for start in range(0, len(draws), 2000):
        batch = draws[start: start + 2000]
        outs = sampler.verify(logits.repeat(len(batch), 1), [make_req(request_id=f"r{i}") for i in range(len(batch))],
                              [[d] for d in batch], [q[None, :]] * len(batch))
        firsts += [o.token_ids[0] for o in outs]
    assert chi_square(Counter(firsts), p, len(firsts)) < CHI2_DF5_P001
    # verifying the draw as a point mass (ignoring q) is exact too, but accepts less often: p(d) <= min(1, p(d)/q(d))
    naive = Sampler(CPU)
    naive._shared_generator.manual_seed(11)
    accepted = {"q": 0, "point": 0}
    for start in range(0, 6000, 2000):
        batch = draws[start: start + 2000]
        reqs = [make_req(request_id=f"r{i}") for i in range(len(batch))]
        with_q = sampler.verify(logits.repeat(len(batch), 1), reqs, [[d] for d in batch], [q[None, :]] * len(batch))
        point = naive.verify(logits.repeat(len(batch), 1), reqs, [[d] for d in batch])
        accepted["q"] += sum(len(o.token_ids) == 2 for o in with_q)
        accepted["point"] += sum(len(o.token_ids) == 2 for o in point)
    assert accepted["q"] > 1.2 * accepted["point"]


def test_a_grammar_completed_inside_the_run_ends_it_there(default_model_dir):
    """Plain decoding stops at the token that completes the grammar; verification must not add the EOS the
    completed grammar then allows."""
    import json

    from tokenfleet.engine.grammar import Guided
    from tokenfleet.engine.guided import GuideCompiler
    from tokenfleet.models.tokenizer import Tokenizer

    cfg = json.loads((default_model_dir / "config.json").read_text())
    vocab, eos = cfg["vocab_size"], cfg["eos_token_id"]
    compiler = GuideCompiler((default_model_dir / "tokenizer.json").read_text(), vocab, (eos,))
    (abc,) = Tokenizer(str(default_model_dir)).encode("abc")  # one token
    logits = torch.zeros(2, vocab)
    logits[0, abc] = 5.0
    verifying, plain = make_req(temperature=0.0), make_req(temperature=0.0)
    verifying.guide, plain.guide = compiler.matcher(Guided("regex", "abc")), compiler.matcher(Guided("regex", "abc"))
    (out,) = Sampler(CPU).verify(logits.clone(), [verifying], [[abc]])
    single = Sampler(CPU).sample(logits[:1].clone(), [plain])
    assert out.token_ids == single.token_ids == [abc]
    assert verifying.guide.is_stopped() and plain.guide.is_stopped()
