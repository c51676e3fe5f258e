"""Worker response streams turned into OpenAI responses: whole bodies, SSE events, and the
bookkeeping around them (metrics, settling the request's budget, the ledger record)."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import structlog
from tokenfleet.services.gateway import openai_format as fmt
from tokenfleet.services.gateway.tenancy import Ticket

from tokenfleet.api.openai_schema import APIError
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


def sse(data: dict[str, Any] | str) -> bytes:
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n".encode()


@contextlib.asynccontextmanager
async def responses_of(run: Started, timer: RequestTimer):
    """The whole worker stream, timed; leaving the block (client gone, error) closes it, which cancels the call."""
    usage = common_pb2.Usage()

    async def chain() -> AsyncIterator[engine_pb2.GenerateResponse]:
        yield run.first
        async for response in run.stream:
            yield response

    produced = 0

    def ttft_ms() -> float | None:
        return 1000 * (timer.first - timer.start) if timer.first is not None else None

    async def timed() -> AsyncIterator[engine_pb2.GenerateResponse]:
        nonlocal usage, produced
        async for response in chain():
            if response.HasField("chunk"):
                timer.on_chunk(len(response.chunk.token_ids))
                produced += len(response.chunk.token_ids)
            elif response.HasField("final"):
                usage = response.final.usage
                if run.ticket is not None:  # billed durably before the client can see the end
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


async def _collect(run: Started, timer: RequestTimer
                   ) -> tuple[str, list[common_pb2.TokenLogprob], engine_pb2.GenerateFinal]:
    """A whole worker stream folded into (text, logprobs, final) for non-streamed responses."""
    text, logprobs, final = "", [], engine_pb2.GenerateFinal()
    async with responses_of(run, timer) as responses:
        async for r in responses:
            if r.HasField("chunk"):
                text += r.chunk.text
                logprobs += list(r.chunk.logprobs)
            else:
                final = r.final
    return text, logprobs, final


async def chat_body(run: Started, timer: RequestTimer) -> dict[str, Any]:
    model, request_id, want_logprobs = run.model, run.request_id, run.want_logprobs
    text, logprobs, final = await _collect(run, timer)
    message = {"role": "assistant", "content": text}
    choice = {"index": 0, "message": message, "finish_reason": fmt.FINISH.get(final.finish_reason, "stop"),
              "logprobs": fmt.chat_logprobs(model.tokenizer, logprobs) if want_logprobs else None}
    return fmt.envelope("chat.completion", request_id, model.name, [choice], usage=fmt.usage(final.usage))


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


@_error_events
async def chat_events(run: Started, timer: RequestTimer) -> AsyncIterator[bytes]:
    model, request_id, include_usage = run.model, run.request_id, run.include_usage
    head = {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
    yield sse(fmt.envelope("chat.completion.chunk", request_id, model.name, [head]))
    async with responses_of(run, timer) as responses:
        async for r in responses:
            if r.HasField("chunk"):
                if not r.chunk.text and not r.chunk.logprobs:
                    continue
                lp = fmt.chat_logprobs(model.tokenizer, list(r.chunk.logprobs)) if r.chunk.logprobs else None
                choice = {"index": 0, "delta": {"content": r.chunk.text}, "logprobs": lp, "finish_reason": None}
                yield sse(fmt.envelope("chat.completion.chunk", request_id, model.name, [choice]))
            else:
                reason = fmt.FINISH.get(r.final.finish_reason)
                done = {"index": 0, "delta": {}, "logprobs": None, "finish_reason": reason}
                yield sse(fmt.envelope("chat.completion.chunk", request_id, model.name, [done]))
                if include_usage:
                    usage = fmt.usage(r.final.usage)
                    yield sse(fmt.envelope("chat.completion.chunk", request_id, model.name, [], usage=usage))
    yield sse("[DONE]")


async def completion_body(run: Started, timer: RequestTimer) -> dict[str, Any]:
    model, request_id, want_logprobs = run.model, run.request_id, run.want_logprobs
    text, logprobs, final = await _collect(run, timer)
    choice = {"index": 0, "text": text, "finish_reason": fmt.FINISH.get(final.finish_reason, "stop"),
              "logprobs": fmt.completion_logprobs(model.tokenizer, logprobs, 0) if want_logprobs else None}
    return fmt.envelope("text_completion", request_id, model.name, [choice], usage=fmt.usage(final.usage))


@_error_events
async def completion_events(run: Started, timer: RequestTimer) -> AsyncIterator[bytes]:
    model, request_id, include_usage = run.model, run.request_id, run.include_usage
    offset = 0
    async with responses_of(run, timer) as responses:
        async for r in responses:
            if r.HasField("chunk"):
                logprobs = list(r.chunk.logprobs)
                lp = fmt.completion_logprobs(model.tokenizer, logprobs, offset) if logprobs else None
                offset += len(r.chunk.text)
                choice = {"index": 0, "text": r.chunk.text, "logprobs": lp, "finish_reason": None}
                yield sse(fmt.envelope("text_completion", request_id, model.name, [choice]))
            else:
                reason = fmt.FINISH.get(r.final.finish_reason)
                done = {"index": 0, "text": "", "logprobs": None, "finish_reason": reason}
                yield sse(fmt.envelope("text_completion", request_id, model.name, [done]))
                if include_usage:
                    usage = fmt.usage(r.final.usage)
                    yield sse(fmt.envelope("text_completion", request_id, model.name, [], usage=usage))
    yield sse("[DONE]")
