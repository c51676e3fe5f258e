"""Grammar-constrained decoding with llguidance: the grammar specs and their validation
(torch-free: the gateway uses it). Compilation and masks: ``tokenfleet.engine.guided``.

A request's ``SamplingParams.guided`` names a grammar (a JSON schema, "any JSON object", a
Lark grammar in llguidance's dialect, or a regex). The engine gives each such request its own
matcher (``Request.guide``); every step the sampler sets the logits of tokens the grammar
forbids to -inf and the matcher consumes the sampled token; a grammar that is complete ends
the request (finish reason ``stop``).

Why llguidance rather than xgrammar: one 3 MB wheel with no dependencies (xgrammar pulls
triton, ninja and a torch pin on x86_64), masks in ~20-120 µs per token on the CPU with no
JIT, a Lark front end with embedded JSON schemas (what tool calling needs), and errors as
values rather than crashes. Compiling a grammar takes ~1-2 ms for typical schemas; it is
cached per grammar text and done off the engine thread (``GuideCompiler.prepare``), so a new
schema never stalls other requests' steps.

JSON is generated compactly (``", "`` and ``": "`` separators, no free whitespace): small
models otherwise wander into endless whitespace, and a fixed layout makes tool-call
arguments stream as exact substrings of the final text.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import llguidance

KINDS = ("json_schema", "json_object", "lark", "regex")
JSON_LAYOUT: Any = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


MAX_SPEC_CHARS = 64 << 10


@dataclass(frozen=True)
class Guided:
    """A grammar the output must match. ``spec``: the schema (JSON text), Lark or regex text;
    empty for ``json_object``."""

    kind: str
    spec: str = ""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"guided decoding kind must be one of {', '.join(KINDS)}, got {self.kind!r}")
        if len(self.spec) > MAX_SPEC_CHARS:  # compiled per request and cached per grammar on every worker
            raise GrammarError(f"a {self.kind} grammar may be at most {MAX_SPEC_CHARS} characters, got {len(self.spec)}")


class GrammarError(ValueError):
    """The grammar cannot be compiled; the message names the problem."""


def grammar_text(guided: Guided) -> str:
    """The llguidance grammar for ``guided``; GrammarError when it is malformed."""
    try:
        if guided.kind == "json_object":
            return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, overrides=JSON_LAYOUT)
        if guided.kind == "json_schema":
            schema = json.loads(guided.spec)
            if not isinstance(schema, dict):
                raise GrammarError("a JSON schema must be an object")
            return llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=JSON_LAYOUT)
        if guided.kind == "lark":
            return llguidance.LLMatcher.grammar_from_lark(guided.spec)
        return llguidance.LLMatcher.grammar_from_regex(guided.spec)
    except GrammarError:
        raise
    except (ValueError, TypeError) as e:  # json.JSONDecodeError is a ValueError
        raise GrammarError(f"invalid {guided.kind}: {e}") from e


def validate(guided: Guided) -> None:
    """Raise GrammarError unless llguidance accepts the grammar (no tokenizer needed: the
    gateway checks this before a request is placed)."""
    grammar = grammar_text(guided)
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar)
    if is_error:
        raise GrammarError(f"invalid {guided.kind}: {messages[0] if messages else 'rejected by the grammar compiler'}")
