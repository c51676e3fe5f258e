"""Speculative decoding in the engine on the default model in fp32: greedy outputs are identical with and
without speculation (the verifying core proposes on every step it can: adaptive off), with logprobs, stop
strings, n > 1, chunked prefill, preemption, grammars and cancellation; no block leaks; sampled and seeded
requests behave as documented."""

from __future__ import annotations

import pytest

from tests.model.helpers import assert_no_leak, greedy, make_core, run_to_completion, with_parts
from tokenfleet.api.chat_template import render_chat
from tokenfleet.engine.grammar import Guided
from tokenfleet.engine.request_spec import RequestSpec
from tokenfleet.engine.sampling_params import SamplingParams
from tokenfleet.engine.spec_decode import SpecConfig

CODE = '''def area(width, height):
    """Area of a rectangle."""
    return width * height


def perimeter(width, height):
    """Perimeter of a rectangle."""
    return 2 * (width + height)
'''
EDIT = "Rename the parameter width to w in this code and return the whole file:\n\n" + CODE
QUOTE = ("Quote the sentence about the harbour from this text exactly.\n\nThe town sits on a hill. The harbour "
         "was built in 1820 and still shelters the fishing fleet in winter. The church is older than the harbour.")
ALWAYS = SpecConfig(num_speculative_tokens=5, adaptive=False)


def prompt_of(core, text: str) -> list[int]:
    return core.tokenizer.encode(render_chat(core.tokenizer, [{"role": "user", "content": text}]))


@pytest.fixture(scope="module")
def base(default_model_dir):
    return make_core(default_model_dir)


@pytest.fixture(scope="module")
def spec(default_model_dir):
    return with_parts(make_core(default_model_dir), speculation=ALWAYS)


def outputs(core, requests):
    """Run ``requests`` [(id, prompt, params)] together; token ids and final outputs by id."""
    finals, tokens = {}, {}
    for request_id, prompt, params in requests:
        core.add_request(RequestSpec(prompt, params, request_id=request_id))
        tokens[request_id] = []
    while core.has_unfinished():
        for out in core.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
            if out.finished:
                finals[out.request_id] = out
    return tokens, finals


def test_greedy_outputs_are_identical_with_speculation(base, spec):
    before = spec.snapshot()
    for text in (EDIT, QUOTE):
        prompt = prompt_of(base, text)
        expected = run_to_completion(base, {0: [("b", prompt, greedy(48))]})["b"]
        got = run_to_completion(spec, {0: [("s", prompt, greedy(48))]})["s"]
        assert got == expected
    stats = spec.snapshot()
    assert stats.num_spec_proposed_tokens > before.num_spec_proposed_tokens
    assert stats.num_spec_accepted_tokens > before.num_spec_accepted_tokens  # some steps yielded several tokens
    assert stats.num_spec_verifications > before.num_spec_verifications
    assert_no_leak(spec.scheduler.block_manager)


def test_logprobs_and_stop_strings_match(base, spec):
    prompt = prompt_of(base, QUOTE)
    params = greedy(40, logprobs=2, stop=("winter",))
    expected_tokens, expected = outputs(base, [("b", prompt, params)])
    got_tokens, got = outputs(spec, [("s", prompt, params)])
    assert got_tokens["s"] == expected_tokens["b"]
    b, s = expected["b"], got["s"]
    assert (s.finish_reason, s.stop_reason, s.num_output_tokens) == (b.finish_reason, b.stop_reason, b.num_output_tokens)
    assert_no_leak(spec.scheduler.block_manager)


def test_logprob_values_match(base, spec):
    prompt = prompt_of(base, EDIT)
    params = greedy(24, logprobs=3)
    lp = {}
    for core, rid in ((base, "b"), (spec, "s")):
        core.add_request(RequestSpec(prompt, params, request_id=rid))
        lp[rid] = []
        while core.has_unfinished():
            for out in core.step():
                lp[rid] += out.logprobs
    assert [x.token_id for x in lp["s"]] == [x.token_id for x in lp["b"]]
    assert [x.logprob for x in lp["s"]] == pytest.approx([x.logprob for x in lp["b"]], abs=1e-3)
    assert [[t for t, _ in x.top] for x in lp["s"]] == [[t for t, _ in x.top] for x in lp["b"]]


@pytest.mark.nightly  # the n-gram speculation tests keep greedy equality in the suite
def test_n_samples_chunked_prefill_and_preemption(default_model_dir, base):
    prompts = {name: prompt_of(base, text) for name, text in (("edit", EDIT), ("quote", QUOTE))}
    expected = {name: run_to_completion(base, {0: [(name, p, greedy(32))]})[name] for name, p in prompts.items()}
    # few blocks: three requests at once preempt each other; chunks of 16 prompt tokens
    core = with_parts(make_core(default_model_dir, num_blocks=14, max_prefill_chunk=16), speculation=ALWAYS)
    tokens, _ = outputs(core, [("edit", prompts["edit"], greedy(32, n=2)), ("quote", prompts["quote"], greedy(32)),
                               ("edit2", prompts["edit"], greedy(32))])
    assert tokens["edit"] == tokens["edit#1"] == tokens["edit2"] == expected["edit"]
    assert tokens["quote"] == expected["quote"]
    stats = core.snapshot()
    assert stats.num_preemptions > 0 and stats.num_spec_accepted_tokens > 0
    assert_no_leak(core.scheduler.block_manager)


def test_grammar_outputs_match_and_forbidden_proposals_are_never_verified(base, spec):
    # the grammar writes compact JSON ('": "'): the prompt's ' : ' after a key is a proposal it forbids
    text = 'Return this JSON unchanged: {"name" : "harbour", "year" : 1820, "tags" : ["fleet", "winter"]}'
    prompt = prompt_of(base, text)
    params = greedy(40, guided=Guided("json_object"))
    expected = run_to_completion(base, {0: [("b", prompt, params)]})["b"]
    cut = spec.spec.grammar_cut
    got = run_to_completion(spec, {0: [("s", prompt, params)]})["s"]
    assert got == expected
    assert spec.spec.grammar_cut > cut


def test_cancelling_mid_verification_frees_everything(spec):
    prompt = prompt_of(spec, EDIT)
    spec.add_request(RequestSpec(prompt, greedy(200), request_id="cancel"))
    verified = spec.snapshot().num_spec_verifications
    for _ in range(40):
        spec.step()
        if spec.snapshot().num_spec_verifications > verified + 2:
            break
    assert spec.snapshot().num_spec_verifications > verified
    spec.abort("cancel")
    assert_no_leak(spec.scheduler.block_manager)


def test_sampled_requests_speculate_and_seeded_ones_do_not(spec):
    prompt = prompt_of(spec, EDIT)
    before = spec.snapshot().num_spec_verifications
    tokens, finals = outputs(spec, [("seeded", prompt, SamplingParams(max_tokens=24, temperature=0.8, seed=7))])
    assert spec.snapshot().num_spec_verifications == before  # its tokens must not depend on acceptance
    again, _ = outputs(spec, [("seeded2", prompt, SamplingParams(max_tokens=24, temperature=0.8, seed=7))])
    assert again["seeded2"] == tokens["seeded"]
    # an unseeded sampled request may speculate: its draw is random (a full CI run once drew a continuation with no
    # verified step in 48 tokens), so up to three such requests, each run to its 48 tokens
    for attempt in range(3):
        hot = SamplingParams(max_tokens=48, temperature=0.3, top_p=0.9, ignore_eos=True)
        tokens, finals = outputs(spec, [(f"hot{attempt}", prompt, hot)])
        assert len(tokens[f"hot{attempt}"]) == finals[f"hot{attempt}"].num_output_tokens == 48
        if spec.snapshot().num_spec_verifications > before:
            break
    assert spec.snapshot().num_spec_verifications > before
    opted_out = spec.snapshot().num_spec_verifications
    outputs(spec, [("off", prompt, greedy(24, speculative=False))])
    assert spec.snapshot().num_spec_verifications == opted_out
    assert_no_leak(spec.scheduler.block_manager)


# ---- a draft model (here the default model drafting for itself, whole or truncated: one model family only) ----
def draft_config(**extra) -> str:
    import json

    return json.dumps({"decoding_type": "DraftTarget", "max_draft_len": 4, "speculative_model": "self",
                       "adaptive": False, **extra})


@pytest.mark.nightly  # the n-gram speculation tests keep greedy equality in the suite
def test_a_draft_model_proposes_and_greedy_outputs_stay_identical(default_model_dir, base):
    prompts = [prompt_of(base, EDIT), prompt_of(base, QUOTE)]
    expected = [run_to_completion(base, {0: [(f"b{i}", p, greedy(32))]})[f"b{i}"] for i, p in enumerate(prompts)]
    whole = make_core(default_model_dir, speculative_config=draft_config())
    truncated = make_core(default_model_dir, speculative_config=draft_config(draft_layers=10))
    for core in (whole, truncated):
        got = [run_to_completion(core, {0: [(f"s{i}", p, greedy(32))]})[f"s{i}"] for i, p in enumerate(prompts)]
        assert got == expected
        assert_no_leak(core.scheduler.block_manager)
    stats = whole.snapshot()  # drafting for itself in fp32, every proposal is the target's own pick
    assert stats.num_spec_accepted_tokens == stats.num_spec_proposed_tokens > 0
    assert truncated.snapshot().num_spec_proposed_tokens > 0


@pytest.mark.nightly  # the n-gram speculation tests keep greedy equality in the suite
def test_a_draft_model_survives_preemption_and_forks(default_model_dir, base):
    prompts = {name: prompt_of(base, text) for name, text in (("edit", EDIT), ("quote", QUOTE))}
    expected = {name: run_to_completion(base, {0: [(name, p, greedy(24))]})[name] for name, p in prompts.items()}
    core = make_core(default_model_dir, num_blocks=14, speculative_config=draft_config())
    tokens, _ = outputs(core, [("edit", prompts["edit"], greedy(24, n=2)), ("quote", prompts["quote"], greedy(24))])
    assert tokens["edit"] == tokens["edit#1"] == expected["edit"] and tokens["quote"] == expected["quote"]
    assert core.snapshot().num_preemptions > 0
    hot = SamplingParams(max_tokens=24, temperature=0.8, ignore_eos=True)  # a sampled EOS would end it early
    sampled, finals = outputs(core, [("hot", prompts["quote"], hot)])
    assert finals["hot"].num_output_tokens == len(sampled["hot"]) == 24
    assert_no_leak(core.scheduler.block_manager)
