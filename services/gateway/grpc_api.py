"""InferenceService (inference.proto): the public gRPC API, served by the gateway next to HTTP.

Requests are turned into the same pydantic requests the HTTP API validates, so defaults, limits
and errors are identical; worker responses become chunk messages. Cancelling the call closes
the worker stream, which aborts the request.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
import structlog
from google.protobuf.message import Message
from tokenfleet.services.common.errors import map_errors
from tokenfleet.services.gateway.app import Gateway, validate_body
from tokenfleet.services.gateway.streams import Started, responses_of
from tokenfleet.services.gateway.tenancy import CALLER, Caller

from tokenfleet.api.openai_schema import APIError, ChatCompletionRequest, CompletionRequest
from tokenfleet.api.tools import CallStarted, ContentText, ToolCallParser, ToolEvent
from tokenfleet.models.tokenizer import Tokenizer
from tokenfleet.telemetry.metrics import RequestTimer
from tokenfleet.telemetry.request_id import from_metadata, new_request_id
from tokenfleet.v1 import common_pb2, inference_pb2, inference_pb2_grpc

log = structlog.get_logger()
CHAT, COMPLETION = "grpc:ChatCompletion", "grpc:Completion"  # the requests metric's endpoint label


def _fields(message: Message) -> dict[str, Any]:
    """The fields a caller set, as plain Python values (unset optional fields are left out)."""
    return {f.name: (list(v) if f.is_repeated else v) for f, v in message.ListFields()}


def chat_request(req: inference_pb2.ChatCompletionRequest) -> ChatCompletionRequest:
    messages = []
    for m in req.messages:
        message = {k: v for k, v in _fields(m).items() if k in ("role", "content", "name", "tool_call_id")}
        if m.tool_calls:
            message["tool_calls"] = [{"id": c.id, "type": c.type or "function",
                                      "function": {"name": c.function.name, "arguments": c.function.arguments}}
                                     for c in m.tool_calls]
        messages.append(message)
    body: dict[str, Any] = {"model": req.model, "messages": messages, "stream": True, "n": req.n or 1,
                            "logprobs": req.logprobs, "stream_options": {"include_usage": req.include_usage}}
    if req.tools:
        body["tools"] = [{"type": t.type or "function", "function": _function(t.function)} for t in req.tools]
        body["parallel_tool_calls"] = req.parallel_tool_calls
    if req.tool_choice:
        body["tool_choice"] = (req.tool_choice if req.tool_choice in ("none", "auto", "required")
                               else {"type": "function", "function": {"name": req.tool_choice}})
    if req.response_format_json:
        body["response_format"] = _json(req.response_format_json, "response_format_json")
    sampling = _fields(req.sampling)
    if "max_tokens" in sampling:
        body["max_completion_tokens"] = sampling.pop("max_tokens")
    if req.HasField("top_logprobs"):
        body["top_logprobs"] = req.top_logprobs
    if req.user:
        body["user"] = req.user
    return validate_body(ChatCompletionRequest, body | sampling)


def _json(text: str, param: str) -> Any:
    try:
        return json.loads(text)
    except ValueError as e:
        raise APIError(400, f"{param} is not valid JSON: {e}", param=param) from e


def _function(f: inference_pb2.FunctionDefinition) -> dict[str, Any]:
    out: dict[str, Any] = {"name": f.name}
    if f.description:
        out["description"] = f.description
    if f.parameters_json:
        out["parameters"] = _json(f.parameters_json, "tools.function.parameters_json")
    if f.strict:
        out["strict"] = True
    return out


def completion_request(req: inference_pb2.CompletionRequest) -> CompletionRequest:
    which = req.WhichOneof("input")
    if which is None:
        raise APIError(400, "prompt or prompt_token_ids is required", param="prompt")
    body: dict[str, Any] = {"model": req.model, "stream": True, "n": req.n or 1, "echo": req.echo,
                            "prompt": req.prompt if which == "prompt" else list(req.prompt_token_ids.ids),
                            "stream_options": {"include_usage": req.include_usage}}
    if req.HasField("logprobs"):
        body["logprobs"] = req.logprobs
    if req.user:
        body["user"] = req.user
    return validate_body(CompletionRequest, body | _fields(req.sampling))


def _finish(final: Message, called: bool) -> int:
    if called and final.finish_reason == common_pb2.FINISH_REASON_STOP:
        return common_pb2.FINISH_REASON_TOOL_CALLS
    return final.finish_reason


def _tool_call_deltas(events: list[ToolEvent]) -> list[inference_pb2.ChatChoiceDelta]:
    """Parser events -> deltas: content, a call's id and name, then its argument fragments."""
    out = []
    for event in events:
        if isinstance(event, ContentText):
            out.append(inference_pb2.ChatChoiceDelta(content=event.text))
        elif isinstance(event, CallStarted):
            call = inference_pb2.ToolCall(index=event.index, id=event.call.id, type="function",
                                          function=inference_pb2.FunctionCall(name=event.call.name))
            out.append(inference_pb2.ChatChoiceDelta(tool_calls=[call]))
        else:
            call = inference_pb2.ToolCall(index=event.index, function=inference_pb2.FunctionCall(arguments=event.fragment))
            out.append(inference_pb2.ChatChoiceDelta(tool_calls=[call]))
    return out


async def _chat_chunks(run: Started, timer: RequestTimer) -> AsyncIterator[Message]:
    def chunk(**kw: Any) -> inference_pb2.ChatCompletionChunk:
        return inference_pb2.ChatCompletionChunk(id=run.request_id, model=run.model.name, created=int(time.time()), **kw)

    def delta(index: int, d: inference_pb2.ChatChoiceDelta) -> inference_pb2.ChatCompletionChunk:
        d.index = index
        return chunk(choices=[d])

    parsers = [ToolCallParser() for _ in range(run.n)]
    for index in range(run.n):
        yield chunk(choices=[inference_pb2.ChatChoiceDelta(index=index, role="assistant")])
    async with responses_of(run, timer) as responses:
        async for r in responses:
            if r.HasField("chunk"):
                index = r.chunk.index
                lp = _logprobs(run.model.tokenizer, list(r.chunk.logprobs))
                if run.tools:
                    deltas = _tool_call_deltas(parsers[index].feed(r.chunk.text))
                else:
                    deltas = [inference_pb2.ChatChoiceDelta(content=r.chunk.text)] if r.chunk.text else []
                if not deltas and lp:
                    deltas = [inference_pb2.ChatChoiceDelta()]
                for i, d in enumerate(deltas):
                    if i == 0:
                        d.logprobs.extend(lp)
                    yield delta(index, d)
            else:
                index = r.final.index
                for d in _tool_call_deltas(parsers[index].finish()) if run.tools else []:
                    yield delta(index, d)
                finish = _finish(r.final, any(call.complete for call in parsers[index].calls))
                yield chunk(choices=[inference_pb2.ChatChoiceDelta(index=index, finish_reason=finish)])
    if run.include_usage:
        yield chunk(usage=run.usage)


async def _completion_chunks(run: Started, timer: RequestTimer) -> AsyncIterator[Message]:
    def chunk(**kw: Any) -> inference_pb2.CompletionChunk:
        return inference_pb2.CompletionChunk(id=run.request_id, model=run.model.name, created=int(time.time()), **kw)

    offsets = [len(run.echo)] * run.n
    echoed = [not run.echo] * run.n
    async with responses_of(run, timer) as responses:
        async for r in responses:
            index = r.chunk.index if r.HasField("chunk") else r.final.index
            if not echoed[index]:  # the prompt first; its tokens after the first carry logprobs when asked
                echoed[index] = True
                first = run.model.tokenizer.decode(run.prompt[:1], skip_special_tokens=False)
                lp = _logprobs(run.model.tokenizer, list(r.chunk.prompt_logprobs), len(first))
                yield chunk(choices=[inference_pb2.CompletionChoiceDelta(index=index, text=run.echo, logprobs=lp)])
            if r.HasField("chunk"):
                lp = _logprobs(run.model.tokenizer, list(r.chunk.logprobs), offsets[index])
                offsets[index] += len(r.chunk.text)
                yield chunk(choices=[inference_pb2.CompletionChoiceDelta(index=index, text=r.chunk.text, logprobs=lp)])
            else:
                yield chunk(choices=[inference_pb2.CompletionChoiceDelta(index=r.final.index,
                                                                         finish_reason=r.final.finish_reason)])
    if run.include_usage:
        yield chunk(usage=run.usage)


def _logprobs(tokenizer: Tokenizer, logprobs: list[common_pb2.TokenLogprob], offset: int = 0
              ) -> list[inference_pb2.TokenLogprobs]:
    def token(token_id: int, logprob: float) -> inference_pb2.LogprobToken:
        text = tokenizer.decode([token_id], skip_special_tokens=False)
        return inference_pb2.LogprobToken(token=text, logprob=logprob, bytes=text.encode())

    out = []
    for lp in logprobs:
        entry = token(lp.token_id, lp.logprob)
        out.append(inference_pb2.TokenLogprobs(token=entry, top_logprobs=[token(t.token_id, t.logprob) for t in lp.top],
                                               text_offset=offset))
        offset += len(entry.token)
    return out


class InferenceAPI(inference_pb2_grpc.InferenceServiceServicer):
    def __init__(self, gateway: Gateway):
        self.gateway = gateway

    def authenticate(self, context: grpc.aio.ServicerContext) -> Caller:
        """The caller from the ``authorization`` metadata (``Bearer tfk_...``); APIError 401 -> UNAUTHENTICATED."""
        metadata = {k: v for k, v in (context.invocation_metadata() or ()) if isinstance(v, str)}
        return self.gateway.admission.authenticate(metadata.get("authorization"))

    async def _serve(self, context: grpc.aio.ServicerContext, endpoint: str, start: Callable[[], Awaitable[Started]],
                     chunks: Callable[[Started, RequestTimer], AsyncIterator[Message]]) -> AsyncIterator[Message]:
        """What both streaming calls share: the request id, metrics, placement, then ``chunks``."""
        request_id = new_request_id(from_metadata(context.invocation_metadata()))
        with structlog.contextvars.bound_contextvars(request_id=request_id):
            timer = RequestTimer(self.gateway.metrics)
            try:
                CALLER.set(self.authenticate(context))
                run = await start()
            except APIError as e:  # becomes a status in map_errors
                self.gateway.metrics.requests.labels(endpoint, str(e.status)).inc()
                raise
            async for chunk in chunks(run, timer):
                yield chunk
            self.gateway.metrics.requests.labels(endpoint, "200").inc()

    @map_errors
    async def ChatCompletion(self, request: inference_pb2.ChatCompletionRequest, context: grpc.aio.ServicerContext
                             ) -> AsyncIterator[Message]:
        async for chunk in self._serve(context, CHAT, lambda: self.gateway.start_chat(chat_request(request)),
                                       _chat_chunks):
            yield chunk

    @map_errors
    async def Completion(self, request: inference_pb2.CompletionRequest, context: grpc.aio.ServicerContext
                         ) -> AsyncIterator[Message]:
        async for chunk in self._serve(context, COMPLETION,
                                       lambda: self.gateway.start_completion(completion_request(request)),
                                       _completion_chunks):
            yield chunk

    @map_errors
    async def ListModels(self, request: inference_pb2.ListServedModelsRequest, context: grpc.aio.ServicerContext
                         ) -> inference_pb2.ListServedModelsResponse:
        self.authenticate(context)
        return inference_pb2.ListServedModelsResponse(models=[
            inference_pb2.ModelInfo(id=name, created=created) for name, created in self.gateway.models.names()])
