"""Worker response streams turned into OpenAI responses: whole bodies, SSE events, and the
bookkeeping around them (metrics, settling the request's budget, the ledger record)."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import structlog
from tokenfleet.services.gateway import openai_format as fmt
from tokenfleet.services.gateway.tenancy import Ticket

from tokenfleet.api.openai_schema import APIError
from tokenfleet.api.tools import CallStarted, ContentText, ToolCallParser, ToolEvent, parse
from tokenfleet.telemetry.metrics import RequestTimer
from tokenfleet.v1 import common_pb2, engine_pb2

if TYPE_CHECKING:
    from tokenfleet.services.gateway.app import ServedModel

log = structlog.get_logger()


@dataclass
class Started:
    """A request placed on a worker whose first response has arrived."""

    model: ServedModel
    request_id: str
    first: engine_pb2.GenerateResponse
    stream: AsyncGenerator[engine_pb2.GenerateResponse, None]
    include_usage: bool
    want_logprobs: bool
    ticket: Ticket | None = None  # the admitted request's budget reservation, settled when it ends
    n: int = 1  # samples; the worker's stream ends after n finals
    tools: bool = False  # parse tool calls out of the output (chat with tools, tool_choice not "none")
    echo: str = ""  # completions with echo: the prompt's text, sent before each choice's text
    prompt: list[int] = field(default_factory=list)  # echo: the prompt's token ids (for its logprobs)
    usage: common_pb2.Usage = field(default_factory=common_pb2.Usage)  # totals over the samples so far


def sse(data: dict[str, Any] | str) -> bytes:
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n".encode()


@contextlib.asynccontextmanager
async def responses_of(run: Started, timer: RequestTimer):
    """The whole worker stream, timed; leaving the block (client gone, error) closes it, which cancels the call."""
    usage = run.usage

    async def chain() -> AsyncIterator[engine_pb2.GenerateResponse]:
        yield run.first
        async for response in run.stream:
            yield response

    produced = finals = 0

    def ttft_ms() -> float | None:
        return 1000 * (timer.first - timer.start) if timer.first is not None else None

    async def timed() -> AsyncIterator[engine_pb2.GenerateResponse]:
        nonlocal produced, finals
        async for response in chain():
            if response.HasField("chunk"):
                timer.on_chunk(len(response.chunk.token_ids))
                produced += len(response.chunk.token_ids)
            elif response.HasField("final"):
                finals += 1  # the prompt is counted once: the samples share it
                usage.prompt_tokens = response.final.usage.prompt_tokens
                usage.cached_prompt_tokens = response.final.usage.cached_prompt_tokens
                usage.completion_tokens += response.final.usage.completion_tokens
                if finals == run.n and run.ticket is not None:  # billed durably before the client can see the end
                    await run.ticket.finish("ok", usage.prompt_tokens, usage.cached_prompt_tokens,
                                            usage.completion_tokens, ttft_ms())
            yield response

    status, detail = "failed", "the stream ended without a result"
    try:
        yield timed()
    except (asyncio.CancelledError, GeneratorExit):
        status, detail = "cancelled", "the client went away"
        raise
    except Exception as e:
        detail = f"{type(e).__name__}: {e}"
        raise
    finally:
        await run.stream.aclose()
        timer.finish(usage.prompt_tokens, usage.cached_prompt_tokens, usage.completion_tokens)
        if run.ticket is not None and not run.ticket.settled:  # cancelled or failed: bill what was produced
            await run.ticket.finish(status, run.ticket.prompt_tokens, 0, produced, ttft_ms(), durable=False,
                                    detail=detail)


@dataclass
class _Choice:
    text: str = ""
    logprobs: list[common_pb2.TokenLogprob] = field(default_factory=list)
    prompt_logprobs: list[common_pb2.TokenLogprob] = field(default_factory=list)
    final: engine_pb2.GenerateFinal | None = None


async def _collect(run: Started, timer: RequestTimer) -> list[_Choice]:
    """A whole worker stream folded into one (text, logprobs, final) per sample, by index."""
    choices = [_Choice() for _ in range(run.n)]
    async with responses_of(run, timer) as responses:
        async for r in responses:
            if r.HasField("chunk"):
                choice = choices[r.chunk.index]
                choice.text += r.chunk.text
                choice.logprobs += list(r.chunk.logprobs)
                choice.prompt_logprobs = choice.prompt_logprobs or list(r.chunk.prompt_logprobs)
            else:
                choices[r.final.index].final = r.final
    return choices


def _complete_calls(parser: ToolCallParser) -> bool:
    return any(call.complete for call in parser.calls)


def _finish_reason(final: engine_pb2.GenerateFinal | None, called: bool) -> str:
    reason = fmt.FINISH.get(final.finish_reason, "stop") if final is not None else "stop"
    return "tool_calls" if called and reason == "stop" else reason


async def chat_body(run: Started, timer: RequestTimer) -> dict[str, Any]:
    model, request_id = run.model, run.request_id
    choices = []
    for index, c in enumerate(await _collect(run, timer)):
        content, calls = parse(c.text) if run.tools else (c.text, [])
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if calls:
            message["tool_calls"] = [call.openai() for call in calls]
        choices.append({"index": index, "message": message, "finish_reason": _finish_reason(c.final, bool(calls)),
                        "logprobs": fmt.chat_logprobs(model.tokenizer, c.logprobs) if run.want_logprobs else None})
    return fmt.envelope("chat.completion", request_id, model.name, choices, usage=fmt.usage(run.usage))


def _error_events(events: Callable[[Started, RequestTimer], AsyncIterator[bytes]]
                  ) -> Callable[[Started, RequestTimer], AsyncIterator[bytes]]:
    """An error after the stream began becomes one OpenAI-shaped ``error`` event that ends the
    stream (clients raise it), not a connection cut mid-stream."""
    @functools.wraps(events)
    async def wrapped(run: Started, timer: RequestTimer) -> AsyncIterator[bytes]:
        try:
            async for event in events(run, timer):
                yield event
        except APIError as e:
            log.warning("stream ended with an error", status=e.status, error=e.message)
            yield sse(e.body())
    return wrapped


def _tool_deltas(events: list[ToolEvent]) -> list[dict[str, Any]]:
    """Parser events -> chat deltas the way OpenAI streams calls: id and name first, then argument fragments."""
    deltas: list[dict[str, Any]] = []
    for event in events:
        if isinstance(event, ContentText):
            deltas.append({"content": event.text})
        elif isinstance(event, CallStarted):
            deltas.append({"tool_calls": [{"index": event.index, "id": event.call.id, "type": "function",
                                           "function": {"name": event.call.name, "arguments": ""}}]})
        else:
            deltas.append({"tool_calls": [{"index": event.index, "function": {"arguments": event.fragment}}]})
    return deltas


@_error_events
async def chat_events(run: Started, timer: RequestTimer) -> AsyncIterator[bytes]:
    model, request_id = run.model, run.request_id

    def chunk(index: int, delta: dict[str, Any], logprobs: Any = None, finish: str | None = None) -> bytes:
        choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
        return sse(fmt.envelope("chat.completion.chunk", request_id, model.name, [choice]))

    parsers = [ToolCallParser() for _ in range(run.n)]
    for index in range(run.n):
        yield chunk(index, {"role": "assistant", "content": None if run.tools else ""})
    async with responses_of(run, timer) as responses:
        async for r in responses:
            if r.HasField("chunk"):
                index = r.chunk.index
                lp = fmt.chat_logprobs(model.tokenizer, list(r.chunk.logprobs)) if r.chunk.logprobs else None
                deltas = _tool_deltas(parsers[index].feed(r.chunk.text)) if run.tools else (
                    [{"content": r.chunk.text}] if r.chunk.text else [])
                if not deltas and lp is not None:
                    deltas = [{}]  # the text is held by the call parser; the logprobs go now
                for i, delta in enumerate(deltas):
                    yield chunk(index, delta, lp if i == 0 else None)
            else:
                index = r.final.index
                if run.tools:
                    for delta in _tool_deltas(parsers[index].finish()):
                        yield chunk(index, delta)
                yield chunk(index, {}, finish=_finish_reason(r.final, _complete_calls(parsers[index])))
    if run.include_usage:
        yield sse(fmt.envelope("chat.completion.chunk", request_id, model.name, [], usage=fmt.usage(run.usage)))
    yield sse("[DONE]")


async def completion_body(run: Started, timer: RequestTimer) -> dict[str, Any]:
    model, request_id = run.model, run.request_id
    choices = []
    for index, c in enumerate(await _collect(run, timer)):
        lp = fmt.completion_logprobs(model.tokenizer, c.logprobs, len(run.echo)) if run.want_logprobs else None
        if lp is not None and run.echo:
            lp = fmt.join_logprobs(fmt.echo_logprobs(model.tokenizer, run.prompt, c.prompt_logprobs), lp)
        choices.append({"index": index, "text": run.echo + c.text, "finish_reason": _finish_reason(c.final, False),
                        "logprobs": lp})
    return fmt.envelope("text_completion", request_id, model.name, choices, usage=fmt.usage(run.usage))


@_error_events
async def completion_events(run: Started, timer: RequestTimer) -> AsyncIterator[bytes]:
    model, request_id = run.model, run.request_id

    def chunk(index: int, text: str, logprobs: Any = None, finish: str | None = None) -> bytes:
        choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}
        return sse(fmt.envelope("text_completion", request_id, model.name, [choice]))

    offsets = [len(run.echo)] * run.n
    echoed = [not run.echo] * run.n

    def echo(index: int, prompt_logprobs: list[common_pb2.TokenLogprob]) -> bytes:
        echoed[index] = True
        lp = fmt.echo_logprobs(model.tokenizer, run.prompt, prompt_logprobs) if run.want_logprobs else None
        return chunk(index, run.echo, lp)

    async with responses_of(run, timer) as responses:
        async for r in responses:
            index = r.chunk.index if r.HasField("chunk") else r.final.index
            if not echoed[index]:  # the prompt first, with its logprobs (they come on the first chunk)
                yield echo(index, list(r.chunk.prompt_logprobs))
            if r.HasField("chunk"):
                logprobs = list(r.chunk.logprobs)
                lp = fmt.completion_logprobs(model.tokenizer, logprobs, offsets[index]) if logprobs else None
                offsets[index] += len(r.chunk.text)
                yield chunk(index, r.chunk.text, lp)
            else:
                yield chunk(r.final.index, "", finish=_finish_reason(r.final, False))
    if run.include_usage:
        yield sse(fmt.envelope("text_completion", request_id, model.name, [], usage=fmt.usage(run.usage)))
    yield sse("[DONE]")
