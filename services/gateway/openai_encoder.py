"""Choice events (events.py) -> OpenAI's JSON: whole ``chat.completion`` / ``text_completion``
bodies and their streamed chunks as server-sent events."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import structlog
from tokenfleet.services.gateway import events as ev

from tokenfleet.api.openai_schema import APIError

if TYPE_CHECKING:
    from tokenfleet.services.gateway.pipeline import Prepared

log = structlog.get_logger()


def envelope(kind: str, request_id: str, model: str, choices: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
    return {"id": request_id, "object": kind, "created": int(time.time()), "model": model, "choices": choices, **extra}


def usage(u: ev.Usage) -> dict[str, Any]:
    return {
        "prompt_tokens": u.prompt_tokens,
        "completion_tokens": u.completion_tokens,
        "total_tokens": u.prompt_tokens + u.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": u.cached_tokens},
    }


def chat_logprobs(logprobs: tuple[ev.Logprob, ...] | list[ev.Logprob]) -> dict[str, Any]:
    def entry(token: str, logprob: float | None) -> dict[str, Any]:
        return {"token": token, "logprob": logprob, "bytes": list(token.encode())}

    return {"content": [{**entry(lp.token, lp.logprob), "top_logprobs": [entry(t, v) for t, v in lp.top]}
                        for lp in logprobs]}


def completion_logprobs(logprobs: tuple[ev.Logprob, ...] | list[ev.Logprob], offset: int) -> dict[str, Any]:
    """Completion logprobs (an echoed prompt's first token has none: null, as OpenAI's); offsets
    count from ``offset`` by each token's text."""
    offsets = []
    for lp in logprobs:
        offsets.append(offset)
        offset += len(lp.token)
    return {
        "tokens": [lp.token for lp in logprobs],
        "token_logprobs": [lp.logprob for lp in logprobs],
        "top_logprobs": [None if lp.logprob is None else dict(lp.top) for lp in logprobs],
        "text_offset": offsets,
    }


def sse(data: dict[str, Any] | str) -> bytes:
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n".encode()


@dataclass
class _Whole:
    """One choice folded from its events."""

    echo: ev.Echo | None = None
    logprobs: list[ev.Logprob] = field(default_factory=list)
    finished: ev.Finished | None = None


async def _fold(events: AsyncIterator[ev.ChoiceEvent]) -> tuple[dict[int, _Whole], ev.Usage]:
    choices: dict[int, _Whole] = {}
    used = ev.Usage()
    async for event in events:
        if isinstance(event, ev.Ended):
            used = event.usage
            continue
        whole = choices.setdefault(event.index, _Whole())
        if isinstance(event, ev.Echo):
            whole.echo = event
        elif isinstance(event, (ev.Text, ev.ToolCallStarted, ev.ToolArguments)):
            whole.logprobs += event.logprobs
        elif isinstance(event, ev.Finished):
            whole.finished = event
    return choices, used


@dataclass
class OpenAIEncoder:
    """Renders one request's events; ``logprobs``: the request asked for them."""

    request_id: str
    model: str
    logprobs: bool
    include_usage: bool
    tools: bool = False  # chat with tools: the opening delta's content is null

    @classmethod
    def of(cls, prepared: Prepared) -> OpenAIEncoder:
        return cls(prepared.request_id, prepared.model.name, prepared.params.logprobs is not None,
                   prepared.include_usage, tools=prepared.tools)

    async def chat_body(self, events: AsyncIterator[ev.ChoiceEvent]) -> dict[str, Any]:
        choices, used = await _fold(events)
        out = []
        for index in sorted(choices):
            whole = choices[index]
            finished = whole.finished or ev.Finished(index, "stop", "", "")
            message: dict[str, Any] = {"role": "assistant", "content": finished.content}
            if finished.tool_calls:
                message["tool_calls"] = [call.openai() for call in finished.tool_calls]
            out.append({"index": index, "message": message, "finish_reason": finished.reason,
                        "logprobs": chat_logprobs(whole.logprobs) if self.logprobs else None})
        return envelope("chat.completion", self.request_id, self.model, out, usage=usage(used))

    async def completion_body(self, events: AsyncIterator[ev.ChoiceEvent]) -> dict[str, Any]:
        choices, used = await _fold(events)
        out = []
        for index in sorted(choices):
            whole = choices[index]
            finished = whole.finished or ev.Finished(index, "stop", "", "")
            echo = whole.echo.text if whole.echo else ""
            lp = completion_logprobs(whole.logprobs, len(echo)) if self.logprobs else None
            if lp is not None and whole.echo is not None:
                prompt = completion_logprobs(whole.echo.logprobs, 0)
                lp = {key: prompt[key] + lp[key] for key in lp}
            out.append({"index": index, "text": echo + finished.text, "finish_reason": finished.reason, "logprobs": lp})
        return envelope("text_completion", self.request_id, self.model, out, usage=usage(used))

    async def chat_stream(self, events: AsyncIterator[ev.ChoiceEvent]) -> AsyncIterator[bytes]:
        def chunk(index: int, delta: dict[str, Any], logprobs: Any = None, finish: str | None = None) -> bytes:
            choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
            return sse(envelope("chat.completion.chunk", self.request_id, self.model, [choice]))

        async for event in _errors_as_events(events):
            if isinstance(event, bytes):
                yield event
                return
            lp = chat_logprobs(event.logprobs) if getattr(event, "logprobs", None) else None
            if isinstance(event, ev.Opened):
                yield chunk(event.index, {"role": "assistant", "content": None if self.tools else ""})
            elif isinstance(event, ev.Text):
                yield chunk(event.index, {"content": event.text} if event.text else {}, lp)
            elif isinstance(event, ev.ToolCallStarted):
                call = {"index": event.call_index, "id": event.call.id, "type": "function",
                        "function": {"name": event.call.name, "arguments": ""}}
                yield chunk(event.index, {"tool_calls": [call]}, lp)
            elif isinstance(event, ev.ToolArguments):
                call = {"index": event.call_index, "function": {"arguments": event.fragment}}
                yield chunk(event.index, {"tool_calls": [call]}, lp)
            elif isinstance(event, ev.Finished):
                yield chunk(event.index, {}, finish=event.reason)
            elif isinstance(event, ev.Ended):
                if self.include_usage:
                    yield sse(envelope("chat.completion.chunk", self.request_id, self.model, [],
                                       usage=usage(event.usage)))
                yield sse("[DONE]")

    async def completion_stream(self, events: AsyncIterator[ev.ChoiceEvent]) -> AsyncIterator[bytes]:
        def chunk(index: int, text: str, logprobs: Any = None, finish: str | None = None) -> bytes:
            choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}
            return sse(envelope("text_completion", self.request_id, self.model, [choice]))

        async for event in _errors_as_events(events):
            if isinstance(event, bytes):
                yield event
                return
            if isinstance(event, ev.Echo):
                yield chunk(event.index, event.text, completion_logprobs(event.logprobs, 0) if self.logprobs else None)
            elif isinstance(event, ev.Text):
                lp = completion_logprobs(event.logprobs, event.offset) if event.logprobs else None
                yield chunk(event.index, event.text, lp)
            elif isinstance(event, ev.Finished):
                yield chunk(event.index, "", finish=event.reason)
            elif isinstance(event, ev.Ended):
                if self.include_usage:
                    yield sse(envelope("text_completion", self.request_id, self.model, [], usage=usage(event.usage)))
                yield sse("[DONE]")


async def _errors_as_events(events: AsyncIterator[ev.ChoiceEvent]) -> AsyncIterator[ev.ChoiceEvent | bytes]:
    """An error after the stream began becomes one OpenAI-shaped ``error`` event that ends the
    stream (clients raise it), not a connection cut mid-stream."""
    try:
        async for event in events:
            yield event
    except APIError as e:
        log.warning("stream ended with an error", status=e.status, error=e.message)
        yield sse(e.body())
