"""Per-request controls through the official openai client against etcd + worker + router + gateway
(real processes): JSON mode, JSON schema, tool calling, n > 1, logprobs, echo, logit_bias."""

from __future__ import annotations

import json
import math
import uuid

import jsonschema
import pytest

from tests.integration.conftest import load_report, wait_for
from tests.integration.test_openai_gateway import MODEL, stack  # noqa: F401 (the module's cluster)

SCHEMAS = {
    "person": {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 24}, "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "hobbies": {"type": "array", "items": {"enum": ["chess", "tennis", "music"]}, "maxItems": 3}},
        "required": ["name", "age", "hobbies"], "additionalProperties": False},
    "nested": {"type": "object", "properties": {
        "city": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                                  "country": {"enum": ["FR", "IT", "DE"]}},
                 "required": ["name", "country"], "additionalProperties": False},
        "sunny": {"type": "boolean"}},
        "required": ["city", "sunny"], "additionalProperties": False},
    "list": {"type": "object", "properties": {
        "items": {"type": "array", "minItems": 1, "maxItems": 3,
                  "items": {"type": "object", "properties": {"sku": {"type": "integer"}, "qty": {"enum": [1, 2, 3]}},
                            "required": ["sku", "qty"], "additionalProperties": False}}},
        "required": ["items"], "additionalProperties": False},
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
                                      "parameters": {"type": "object", "properties": {
                                          "city": {"type": "string", "maxLength": 20},
                                          "unit": {"enum": ["celsius", "fahrenheit"]}},
                                          "required": ["city", "unit"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "get_time", "description": "Current time in a timezone",
                                      "parameters": {"type": "object", "properties": {"tz": {"type": "string",
                                                                                             "maxLength": 30}},
                                                     "required": ["tz"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "add", "description": "Add two integers",
                                      "parameters": {"type": "object", "properties": {"a": {"type": "integer"},
                                                                                      "b": {"type": "integer"}},
                                                     "required": ["a", "b"], "additionalProperties": False}}},
]
PARAMETERS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


@pytest.fixture(scope="module")
def client(stack):  # noqa: F811
    return stack[1]


def ask(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


def streamed_text(chunks, index: int = 0) -> str:
    return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices and c.choices[0].index == index)


@pytest.mark.parametrize("stream", [False, True])
def test_json_mode_output_parses(client, stream):
    # (A 135M model loops on open-ended objects until max_tokens; a question with a short answer ends.)
    kwargs = dict(model=MODEL, messages=ask("Reply with a JSON object with two keys, name and color, for a cat."),
                  max_tokens=200, temperature=0.7, seed=5, response_format={"type": "json_object"})
    if stream:
        text = streamed_text(list(client.chat.completions.create(stream=True, **kwargs)))
    else:
        reply = client.chat.completions.create(**kwargs)
        assert reply.choices[0].finish_reason == "stop"
        text = reply.choices[0].message.content
    assert isinstance(json.loads(text), dict)


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_json_schema_output_validates(client, name, stream):
    fmt = {"type": "json_schema", "json_schema": {"name": name, "schema": SCHEMAS[name], "strict": True}}
    kwargs = dict(model=MODEL, messages=ask(f"Fill in a {name} record as JSON."), max_tokens=160, temperature=0.8,
                  seed=11, response_format=fmt)
    if stream:
        chunks = list(client.chat.completions.create(stream=True, **kwargs))
        text = streamed_text(chunks)
        finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
        assert finish == ["stop"]
    else:
        text = client.chat.completions.create(**kwargs).choices[0].message.content
    jsonschema.validate(json.loads(text), SCHEMAS[name])


def _check_call(call) -> dict:
    assert call.type == "function" and call.id.startswith("call_")
    arguments = json.loads(call.function.arguments)
    jsonschema.validate(arguments, PARAMETERS[call.function.name])
    return arguments


def test_required_tool_call_with_three_functions_is_valid(client):
    reply = client.chat.completions.create(model=MODEL, messages=ask("What's the weather in Paris?"), tools=TOOLS,
                                           tool_choice="required", max_tokens=80, temperature=0)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert choice.message.tool_calls
    for call in choice.message.tool_calls:
        _check_call(call)


def test_a_schema_without_additional_properties_gets_calls_with_declared_fields_only(client):
    """As a new user would write it (no "additionalProperties"): JSON Schema's default admitted any field,
    and the model padded the call with the schema's own keys until max_tokens (finish "length")."""
    weather = {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}, "unit": {"type": "string"}}, "required": ["city"]}}}
    reply = client.chat.completions.create(model=MODEL, messages=ask("What is the weather in Oslo?"), tools=[weather],
                                           tool_choice="required", max_tokens=100, temperature=0)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    for call in choice.message.tool_calls:
        arguments = json.loads(call.function.arguments)
        assert call.function.name == "get_weather" and "city" in arguments and set(arguments) <= {"city", "unit"}


def test_named_tool_choice_calls_that_function(client):
    reply = client.chat.completions.create(model=MODEL, messages=ask("What is two plus three?"), tools=TOOLS,
                                           tool_choice={"type": "function", "function": {"name": "add"}},
                                           parallel_tool_calls=False, max_tokens=60, temperature=0)
    calls = reply.choices[0].message.tool_calls
    assert len(calls) == 1 and calls[0].function.name == "add"
    _check_call(calls[0])


def test_streamed_tool_call_reassembles_to_the_non_streamed_call(client):
    kwargs = dict(model=MODEL, messages=ask("What time is it in Tokyo?"), tools=TOOLS, tool_choice="required",
                  max_tokens=80, temperature=0)
    whole = client.chat.completions.create(**kwargs).choices[0].message.tool_calls
    chunks = list(client.chat.completions.create(stream=True, **kwargs))
    calls: dict[int, dict] = {}
    for c in chunks:
        if not c.choices:
            continue
        assert not c.choices[0].delta.content  # tool syntax never leaks into content
        for d in c.choices[0].delta.tool_calls or []:
            if d.id is not None:  # the first delta of a call: id and name, no arguments yet
                assert d.index not in calls and d.function.name and not d.function.arguments
                calls[d.index] = {"id": d.id, "name": d.function.name, "arguments": ""}
            else:
                assert d.function.name is None
                calls[d.index]["arguments"] += d.function.arguments
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finish == ["tool_calls"]
    assert [(c["name"], c["arguments"]) for c in calls.values()] == \
        [(c.function.name, c.function.arguments) for c in whole]
    assert sum(len(c["arguments"]) > 0 for c in calls.values()) == len(whole)


def test_auto_tool_choice_gives_text_or_valid_calls_never_both(client):
    for seed, question in enumerate(["Hello! How are you today?", "What's the weather in Rome in celsius?",
                                     "Tell me a joke.", "Add 40 and 2."]):
        reply = client.chat.completions.create(model=MODEL, messages=ask(question), tools=TOOLS, max_tokens=60,
                                               temperature=0.7, seed=seed)
        message = reply.choices[0].message
        if message.tool_calls:
            assert message.content is None and reply.choices[0].finish_reason == "tool_calls"
            for call in message.tool_calls:
                _check_call(call)
        else:
            assert "<tool_call>" not in (message.content or "")


def test_tool_results_in_the_history_are_accepted(client):
    messages = [
        {"role": "user", "content": "What's the weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 21, "sky": "clear"}'},
    ]
    reply = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, tool_choice="none",
                                           max_tokens=30, temperature=0)
    assert reply.choices[0].message.content and reply.choices[0].message.tool_calls is None


@pytest.mark.parametrize("stream", [False, True])
def test_n3_returns_three_choices_sharing_the_prompt_blocks(stack, client, stream):  # noqa: F811
    worker = stack[2]
    before = load_report(worker.address)
    # A fresh prompt (no prefix-cache hits) of ~100 tokens: 6 full blocks of 16.
    prompt = f"[{uuid.uuid4().hex}] " + "Write a short poem about the sea and its many moods. " * 8
    kwargs = dict(model=MODEL, messages=ask(prompt), n=3, max_tokens=12, temperature=1.0, seed=3)
    if stream:
        chunks = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs))
        texts = [streamed_text(chunks, i) for i in range(3)]
        finishes = sorted(c.choices[0].index for c in chunks if c.choices and c.choices[0].finish_reason)
        assert finishes == [0, 1, 2]
        usage = chunks[-1].usage
    else:
        reply = client.chat.completions.create(**kwargs)
        assert [c.index for c in reply.choices] == [0, 1, 2]
        texts = [c.message.content for c in reply.choices]
        usage = reply.usage
    assert all(texts) and len(set(texts)) > 1  # three samples, not one copied
    assert 3 <= usage.completion_tokens <= 3 * 12  # summed over the three choices
    after = wait_for(lambda: (r := load_report(worker.address)).num_in_flight == 0 and r, "request done")
    assert after.num_forks - before.num_forks == 2
    shared = after.num_fork_shared_blocks - before.num_fork_shared_blocks
    prompt_blocks = math.ceil(usage.prompt_tokens / 16)
    assert shared == 2 * prompt_blocks  # each fork took the whole prompt table, shared
    # Only the partially filled last block is ever copied, at most once per fork.
    assert after.num_block_copies - before.num_block_copies <= 2
    assert after.num_prompt_tokens_computed - before.num_prompt_tokens_computed <= usage.prompt_tokens


@pytest.mark.parametrize("stream", [False, True])
def test_chat_logprobs_are_finite_sorted_and_greedy_picks_the_top(client, stream):
    kwargs = dict(model=MODEL, messages=ask("Name a color."), max_tokens=8, temperature=0, logprobs=True,
                  top_logprobs=5)
    if stream:
        entries = [e for c in client.chat.completions.create(stream=True, **kwargs) if c.choices and c.choices[0].logprobs
                   for e in c.choices[0].logprobs.content]
    else:
        entries = client.chat.completions.create(**kwargs).choices[0].logprobs.content
    assert entries
    for e in entries:
        tops = [t.logprob for t in e.top_logprobs]
        assert len(tops) == 5 and all(math.isfinite(v) and v <= 0 for v in tops)
        assert tops == sorted(tops, reverse=True)
        assert math.isclose(e.logprob, tops[0], abs_tol=1e-5)  # greedy: the chosen token is the most likely
        assert e.bytes and bytes(e.bytes).decode() == e.token


def test_completion_logprobs_echo_and_text_offset(client):
    prompt = "The capital of France is"
    reply = client.completions.create(model=MODEL, prompt=prompt, max_tokens=5, temperature=0, logprobs=3, echo=False)
    lp = reply.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.text_offset) == reply.usage.completion_tokens
    assert lp.text_offset[0] == 0 and all(a < b for a, b in zip(lp.text_offset, lp.text_offset[1:]))
    assert all(len(t) == 3 for t in lp.top_logprobs)
    echoed = client.completions.create(model=MODEL, prompt=prompt, max_tokens=5, temperature=0, echo=True)
    assert echoed.choices[0].text == prompt + reply.choices[0].text
    chunks = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=5, temperature=0, echo=True,
                                            stream=True))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == echoed.choices[0].text


@pytest.mark.parametrize("stream", [False, True])
def test_echo_with_logprobs_scores_the_prompt(client, stream):
    """What evaluation harnesses do: the prompt's token logprobs (the first is null), then the completion's."""
    prompt = "The capital of France is Paris. The capital of Italy is"
    kwargs = dict(model=MODEL, prompt=prompt, max_tokens=3, temperature=0, logprobs=2, echo=True)
    if stream:
        parts = [c.choices[0] for c in client.completions.create(stream=True, **kwargs) if c.choices]
        text = "".join(p.text for p in parts)
        tokens = [t for p in parts if p.logprobs for t in p.logprobs.tokens]
        values = [v for p in parts if p.logprobs for v in p.logprobs.token_logprobs]
        offsets = [o for p in parts if p.logprobs for o in p.logprobs.text_offset]
    else:
        reply = client.completions.create(**kwargs)
        text, lp = reply.choices[0].text, reply.choices[0].logprobs
        tokens, values, offsets = lp.tokens, lp.token_logprobs, lp.text_offset
        assert lp.top_logprobs[0] is None and all(len(t) == 2 for t in lp.top_logprobs[1:])
    assert text.startswith(prompt)
    assert values[0] is None and all(v is not None and math.isfinite(v) and v <= 0 for v in values[1:])
    assert "".join(tokens) == text and offsets == sorted(offsets) and offsets[0] == 0
    greedy = client.completions.create(model=MODEL, prompt=prompt, max_tokens=3, temperature=0)
    assert text == prompt + greedy.choices[0].text


def test_logit_bias_bans_and_forces_tokens(client):
    plain = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=1, temperature=0,
                                      logprobs=0)
    first = plain.choices[0].logprobs.tokens[0]
    # Ban the greedy token: the answer changes.
    token_id = _token_id(client, "The capital of France is", first)
    banned = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=1, temperature=0,
                                       logit_bias={str(token_id): -100})
    assert banned.choices[0].text != plain.choices[0].text


def _token_id(client, prompt: str, token_text: str) -> int:
    """The id of a token by its text, through the completions endpoint's token-id prompts."""
    from tokenfleet.models.gguf_import import ensure_default_model
    from tokenfleet.models.tokenizer import Tokenizer

    tokenizer = Tokenizer(ensure_default_model())
    ids = tokenizer.encode(prompt + token_text)
    return ids[-1]


def test_stop_list_and_max_completion_tokens(client):
    reply = client.chat.completions.create(model=MODEL, messages=ask("Count from 1 to 20 separated by commas."),
                                           max_completion_tokens=40, temperature=0, stop=["7", "eleven"])
    assert "7" not in reply.choices[0].message.content and reply.usage.completion_tokens <= 40


@pytest.mark.parametrize(("body", "param"), [
    ({"prompt": "x", "suffix": "y"}, "suffix"),
    ({"prompt": "x", "best_of": 2}, "best_of"),
    ({"prompt": "x", "logprobs": 21}, "logprobs"),
    ({"prompt": "x", "frobnicate": True}, "frobnicate"),
    ({"prompt": "x", "n": 2, "echo": True, "logprobs": 1, "logit_bias": {"-1": 5}}, "logit_bias"),
])
def test_completions_reject_what_they_do_not_serve_by_name(stack, body, param):  # noqa: F811
    import openai

    with pytest.raises(openai.BadRequestError) as info:
        stack[1].completions.create(model=MODEL, **body) if "frobnicate" not in body else \
            stack[1].completions.create(model=MODEL, prompt="x", extra_body={"frobnicate": True})
    error = info.value.body
    assert param in (error.get("param") or "") + error.get("message", ""), error
