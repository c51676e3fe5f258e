"""What a request's response is made of, independent of the transport that renders it.

The pipeline (``pipeline.py``) turns the worker's stream into these events; the OpenAI HTTP
encoder (``openai_encoder.py``) and the public gRPC encoder (``grpc_encoder.py``) render them.
A response field is added here and in the two encoders, nowhere else.

Per choice (``index``), in order: ``Opened`` (chat only), ``Echo`` (completions with echo),
any number of ``Text`` / ``ToolCallStarted`` / ``ToolArguments``, then ``Finished``; choices
interleave. After every choice finished: ``Ended`` with the request's usage.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tokenfleet.api.tools import ToolCall


@dataclass(frozen=True)
class Logprob:
    """One token's log-probability (None: the first prompt token, which has none) and the top alternatives."""

    token: str
    logprob: float | None
    top: tuple[tuple[str, float], ...] = ()


@dataclass(frozen=True)
class Opened:
    """Chat: the assistant's message for choice ``index`` begins."""

    index: int


@dataclass(frozen=True)
class Echo:
    """Completions with echo: the prompt's text, sent before the choice's own text. ``logprobs``
    covers every prompt token (the first has none) when logprobs were asked for, else is empty."""

    index: int
    text: str
    logprobs: tuple[Logprob, ...] = ()


@dataclass(frozen=True)
class Text:
    """Output text of choice ``index``. ``offset``: where it starts in the choice's whole text (after
    any echo). ``logprobs``: of the tokens that produced it (only on the first event of a worker
    chunk; an event may carry logprobs and no text while a tool call's text is held)."""

    index: int
    text: str
    offset: int = 0
    logprobs: tuple[Logprob, ...] = ()


@dataclass(frozen=True)
class ToolCallStarted:
    """Tool call ``call.index`` of choice ``index`` has its id and name; its arguments follow."""

    index: int
    call_index: int
    call: ToolCall
    logprobs: tuple[Logprob, ...] = ()


@dataclass(frozen=True)
class ToolArguments:
    """The next fragment of a tool call's arguments text."""

    index: int
    call_index: int
    fragment: str
    logprobs: tuple[Logprob, ...] = ()


@dataclass(frozen=True)
class Finished:
    """Choice ``index`` ended. ``reason``: stop, length, abort or tool_calls. The whole result comes
    along for encoders that answer with one body: ``text`` (the output, no echo), and for chat with
    tools the split into ``content`` (None when the reply is calls only) and complete ``tool_calls``."""

    index: int
    reason: str
    text: str
    content: str | None
    tool_calls: tuple[ToolCall, ...] = ()


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0


@dataclass(frozen=True)
class Ended:
    """Every choice finished; the request's token counts (the prompt counted once for n samples)."""

    usage: Usage = field(default_factory=Usage)


ChoiceEvent = Opened | Echo | Text | ToolCallStarted | ToolArguments | Finished | Ended
