"""Speculative decoding's pure parts: the n-gram proposer and the tenant history, the load-switched policy and
its cost model, the speculative_config schema shared with TensorRT-LLM, and the scheduler's verification
entries (slots for proposals, the accepted run taken, rejected slots trimmed, stops inside the run)."""

from __future__ import annotations

import pytest

from tests.conftest import make_request, make_scheduler
from tokenfleet.engine.request import FinishReason
from tokenfleet.engine.spec_decode import (
    Acceptance,
    Candidate,
    NgramIndex,
    SpecConfig,
    SpecPolicy,
    StepCostModel,
    TenantHistory,
    trtllm_speculative_config,
)


# ---- proposer ----------------------------------------------------------------------------------------------
def test_ngram_proposes_what_followed_the_latest_earlier_occurrence():
    index = NgramIndex(2, 4)
    index.extend([1, 2, 3, 4, 5, 9, 1, 2, 3, 7, 8, 6, 1, 2, 3])
    assert index.propose(3) == [7, 8, 6]  # the latest earlier "1 2 3", not the first one, never itself
    index.extend([7])
    assert index.propose(2) == [8, 6]  # 4-gram "1 2 3 7" matched; grows incrementally
    assert NgramIndex(2, 4).propose(3) == []


def test_ngram_needs_at_least_the_minimum_match():
    index = NgramIndex(3, 4)
    index.extend([5, 6, 1, 2, 9, 9, 1, 2])  # only the 2-gram "1 2" repeats
    assert index.propose(3) == []
    index = NgramIndex(2, 4)
    index.extend([5, 6, 1, 2, 9, 9, 1, 2])
    assert index.propose(3) == [9, 9, 1]


def test_tenant_history_is_searched_per_tenant_and_bounded():
    history = TenantHistory(2, 3, tokens_per_tenant=40)
    history.add("acme", [10, 11, 12, 13, 14, 15])
    assert history.propose("acme", [99, 11, 12], 3) == [13, 14, 15]
    assert history.propose("globex", [99, 11, 12], 3) == []  # never another tenant's tokens
    assert history.propose("acme", [14, 15], 3) == []  # a request's end does not run into the next one
    for i in range(10):
        history.add("acme", [200 + i] * 5 + [300 + i])
    assert history.propose("acme", [11, 12], 3) == []  # the oldest request fell out of the 40-token budget
    assert history.propose("acme", [209, 209], 3) == [309]  # the latest occurrence, cut at the request's end


# ---- policy ------------------------------------------------------------------------------------------------
def test_policy_speculates_deeply_when_steps_cost_their_fixed_part():
    policy = SpecPolicy(SpecConfig(num_speculative_tokens=8))
    plan = policy.plan([Candidate("a", list(range(8)), alpha=0.8)], base_tokens=1, base_yield=1,
                       cost=(0.020, 0.0005))  # batch 1: weights dominate, an extra token costs 2.5 %
    assert plan["a"] >= 6


def test_policy_turns_speculation_off_for_a_large_batch_or_low_acceptance():
    policy = SpecPolicy(SpecConfig())
    many = [Candidate(f"r{i}", [1, 2, 3, 4, 5], alpha=0.3) for i in range(32)]
    assert policy.plan(many, base_tokens=32, base_yield=32, cost=(0.020, 0.0010)) == {}
    few = [Candidate("a", [1, 2, 3], alpha=0.05)]
    assert policy.plan(few, base_tokens=1, base_yield=1, cost=(0.010, 0.002)) == {}


def test_policy_spends_tokens_on_the_likeliest_requests_first():
    policy = SpecPolicy(SpecConfig())
    plan = policy.plan([Candidate("good", [1] * 5, 0.9), Candidate("poor", [1] * 5, 0.35)],
                       base_tokens=8, base_yield=8, cost=(0.020, 0.001))
    assert plan.get("good", 0) > plan.get("poor", 0)


def test_non_adaptive_policy_verifies_every_proposal():
    policy = SpecPolicy(SpecConfig(adaptive=False))
    assert policy.plan([Candidate("a", [1, 2, 3], 0.01)], 64, 64, (0.01, 0.01)) == {"a": 3}


def test_cost_model_fits_fixed_and_per_token_cost():
    model = StepCostModel()
    assert model.estimate() is None
    for tokens in [1, 4, 8, 2, 6, 1, 3] * 5:
        model.observe(tokens, 0.020 + 0.001 * tokens)
    fixed, per_token = model.estimate()  # type: ignore[misc]
    assert fixed == pytest.approx(0.020, rel=1e-3) and per_token == pytest.approx(0.001, rel=1e-3)
    flat = StepCostModel()
    flat.prefill_per_token = 0.0004
    for _ in range(5):
        flat.observe(32, 0.050)  # T never varied: the slope comes from the prefill rate
    assert flat.estimate() == pytest.approx((0.050 - 32 * 0.0004, 0.0004))


def test_acceptance_counts_the_first_rejection_as_a_trial():
    a = Acceptance(prior=0.5, prior_weight=0.0, decay=1.0)
    a.observe(proposed=4, accepted=4)  # 4 of 4
    a.observe(proposed=4, accepted=1)  # accepted one, rejected the second: 2 trials
    assert a.alpha == pytest.approx(5 / 6)


# ---- configuration -------------------------------------------------------------------------------------------
def test_speculative_config_uses_tensorrt_llm_names():
    config = SpecConfig.parse('{"decoding_type": "NGram", "max_draft_len": 7, "max_matching_ngram_size": 3, '
                              '"is_public_pool": true, "adaptive": false}')
    assert config == SpecConfig(num_speculative_tokens=7, max_ngram=3, tenant_history=True, adaptive=False)
    assert SpecConfig.parse("") is None and SpecConfig.parse(None) is None
    assert trtllm_speculative_config({"decoding_type": "NGram", "max_draft_len": 7, "adaptive": False}) == \
        {"decoding_type": "NGram", "max_draft_len": 7}


def test_a_draft_model_config_uses_tensorrt_llm_names_too():
    config = SpecConfig.parse('{"decoding_type": "DraftTarget", "max_draft_len": 3, "speculative_model": "/draft", '
                              '"draft_layers": 8}')
    assert (config.method, config.draft_model, config.num_speculative_tokens, config.draft_layers) == \
        ("draft", "/draft", 3, 8)
    assert trtllm_speculative_config({"decoding_type": "DraftTarget", "speculative_model": "/d", "draft_layers": 8}) == \
        {"decoding_type": "DraftTarget", "speculative_model": "/d"}
    with pytest.raises(ValueError, match="draft model"):
        SpecConfig.parse('{"decoding_type": "DraftTarget", "max_draft_len": 3}')
    with pytest.raises(ValueError, match="unknown"):
        SpecConfig.parse('{"decoding_type": "DraftTarget", "speculative_model": "/d", "is_public_pool": true}')


@pytest.mark.parametrize("value, message", [
    ("{", "not JSON"),
    ('["NGram"]', "JSON object"),
    ('{"decoding_type": "Eagle", "max_draft_len": 4}', "passed to TensorRT-LLM"),
    ('{"decoding_type": "NGram", "max_draft_len": 0}', "max_draft_len"),
    ('{"decoding_type": "NGram", "draft_len": 4}', "unknown"),
    ('{"max_matching_ngram_size": 1, "min_matching_ngram_size": 2}', "min_matching"),
])
def test_bad_speculative_config_is_refused(value, message):
    with pytest.raises(ValueError, match=message):
        SpecConfig.parse(value)


# ---- scheduler -------------------------------------------------------------------------------------------------
def _decoding(s, request):
    """Run ``request`` through its prefill: it decodes from the next step."""
    s.add_request(request)
    out = s.schedule(0.0)
    s.update(out, {e.request_id: 5 for e in out.scheduled if e.samples})
    return request


def test_verification_takes_the_accepted_run_and_trims_rejected_slots():
    s = make_scheduler(num_blocks=32, block_size=4)
    r = _decoding(s, make_request(num_prompt_tokens=7, max_tokens=20))  # 8 tokens: two full blocks
    bm = s.block_manager
    r.draft_token_ids = [6, 7, 8, 9, 10, 11]
    out = s.schedule(0.0)
    (entry,) = out.scheduled
    assert entry.draft == (6, 7, 8, 9, 10, 11) and entry.num_new_tokens == 7 and entry.samples
    assert len(bm.block_table(r.request_id)) == 4  # slots for positions 7 .. 13
    s.update(out, {r.request_id: 6}, {r.request_id: [7, 42]})  # accepted 6, 7, then the target's own 42
    assert r.output_token_ids == [5, 6, 7, 42]
    assert r.num_computed_tokens == 10 and r.num_tokens == 11  # KV of 5, 6, 7 is valid; 42 is computed next
    assert len(bm.block_table(r.request_id)) == 3 and bm.num_used_blocks == 3  # the fourth block went back
    bm.check_invariants()
    out = s.schedule(0.0)  # a plain decode of position 10
    assert out.scheduled[0].start == 10 and out.scheduled[0].num_new_tokens == 1
    s.update(out, {r.request_id: 1})
    bm.check_invariants()


def test_a_stop_inside_the_accepted_run_drops_the_rest():
    s = make_scheduler(num_blocks=32, block_size=4)
    r = _decoding(s, make_request(num_prompt_tokens=6, max_tokens=20, eos_token_ids=(2,)))
    r.draft_token_ids = [6, 2, 8]
    out = s.schedule(0.0)
    finished = s.update(out, {r.request_id: 6}, {r.request_id: [2, 8, 9]})
    assert finished == [r] and r.finish_reason is FinishReason.STOP
    assert r.output_token_ids == [5, 6, 2]
    assert s.appended[r.request_id] == 2
    assert s.block_manager.num_used_blocks == 0
    s.block_manager.check_invariants()


def test_proposals_never_pass_max_tokens_and_never_preempt():
    s = make_scheduler(num_blocks=4, block_size=4)
    r = _decoding(s, make_request(num_prompt_tokens=6, max_tokens=4))
    r.draft_token_ids = [1, 2, 3, 4, 5]
    out = s.schedule(0.0)
    assert out.scheduled[0].draft == (1, 2)  # one token was sampled; 3 more allowed, the last is the target's
    s.update(out, {r.request_id: 1}, {r.request_id: [2, 7]})
    assert r.finish_reason is FinishReason.LENGTH and len(r.output_token_ids) == 4
    s = make_scheduler(num_blocks=4, block_size=4)
    a = _decoding(s, make_request(num_prompt_tokens=7, max_tokens=30))  # 2 blocks
    b = _decoding(s, make_request(num_prompt_tokens=3, max_tokens=30))  # 1 block; one block left
    a.draft_token_ids = list(range(1, 9))  # would need two more blocks
    out = s.schedule(0.0)
    assert not s.num_preemptions and {e.request_id for e in out.scheduled} == {a.request_id, b.request_id}
    assert all(e.draft == () for e in out.scheduled)  # b still gets its block: no proposals this step
    s.block_manager.check_invariants()


def test_a_prompts_last_token_is_never_verified_with_proposals():
    """A chunked prompt with one token left decodes like a request (num_computed = num_tokens - 1) but its step
    samples its first token (and forks n > 1 samples from it): no proposals there."""
    from tokenfleet.engine.spec_decode import Speculator

    spec = Speculator(SpecConfig(adaptive=False))
    r = make_request(prompt_token_ids=[1, 2, 3, 1, 2, 3, 1, 2], max_tokens=8)
    r.num_computed_tokens = r.num_tokens - 1
    assert spec.propose([r], budget=64) == 0 and r.draft_token_ids == []
    r.output_token_ids.append(3)  # now it decodes: "1 2 3" repeats
    r.num_computed_tokens = r.num_tokens - 1
    assert spec.propose([r], budget=64) > 0 and r.draft_token_ids[:2] == [1, 2]


def test_proposals_leave_the_budget_later_running_requests_need():
    s = make_scheduler(num_blocks=64, block_size=4, max_num_batched_tokens=12)
    requests = [_decoding(s, make_request(num_prompt_tokens=5, max_tokens=30)) for _ in range(3)]
    for _ in range(4):
        for r in requests:
            r.draft_token_ids = [1, 2, 3, 4, 5]
        out = s.schedule(0.0)
        assert {e.request_id for e in out.scheduled} == {r.request_id for r in requests}  # nobody starves
        assert out.num_scheduled_tokens <= 12
        s.update(out, {e.request_id: 9 for e in out.scheduled}, {e.request_id: [] for e in out.scheduled})
        s.block_manager.check_invariants()


def test_tenant_history_keeps_cache_scopes_apart():
    from tokenfleet.engine.spec_decode import Speculator

    spec = Speculator(SpecConfig(tenant_history=True, adaptive=False))
    done = make_request(prompt_token_ids=[7, 8, 9, 10, 11, 12], max_tokens=4)
    done.tenant, done.cache_scope = "acme", "team-a"
    done.output_token_ids = [13, 14]
    spec.finished(done)
    for scope, expect in (("team-a", [10, 11]), ("team-b", [])):
        r = make_request(prompt_token_ids=[50, 51, 52, 53], max_tokens=8)
        r.tenant, r.cache_scope = "acme", scope
        r.output_token_ids = [8, 9]  # its tail "8 9" occurred in team-a's finished request, never in its own tokens
        r.num_computed_tokens = r.num_tokens - 1
        spec.propose([r], budget=64)
        assert r.draft_token_ids[:2] == expect


def test_a_request_that_stopped_speculating_gets_another_chance():
    """Its own low acceptance keeps it from verifying; after explore_after steps with proposals it did not verify,
    it falls back to the fleet-wide estimate (here high) and speculates again."""
    from tokenfleet.engine.spec_decode import Speculator

    spec = Speculator(SpecConfig())
    for tokens in (1, 2, 3, 1, 4, 2) * 3:
        spec.cost.observe(tokens, 0.020 + 0.001 * tokens)  # fixed 20 ms, 1 ms per token
    r = make_request(prompt_token_ids=[1, 2, 3, 4, 1, 2, 3, 4, 1, 2], max_tokens=500)
    r.output_token_ids = [3]
    r.num_computed_tokens = r.num_tokens - 1
    for _ in range(20):
        spec.observe(r, 5, 0)  # its guesses were all wrong
    for _ in range(50):
        spec.acceptance.observe(5, 5)  # everyone else's were right
    passed = 0
    while spec.propose([r], budget=64) == 0:  # proposals it does not verify
        passed += 1
        assert passed <= spec.explore_after
    assert passed == spec.explore_after and r.draft_token_ids
