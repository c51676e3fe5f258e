"""InferenceService (inference.proto): the public gRPC API, served by the gateway next to HTTP.

Requests are turned into the same pydantic requests the HTTP API validates, so defaults, limits
and errors are identical; they run through the gateway's one pipeline (pipeline.py), whose events
``grpc_encoder`` renders as chunk messages. Cancelling the call closes the worker stream, which
aborts the request.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
import structlog
from google.protobuf.message import Message
from tokenfleet.services.common.errors import map_errors, status_for
from tokenfleet.services.gateway.grpc_encoder import GrpcEncoder
from tokenfleet.services.gateway.pipeline import (
    DEFAULT_DEADLINE_S,
    Call,
    Gateway,
    Prepared,
    request_trace,
    trace_request,
    validate_body,
)

from tokenfleet.api.openai_schema import APIError, ChatCompletionRequest, CompletionRequest
from tokenfleet.telemetry.metrics import RequestTimer
from tokenfleet.telemetry.request_id import from_metadata, new_request_id
from tokenfleet.tenancy.admission import Caller
from tokenfleet.v1 import inference_pb2, inference_pb2_grpc

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
    if req.cache_salt:
        body["cache_salt"] = req.cache_salt
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
    if req.cache_salt:
        body["cache_salt"] = req.cache_salt
    return validate_body(CompletionRequest, body | _fields(req.sampling))


class InferenceAPI(inference_pb2_grpc.InferenceServiceServicer):
    def __init__(self, gateway: Gateway):
        self.gateway = gateway

    def authenticate(self, context: grpc.aio.ServicerContext) -> Caller:
        """The caller from the ``authorization`` metadata (``Bearer tfk_...``); APIError 401 -> UNAUTHENTICATED."""
        metadata = {k: v for k, v in (context.invocation_metadata() or ()) if isinstance(v, str)}
        return self.gateway.admission.authenticate(metadata.get("authorization"), context.peer())

    async def _serve(self, context: grpc.aio.ServicerContext, endpoint: str,
                     prepare: Callable[[Call], Awaitable[Prepared]], chat: bool) -> AsyncIterator[Message]:
        """What both streaming calls share: the request id, the caller, metrics, the pipeline, the encoder."""
        request_id = new_request_id(from_metadata(context.invocation_metadata()))
        with structlog.contextvars.bound_contextvars(request_id=request_id):
            timer = RequestTimer(self.gateway.metrics)
            operation = "chat" if chat else "text_completion"  # as the HTTP API's request span (app._serve)
            call = Call(request_id, endpoint, trace=request_trace(operation, request_id, attributes={
                "rpc.system": "grpc", "rpc.method": endpoint.removeprefix("grpc:")}))
            try:
                call.caller = self.authenticate(context)
                self.gateway.admission.precheck(call.caller, call.request_id, call.endpoint, call.headers)
                remaining = context.time_remaining()  # the client's gRPC deadline, None without one
                call.deadline = time.monotonic() + (DEFAULT_DEADLINE_S if remaining is None else remaining)
                prepared = await prepare(call)
                trace_request(call.trace, operation, call.caller.tenant, prepared)
                run = await self.gateway.open(call, prepared)
            except APIError as e:  # becomes a status in map_errors
                self.gateway.metrics.requests.labels(endpoint, str(e.status)).inc()
                call.trace.set(**{"rpc.grpc.status_code": status_for(e).value[0], "error.type": e.code or e.type})
                call.trace.end(e)
                raise
            except BaseException as e:
                call.trace.end(e)
                raise
            encoder = GrpcEncoder(prepared.request_id, prepared.model.name, prepared.include_usage)
            encode = encoder.chat if chat else encoder.completion
            try:
                async for chunk in encode(self.gateway.events(run, timer)):
                    yield chunk
            finally:  # a client that cancels leaves the generators unclosed: settle here, whatever happened
                await run.abandon()
            self.gateway.metrics.requests.labels(endpoint, "200").inc()

    @map_errors
    async def ChatCompletion(self, request: inference_pb2.ChatCompletionRequest, context: grpc.aio.ServicerContext
                             ) -> AsyncIterator[Message]:
        async for chunk in self._serve(context, CHAT, lambda call: self.gateway.prepare(
                chat_request(request), call), chat=True):
            yield chunk

    @map_errors
    async def Completion(self, request: inference_pb2.CompletionRequest, context: grpc.aio.ServicerContext
                         ) -> AsyncIterator[Message]:
        async for chunk in self._serve(context, COMPLETION,
                                       lambda call: self.gateway.prepare(completion_request(request), call),
                                       chat=False):
            yield chunk

    @map_errors
    async def ListModels(self, request: inference_pb2.ListServedModelsRequest, context: grpc.aio.ServicerContext
                         ) -> inference_pb2.ListServedModelsResponse:
        self.authenticate(context)
        return inference_pb2.ListServedModelsResponse(models=[
            inference_pb2.ModelInfo(id=name, created=created) for name, created in self.gateway.models.names()])
