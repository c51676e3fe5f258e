"""Tool calling: the call grammar accepts exactly well-formed calls, and the incremental parser
gives the same calls however the text is split."""

from __future__ import annotations

import json
import random

import llguidance
import pytest

from tokenfleet.api import tools
from tokenfleet.cluster.registry import TOOL_FORMATS
from tokenfleet.engine.grammar import grammar_text
from tokenfleet.models.tokenizer import Tokenizer

FUNCS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
        "additionalProperties": False}}},
    {"type": "function", "function": {"name": "noop"}},
]
CALL = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'


@pytest.fixture(scope="module")
def tokenizer(default_model_dir):
    tok = Tokenizer(default_model_dir)
    return tok, llguidance.LLTokenizer(tok.to_json(), n_vocab=tok.vocab_size, eos_token=2)


def accepts(tokenizer, guided, text: str) -> bool:
    tok, lt = tokenizer
    matcher = llguidance.LLMatcher(lt, grammar_text(guided), log_level=0)
    return matcher.consume_tokens(tok.encode(text)) and matcher.is_accepting()


@pytest.mark.parametrize(("choice", "parallel", "text", "ok"), [
    ("auto", True, "Hello there, friend.", True),
    ("auto", True, "Sure: " + CALL, False),  # the marker never appears inside text
    ("auto", True, CALL, True),
    ("auto", True, CALL + "\n" + CALL, True),
    ("auto", False, CALL + "\n" + CALL, False),
    ("required", True, "Hello", False),
    ("required", True, '<tool_call>{"name": "get_weather", "arguments": {}}</tool_call>', False),  # city required
    ("required", True, '<tool_call>{"name": "nope", "arguments": {}}</tool_call>', False),
    ("required", True, '<tool_call>{"arguments": {"city": "Paris"}, "name": "get_weather"}</tool_call>', False),
    ("required", True, '<tool_call>{"name": "noop", "arguments": {}}</tool_call>', True),
    ("noop", True, CALL, False),
    ("get_weather", True, CALL, True),
])
def test_call_grammar(tokenizer, choice, parallel, text, ok):
    assert accepts(tokenizer, tools.grammar(FUNCS, choice, parallel), text) is ok


def test_unknown_named_function_is_an_error():
    with pytest.raises(ValueError, match="tool_choice"):
        tools.grammar(FUNCS, "missing", True)


def test_parser_is_split_invariant():
    text = CALL + '\n<tool_call>{"name": "noop", "arguments": {"s": "a}\\"b{", "l": [1, {"x": [2]}]}}</tool_call>'
    content, whole = tools.parse(text)
    assert content is None and [(c.name, json.loads(c.arguments)) for c in whole] == \
        [("get_weather", {"city": "Paris"}), ("noop", {"s": 'a}"b{', "l": [1, {"x": [2]}]})]
    rng = random.Random(0)
    for _ in range(200):
        parser, events, i = tools.ToolCallParser(), [], 0
        while i < len(text):
            j = i + rng.randint(1, 9)
            events += parser.feed(text[i:j])
            i = j
        events += parser.finish()
        names = [e.call.name for e in events if isinstance(e, tools.CallStarted)]
        arguments = [
            "".join(e.fragment for e in events if isinstance(e, tools.ArgumentsFragment) and e.index == k)
            for k in range(len(names))
        ]
        assert names == [c.name for c in whole] and arguments == [c.arguments for c in whole]
        assert not [e for e in events if isinstance(e, tools.ContentText)]


def test_plain_text_and_a_marker_prefix_are_content():
    assert tools.parse("Hello <b>world</b>") == ("Hello <b>world</b>", [])
    assert tools.parse("<tool") == ("<tool", [])


def test_history_rendering_and_formats():
    assert set(tools.FORMATS) == set(TOOL_FORMATS)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather?"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "c1", "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'}}]},
                {"role": "tool", "tool_call_id": "c1", "content": "21C"}]
    hermes = tools.prepare_messages(messages, FUNCS, tools.FORMATS["hermes"])
    assert hermes[0]["role"] == "system" and hermes[0]["content"].startswith("Be brief.")
    assert '"name": "get_weather"' in hermes[0]["content"] and "<tools>" in hermes[0]["content"]
    assert hermes[2]["content"] == CALL
    assert hermes[3] == {"role": "tool", "content": "<tool_response>\n21C\n</tool_response>"}
    generic = tools.prepare_messages(messages, None, tools.FORMATS["generic"])
    assert generic[0] == {"role": "system", "content": "Be brief."} and generic[3]["role"] == "user"


def test_parameters_with_defs_and_refs_compile_and_accept_a_valid_call(tokenizer):
    """Found in review: nesting parameters inside a wrapper schema broke `#/$defs/...` pointers."""
    from tokenfleet.engine.grammar import validate

    address = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
               "additionalProperties": False}
    fn = {"type": "function", "function": {"name": "ship", "parameters": {
        "type": "object", "$defs": {"Address": address}, "properties": {"to": {"$ref": "#/$defs/Address"}},
        "required": ["to"], "additionalProperties": False}}}
    guided = tools.grammar([fn], "required", False)
    validate(guided)
    assert accepts(tokenizer, guided, '<tool_call>{"name": "ship", "arguments": {"to": {"city": "Oslo"}}}</tool_call>')
    assert not accepts(tokenizer, guided, '<tool_call>{"name": "ship", "arguments": {"to": {}}}</tool_call>')
    content, calls = tools.parse('<tool_call>{"name": "ship", "arguments": {"to": {"city": "Oslo"}}}</tool_call>')
    assert content is None and json.loads(calls[0].arguments) == {"to": {"city": "Oslo"}}
    assert tools.parse("") == ("", [])  # an empty reply is empty content, not null


WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["c", "f"]}},
    "required": ["city"]}}}  # no additionalProperties: JSON Schema's default would admit any extra field


def call(args: str, name: str = "get_weather") -> str:
    return f'<tool_call>{{"name": "{name}", "arguments": {args}}}</tool_call>'


def test_arguments_admit_only_declared_properties_unless_the_schema_allows_more(tokenizer):
    """OpenAI strict function calling: undeclared properties are excluded (found: the model padded a
    weather call with the schema's own "type"/"properties" keys and never stopped)."""
    guided = tools.grammar([WEATHER], "required", False)
    assert accepts(tokenizer, guided, call('{"city": "Oslo"}'))
    assert accepts(tokenizer, guided, call('{"city": "Oslo", "unit": "c"}'))
    assert not accepts(tokenizer, guided, call('{"city": "Oslo", "type": "object"}'))
    open_fn = {"type": "function", "function": {"name": "log", "parameters": {
        "type": "object", "properties": {"msg": {"type": "string"}}, "additionalProperties": True}}}
    assert accepts(tokenizer, tools.grammar([open_fn], "required", False), call('{"msg": "a", "extra": 1}', "log"))


def test_strict_schema_closes_nested_objects_and_leaves_allof_members_open():
    schema = {"type": "object", "properties": {
        "to": {"type": "object", "properties": {"city": {"type": "string"}}},
        "tags": {"type": "array", "items": {"type": "object", "properties": {"k": {"type": "string"}}}},
        "meta": {"type": "object", "additionalProperties": {"type": "object", "properties": {"v": {"type": "integer"}}}},
        "either": {"anyOf": [{"type": "object", "properties": {"a": {"type": "integer"}}}, {"type": "string"}]},
        "both": {"allOf": [{"type": "object", "properties": {"a": {"type": "integer"}}},
                           {"type": "object", "properties": {"b": {"type": "integer"}}}]},
    }, "$defs": {"P": {"type": "object", "properties": {"x": {"type": "number"}}}}}
    before = json.dumps(schema, sort_keys=True)
    strict = tools.strict_schema(schema)
    assert json.dumps(schema, sort_keys=True) == before  # the caller's schema is not changed
    props = strict["properties"]
    assert strict["additionalProperties"] is False
    assert props["to"]["additionalProperties"] is False
    assert props["tags"]["items"]["additionalProperties"] is False
    assert props["meta"]["additionalProperties"]["additionalProperties"] is False  # the value schema, closed
    assert props["either"]["anyOf"][0]["additionalProperties"] is False and props["either"]["anyOf"][1] == {"type": "string"}
    assert all("additionalProperties" not in member for member in props["both"]["allOf"])
    assert strict["$defs"]["P"]["additionalProperties"] is False
