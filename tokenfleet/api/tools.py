"""Tool calling: how a model family sees tools and writes calls, the grammar that makes every
call valid, and the parser that turns the output back into OpenAI ``tool_calls``.

A model's registry record names its ``tool_format``; ``hermes`` (ChatML roles, a ``tool`` role
for results) and the ``generic`` fallback (results as user messages, for templates that only
know user/assistant/system) write calls the same way::

    <tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>

one per line when several are made. Under ``tool_choice`` ``auto`` the output is either plain
text that never contains the call marker, or calls only; ``required`` and a named function
allow calls only. The call JSON is generated under a grammar built from the functions' JSON
schemas (name first, then the arguments; compact layout), so ``arguments`` always validates
against its function's ``parameters`` and the streaming parser can hand out argument
fragments as exact substrings of the final arguments text.

Arguments are generated as OpenAI's strict function calling does: an object schema that does
not say whether undeclared properties are allowed admits only its declared ones (``strict_schema``;
JSON Schema's own default admits any, and small models then padded calls with invented fields,
copying the schema's own ``type``/``properties`` keys into the arguments). A schema that sets
``additionalProperties`` (``true`` or a schema), ``patternProperties`` or ``unevaluatedProperties``
keeps what it says.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from tokenfleet.engine.grammar import JSON_LAYOUT, Guided

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
_NAME_PREFIX = '{"name": '
_ARGS_PREFIX = ', "arguments": '

SYSTEM_PROMPT = (
    "You can call functions to help answer. The functions, as JSON schemas:\n<tools>\n{tools}\n</tools>\n"
    "To call a function, reply with one line per call and nothing else:\n"
    + CALL_OPEN + '{{"name": <function name>, "arguments": <arguments object>}}' + CALL_CLOSE
)


@dataclass(frozen=True)
class ToolFormat:
    name: str
    tool_role: str  # the role tool results are given: "tool" (templates that know it) or "user"
    result_open: str = "<tool_response>\n"
    result_close: str = "\n</tool_response>"


FORMATS = {
    "hermes": ToolFormat("hermes", tool_role="tool"),
    "generic": ToolFormat("generic", tool_role="user"),
}
DEFAULT_FORMAT = "generic"


def tool_format(name: str) -> ToolFormat:
    return FORMATS.get(name or DEFAULT_FORMAT, FORMATS[DEFAULT_FORMAT])


def render_call(name: str, arguments: str) -> str:
    """A call as the model writes it (also how past calls appear in the history)."""
    try:
        args = json.dumps(json.loads(arguments), ensure_ascii=False)
    except (TypeError, ValueError):
        args = arguments  # the history's own text, kept as the client sent it
    return f'{CALL_OPEN}{{"name": {json.dumps(name)}, "arguments": {args}}}{CALL_CLOSE}'


def prepare_messages(messages: list[dict[str, Any]], tools: Sequence[dict[str, Any]] | None,
                     fmt: ToolFormat) -> list[dict[str, Any]]:
    """Messages for the chat template: tool descriptions in the system message, assistant
    ``tool_calls`` written as calls, tool results in the format's role and wrapper."""
    out: list[dict[str, Any]] = []
    for m in messages:
        role, content = m["role"], m.get("content") or ""
        if role == "assistant" and m.get("tool_calls"):
            calls = "\n".join(render_call(c["function"]["name"], c["function"].get("arguments", "{}"))
                              for c in m["tool_calls"])
            content = f"{content}\n{calls}" if content else calls
        elif role == "tool":
            role, content = fmt.tool_role, f"{fmt.result_open}{content}{fmt.result_close}"
        elif role == "developer":
            role = "system"
        out.append({"role": role, "content": content})
    if tools:
        listing = "\n".join(json.dumps(t["function"], ensure_ascii=False) for t in tools)
        intro = SYSTEM_PROMPT.format(tools=listing)
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": f"{out[0]['content']}\n\n{intro}"}
        else:
            out.insert(0, {"role": "system", "content": intro})
    return out


_SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "prefixItems")
_SUBSCHEMAS = ("items", "additionalProperties", "unevaluatedProperties", "not", "if", "then", "else", "contains",
               "propertyNames", "additionalItems")
_OPEN_KEYS = ("additionalProperties", "patternProperties", "unevaluatedProperties")


def strict_schema(schema: Any, *, close: bool = True) -> Any:
    """``schema`` with ``additionalProperties: false`` on every object schema that does not say what
    undeclared properties may be (at any depth: properties, items, $defs, anyOf/oneOf branches). The
    members of an ``allOf`` are left open at their top (each closed alone would reject the others'
    properties). Returns a new schema; the input is not changed."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _SUBSCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {name: strict_schema(sub) for name, sub in out[key].items()}
    for key in _SUBSCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [strict_schema(sub) for sub in out[key]]
    if isinstance(out.get("allOf"), list):
        out["allOf"] = [strict_schema(sub, close=False) for sub in out["allOf"]]
    for key in _SUBSCHEMAS:
        if isinstance(out.get(key), dict):
            out[key] = strict_schema(out[key])
    types = out.get("type")
    is_object = types == "object" or (isinstance(types, list) and "object" in types) or "properties" in out
    if close and is_object and not any(key in out for key in _OPEN_KEYS):
        out["additionalProperties"] = False
    return out


def _call_rule(rule: str, function: dict[str, Any]) -> str:
    """One function's call: the literal head with its name, then its parameters schema (made strict)
    as the root of a ``%json`` (so ``$defs``/``$ref`` resolve), in the compact layout the parser reads."""
    parameters = strict_schema(function.get("parameters") or {"type": "object", "properties": {}})
    head = f'{_NAME_PREFIX}{json.dumps(function["name"])}{_ARGS_PREFIX}'
    return f"{rule}: {json.dumps(head)} %json {json.dumps({**parameters, 'x-guidance': JSON_LAYOUT})} \"}}\""


def grammar(tools: Sequence[dict[str, Any]], choice: str, parallel: bool, text: Guided | None = None) -> Guided:
    """The output grammar for ``choice``: "auto" (text or calls), "required" (calls), or a
    function's name (calls to it only). ``text``: a JSON grammar plain answers must follow
    (response_format), else free text."""
    functions = [t["function"] for t in tools if choice in ("auto", "required") or t["function"]["name"] == choice]
    if not functions:
        raise ValueError(f"tool_choice names {choice!r}, which is not among the tools")
    names = [f"fn{i}" for i in range(len(functions))]
    rules = [
        f"call: {json.dumps(CALL_OPEN)} ({' | '.join(names)}) {json.dumps(CALL_CLOSE)}",
        *(_call_rule(name, f) for name, f in zip(names, functions)),
        'calls: call ("\\n" call)*' if parallel else "calls: call",
    ]
    if choice != "auto":
        start = "start: calls"
    elif text is not None:
        answer = {"type": "object"} if text.kind == "json_object" else json.loads(text.spec)
        rules.append(f"answer: %json {json.dumps({**answer, 'x-guidance': JSON_LAYOUT})}")
        start = "start: answer | calls"
    else:
        # Plain text never starts a line with a call and never contains the marker.
        rules.append(f"TEXT: /[^<\\n][^\\x00]*/ & ~/(?s:.*){CALL_OPEN}(?s:.*)/")
        start = "start: (TEXT | calls)?"
    return Guided("lark", "\n".join([start, *rules]))


def new_call_id() -> str:
    return f"call_{secrets.token_hex(12)}"


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: str = ""
    complete: bool = False

    def openai(self, index: int | None = None) -> dict[str, Any]:
        body: dict[str, Any] = {"id": self.id, "type": "function",
                                "function": {"name": self.name, "arguments": self.arguments}}
        return body if index is None else {"index": index, **body}


@dataclass(frozen=True)
class ContentText:
    """Plain reply text."""

    text: str


@dataclass(frozen=True)
class CallStarted:
    """Call ``index`` has its id and name (its arguments follow as fragments)."""

    index: int
    call: ToolCall


@dataclass(frozen=True)
class ArgumentsFragment:
    """The next piece of call ``index``'s arguments text."""

    index: int
    fragment: str


ToolEvent = ContentText | CallStarted | ArgumentsFragment


@dataclass
class ToolCallParser:
    """Splits generated text into content and calls, incrementally (feed deltas; the same
    parser fed the whole text gives the same calls, which is how non-streamed responses are
    built). Events from ``feed``: ContentText, CallStarted when a call's name is known, then its
    ArgumentsFragments."""

    mode: str = "undecided"  # undecided | content | calls
    calls: list[ToolCall] = field(default_factory=list)
    _buf: str = ""
    _stage: str = "open"  # within calls: open | name | args | close
    _depth: int = 0
    _in_string: bool = False
    _escaped: bool = False

    def feed(self, text: str) -> list[ToolEvent]:
        events: list[ToolEvent] = []
        if self.mode == "content":
            return [ContentText(text)] if text else []
        self._buf += text
        if self.mode == "undecided":
            if not self._buf:
                return []
            if self._buf.startswith(CALL_OPEN[: len(self._buf)]) and len(self._buf) < len(CALL_OPEN):
                return []  # could still become a call
            self.mode = "calls" if self._buf.startswith(CALL_OPEN) else "content"
            if self.mode == "content":
                content, self._buf = self._buf, ""
                return [ContentText(content)]
        while self._step(events):
            pass
        return events

    def _step(self, events: list[ToolEvent]) -> bool:
        """Consume what the buffer allows; True if progress was made."""
        buf = self._buf
        if self._stage == "open":
            stripped = buf.lstrip("\n ")
            head = CALL_OPEN + _NAME_PREFIX
            if len(stripped) < len(head):
                return False
            if not stripped.startswith(head):
                raise ValueError(f"malformed tool call: {stripped[:40]!r}")
            self._buf, self._stage = stripped[len(head):], "name"
            return True
        if self._stage == "name":
            try:
                name, end = json.JSONDecoder().raw_decode(buf)
            except ValueError:
                return False  # the name string is not complete yet
            if len(buf) < end + len(_ARGS_PREFIX):
                return False
            if not buf[end:].startswith(_ARGS_PREFIX):
                raise ValueError(f"malformed tool call after the name: {buf[end:end + 20]!r}")
            call = ToolCall(new_call_id(), name)
            self.calls.append(call)
            events.append(CallStarted(len(self.calls) - 1, call))
            self._buf, self._stage = buf[end + len(_ARGS_PREFIX):], "args"
            self._depth, self._in_string, self._escaped = 0, False, False
            return True
        if self._stage == "args":
            if not buf:
                return False
            end = self._scan(buf)
            fragment = buf if end is None else buf[:end]
            call = self.calls[-1]
            call.arguments += fragment
            if fragment:
                events.append(ArgumentsFragment(len(self.calls) - 1, fragment))
            if end is None:
                self._buf = ""
                return False
            call.complete = True
            self._buf, self._stage = buf[end:], "close"
            return True
        tail = "}" + CALL_CLOSE
        if len(buf) < len(tail):
            return False
        if not buf.startswith(tail):
            raise ValueError(f"malformed tool call end: {buf[:20]!r}")
        self._buf, self._stage = buf[len(tail):], "open"
        return True

    def _scan(self, text: str) -> int | None:
        """Where the arguments value ends in ``text`` (None: not yet), tracking JSON nesting."""
        for i, ch in enumerate(text):
            if self._in_string:
                if self._escaped:
                    self._escaped = False
                elif ch == "\\":
                    self._escaped = True
                elif ch == '"':
                    self._in_string = False
            elif ch == '"':
                self._in_string = True
            elif ch in "{[":
                self._depth += 1
            elif ch in "}]":
                self._depth -= 1
                if self._depth == 0:
                    return i + 1
        return None

    def finish(self) -> list[ToolEvent]:
        """The output ended: text still held (a prefix of the marker that never completed) is content."""
        if self.mode == "undecided" and self._buf:
            self.mode = "content"
            content, self._buf = self._buf, ""
            return [ContentText(content)]
        return []


def parse(text: str) -> tuple[str | None, list[ToolCall]]:
    """Whole output -> (content, complete calls)."""
    parser = ToolCallParser()
    try:
        events = parser.feed(text) + parser.finish()
    except ValueError:
        return text, []
    content = "".join(e.text for e in events if isinstance(e, ContentText))
    calls = [c for c in parser.calls if c.complete]
    return (content if parser.mode != "calls" or not calls else None), calls
