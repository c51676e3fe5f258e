"""Grammar-constrained decoding in the real engine: different grammars in one batch, with
sampling, with forks, across a resume (how a hand-off replays the grammar's state)."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from tokenfleet.engine.grammar import GrammarError, Guided, validate
from tokenfleet.engine.output import Resume
from tokenfleet.engine.request_spec import RequestSpec
from tokenfleet.engine.sampling_params import SamplingParams

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 16},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 99},
                                           "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2}},
          "required": ["name", "age", "tags"], "additionalProperties": False}


@pytest.fixture(scope="module")
def core(default_model_dir):
    from tokenfleet.backends.torch.builder import build_engine_core
    from tokenfleet.engine.config import EngineConfig

    return build_engine_core(EngineConfig(model=str(default_model_dir), dtype="float32", num_threads=1,
                                          num_blocks=256))


def run(core, requests):
    """Add every (prompt, params) at once (one batch), step to the end; token ids and text per (id, index)."""
    ids = [core.add_request(RequestSpec(core.tokenizer.encode(p), params)) for p, params in requests]
    texts: dict[tuple[str, int], str] = {}
    tokens: dict[tuple[str, int], list[int]] = {}
    reasons = {}
    while core.has_unfinished():
        for out in core.step():
            key = (out.request_id.split("#")[0], out.index)
            texts[key] = texts.get(key, "") + out.text
            tokens.setdefault(key, []).extend(out.new_token_ids)
            if out.finished:
                reasons[key] = out.finish_reason.value
    assert core.scheduler.block_manager.num_used_blocks == 0
    return ids, texts, tokens, reasons


def test_different_grammars_in_one_batch_all_hold(core):
    prompt = "Describe a person as JSON."
    ids, texts, _, reasons = run(core, [
        (prompt, SamplingParams(max_tokens=60, temperature=0.0, guided=Guided("json_schema", json.dumps(SCHEMA)))),
        (prompt, SamplingParams(max_tokens=60, temperature=1.0, seed=1, guided=Guided("json_object"), n=2)),
        ("Pick a date:", SamplingParams(max_tokens=20, temperature=0.9, seed=2,
                                        guided=Guided("regex", r"20[0-9]{2}-(0[1-9]|1[0-2])-[0-2][0-9]"))),
        ("Say hi.", SamplingParams(max_tokens=8, temperature=0.0)),
    ])
    jsonschema.validate(json.loads(texts[(ids[0], 0)]), SCHEMA)
    assert reasons[(ids[0], 0)] == "stop"
    for index in (0, 1):  # json_object under sampling: both samples parse (unless cut by max_tokens)
        if reasons[(ids[1], index)] == "stop":
            assert isinstance(json.loads(texts[(ids[1], index)]), dict)
    assert re.fullmatch(r"20[0-9]{2}-(0[1-9]|1[0-2])-[0-2][0-9]", texts[(ids[2], 0)])
    assert texts[(ids[3], 0)]  # the unconstrained neighbour was unaffected


def test_grammar_state_survives_a_resume(core):
    """A hand-off (or a resume on another replica) replays delivered tokens into a fresh matcher."""
    params = SamplingParams(max_tokens=60, temperature=0.0, guided=Guided("json_schema", json.dumps(SCHEMA)))
    prompt = core.tokenizer.encode("Describe a person as JSON.")
    _, texts, tokens, _ = run(core, [("Describe a person as JSON.", params)])
    (whole_tokens,) = tokens.values()
    (whole_text,) = texts.values()
    head = whole_tokens[:5]
    core.add_request(RequestSpec(prompt, params, resume=Resume(tuple(head), core.tokenizer.decode(head))))
    rest: list[int] = []
    while core.has_unfinished():
        for out in core.step():
            rest.extend(out.new_token_ids)
    assert head + rest == whole_tokens
    with pytest.raises(ValueError, match="grammar"):  # tokens the grammar forbids cannot be resumed
        core.add_request(RequestSpec(prompt, params, resume=Resume(tuple(core.tokenizer.encode("hello")), "hello")))
    assert json.loads(whole_text)


def test_prompt_logprobs_are_the_same_chunked_or_not_and_reported_once(default_model_dir, core):
    from tokenfleet.backends.torch.builder import build_engine_core
    from tokenfleet.engine.config import EngineConfig

    chunked = build_engine_core(EngineConfig(model=str(default_model_dir), dtype="float32", num_threads=1,
                                             num_blocks=64, max_num_batched_tokens=5))
    prompt = core.tokenizer.encode("The capital of France is Paris. The capital of Italy is Rome.")
    params = SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=3)

    def prompt_logprobs(engine, preempt=False):
        engine.add_request(RequestSpec(prompt, params, request_id="p"))
        outs = []
        while engine.has_unfinished():
            outs += engine.step()
            request = engine.scheduler.requests.get("p")
            if preempt and request is not None and 0 < request.num_computed_tokens < len(prompt):
                engine.scheduler._preempt(request)  # recomputes the prompt from the start
                preempt = False
        assert [len(o.prompt_logprobs) for o in outs] == [len(prompt) - 1] + [0] * (len(outs) - 1)
        assert outs[-1].num_cached_tokens == 0  # every prompt position computed, even when cached
        return outs[0].prompt_logprobs

    whole = prompt_logprobs(core)
    assert prompt_logprobs(core) == whole  # the prompt's blocks are cached now: not used
    split = prompt_logprobs(chunked, preempt=True)
    assert [lp.token_id for lp in whole] == prompt[1:] == [lp.token_id for lp in split]
    assert max(abs(a.logprob - b.logprob) for a, b in zip(whole, split)) < 1e-4
    assert all(len(lp.top) == 3 and lp.top[0][1] >= lp.logprob for lp in whole)


def test_invalid_grammars_are_named():
    for guided, fragment in [(Guided("json_schema", '{"type": "strng"}'), "strng"),
                             (Guided("json_schema", "{not json"), "json_schema"),
                             (Guided("regex", "(unclosed"), "regex"),
                             (Guided("lark", "start: undefined_rule"), "undefined_rule")]:
        with pytest.raises(GrammarError, match=re.escape(fragment)):
            validate(guided)
    with pytest.raises(ValueError):
        Guided("yaml", "")


def test_compiles_are_cached(core):
    guided = Guided("json_schema", json.dumps({"type": "object", "properties": {"x": {"type": "integer"}}}))
    core.guides.prepare(guided)
    before = core.guides.num_compiled
    for _ in range(3):
        core.guides.prepare(guided)
        core.guides.matcher(guided)
    assert core.guides.num_compiled == before
