"""OpenAI-compatible HTTP gateway: validate, tokenize, Pick a replica, stream from its Generate."""

from __future__ import annotations

import asyncio
import contextvars
import dataclasses
import json
import time
import uuid
from collections.abc import AsyncGenerator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import structlog
from fastapi import FastAPI, Request
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import ValidationError
from tokenfleet.services.gateway.streams import (
    Started,
    chat_body,
    chat_events,
    completion_body,
    completion_events,
)
from tokenfleet.services.gateway.tenancy import ANONYMOUS, CALLER, HEADERS, Admission

from tokenfleet.api.chat_template import render_chat
from tokenfleet.api.openai_schema import APIError, ChatCompletionRequest, CompletionRequest
from tokenfleet.api.tools import prepare_messages, tool_format
from tokenfleet.cluster.registry import RegistryView, UnknownModelError
from tokenfleet.engine.sampling_params import SamplingParams
from tokenfleet.models.config import ModelConfig
from tokenfleet.models.tokenizer import Tokenizer
from tokenfleet.telemetry.metrics import GatewayMetrics, RequestTimer
from tokenfleet.telemetry.request_id import HEADER as REQUEST_ID_HEADER
from tokenfleet.telemetry.request_id import metadata as request_id_metadata
from tokenfleet.telemetry.request_id import new_request_id
from tokenfleet.tenancy.tenants import Tenant
from tokenfleet.v1 import common_pb2, engine_pb2, engine_pb2_grpc, router_pb2, router_pb2_grpc

log = structlog.get_logger()
MAX_BODY_BYTES = 4 << 20
PICK_TIMEOUT_S = 10.0
MAX_PLACEMENTS = 3  # a request tries at most this many replicas before its first token
RESUME_PICK_WAIT_S = 3.0  # a stream being resumed waits this long for the fleet to show a replica
RETRYABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED)
# How a stream looks when its replica died mid-way (connection reset, RST_STREAM, server gone).
LOST = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL, grpc.StatusCode.ABORTED,
        grpc.StatusCode.CANCELLED)
REPLICA_HEADER = "x-tokenfleet-replica"
# Generous for a CPU development cluster (the serving benchmark's load must pass); set per fleet.
DEFAULT_TTFT_OBJECTIVES = {"interactive": 30.0, "batch": 300.0}
TIER_PRIORITY = {"interactive": common_pb2.PRIORITY_INTERACTIVE, "batch": common_pb2.PRIORITY_BATCH}
# Per HTTP request: where it was placed (a dict shared with the middleware, which sets the header).
PLACEMENT: contextvars.ContextVar[dict[str, str] | None] = contextvars.ContextVar("placement", default=None)


@dataclass
class ServedModel:
    name: str  # what the client asked for; echoed in responses
    ref: str  # what the router is asked for (name@version when registered)
    tokenizer: Tokenizer
    max_model_len: int
    tool_format: str = ""  # tokenfleet.api.tools.FORMATS key; "" = generic


def load_served(name: str, ref: str, tokenizer_dir: str, max_model_len: int = 0, tool_format: str = "") -> ServedModel:
    if not max_model_len:
        max_model_len = ModelConfig.from_dir(tokenizer_dir).max_position_embeddings
    return ServedModel(name, ref, Tokenizer(Path(tokenizer_dir)), max_model_len, tool_format)


@dataclass
class ModelCatalog:
    """The models this gateway serves: a registry view (kept current by a watch) and/or static ones."""

    static: dict[str, ServedModel] = field(default_factory=dict)
    view: RegistryView | None = None  # None: no registry; only static models
    _loaded: dict[str, ServedModel] = field(default_factory=dict)  # by record ref (name@version)

    synced: bool = False  # a registry snapshot has arrived

    @property
    def ready(self) -> bool:
        return self.view is None or self.synced or bool(self.static)

    def names(self) -> list[tuple[str, int]]:
        names = {name: 0 for name in self.static}
        if self.view is not None:
            for name in self.view.names():
                try:
                    names.setdefault(name, int(self.view.resolve(name).created_at))
                except UnknownModelError:
                    continue  # a name whose versions are all disabled
        return sorted(names.items())

    async def get(self, name: str) -> ServedModel:
        if name in self.static:
            return self.static[name]
        try:
            if self.view is None:
                raise UnknownModelError(name)
            record = self.view.resolve(name)
        except UnknownModelError as e:
            raise APIError(404, f"The model `{name}` does not exist.", "invalid_request_error", "model",
                           "model_not_found") from e
        if record.ref not in self._loaded:  # tokenizer loads once per version, off the event loop
            self._loaded[record.ref] = await asyncio.to_thread(
                load_served, name, record.ref, record.tokenizer_path, record.max_model_len, record.tool_format)
        return dataclasses.replace(self._loaded[record.ref], name=name)


@dataclass
class Gateway:
    router_address: str
    models: ModelCatalog
    metrics: GatewayMetrics = field(default_factory=GatewayMetrics)
    draining: bool = False  # set on SIGTERM: /health says so, open streams finish
    max_resumes: int = 2  # a stream whose replica dies is continued elsewhere at most this many times
    admission: Admission = field(default_factory=Admission)  # API keys, budgets, the ledger
    # Early rejection: a worker refuses a request it predicts would wait longer than its tier's objective.
    ttft_objectives: dict[str, float] = field(default_factory=lambda: dict(DEFAULT_TTFT_OBJECTIVES))
    _channels: dict[str, grpc.aio.Channel] = field(default_factory=dict)

    def channel(self, address: str) -> grpc.aio.Channel:
        if address not in self._channels:
            self._channels[address] = grpc.aio.insecure_channel(address)
        return self._channels[address]

    async def model(self, name: str) -> ServedModel:
        return await self.models.get(name)

    async def pick(self, model: str, request_id: str, prompt: Sequence[int], exclude: Sequence[str] = (),
                   colocated: bool = False) -> router_pb2.PickResponse:
        """A placement from the router; it hashes ``prompt`` to find replicas holding its prefix."""
        stub = router_pb2_grpc.RouterServiceStub(self.channel(self.router_address))
        try:
            picked = await stub.Pick(router_pb2.PickRequest(model=model, request_id=request_id,
                                                            num_prompt_tokens=len(prompt), prompt_token_ids=prompt,
                                                            exclude_replica_ids=list(exclude), colocated=colocated),
                                     metadata=_trace_metadata(), timeout=PICK_TIMEOUT_S)
        except grpc.aio.AioRpcError as e:
            if e.code() == grpc.StatusCode.NOT_FOUND:
                raise APIError(404, f"The model `{model}` has no replica.", code="model_not_found", param="model") from e
            raise APIError(503, f"no replica available: {e.details()}", "server_error", code="no_replica") from e
        placement = PLACEMENT.get()
        if placement is not None:
            placement["replica"] = picked.replica_id
        return picked

    async def _pick_for(self, model: ServedModel, request_id: str, prompt: list[int], failed: list[str],
                        resuming: bool) -> router_pb2.PickResponse:
        """A placement; when resuming a stream whose replica was lost, a fleet with no replica right
        now (a lease renewing, a worker restarting) is given up to RESUME_PICK_WAIT_S to show one."""
        deadline = time.monotonic() + (RESUME_PICK_WAIT_S if resuming else 0)
        while True:
            try:
                return await self.pick(model.ref, request_id, prompt, failed, colocated=resuming)
            except APIError as e:
                if e.code != "no_replica" or time.monotonic() >= deadline:
                    raise
                await asyncio.sleep(0.25)

    async def start_chat(self, body: ChatCompletionRequest) -> Started:
        """Validate, render, tokenize, place and open the worker stream (errors before the first
        response become proper statuses, not a broken stream)."""
        model = await self.model(body.model)
        params = body.sampling_params()
        try:
            messages = [{**m.model_dump(exclude_none=True), "content": m.text()} for m in body.messages]
            tools = [t.model_dump(exclude_none=True) for t in body.tools or []] if body.tool_choice_name != "none" else None
            messages = prepare_messages(messages, tools, tool_format(model.tool_format))
            prompt = model.tokenizer.encode(render_chat(model.tokenizer, messages))
        except ValueError as e:
            raise APIError(400, str(e), param="messages") from e
        return await self._start(model, f"chatcmpl-{uuid.uuid4().hex}", prompt, params, body, "chat")

    async def start_completion(self, body: CompletionRequest) -> Started:
        model = await self.model(body.model)
        params = body.sampling_params()
        prompt = model.tokenizer.encode(body.prompt) if isinstance(body.prompt, str) else list(body.prompt)
        if not prompt:
            raise APIError(400, "prompt must not be empty", param="prompt")
        return await self._start(model, f"cmpl-{uuid.uuid4().hex}", prompt, params, body, "completion")

    async def _start(self, model: ServedModel, request_id: str, prompt: list[int], params: SamplingParams,
                     body: ChatCompletionRequest | CompletionRequest, endpoint: str) -> Started:
        check_context(model, len(prompt), params.max_tokens)
        caller = CALLER.get()
        reserve = len(prompt) + params.n * (params.max_tokens or model.max_model_len - len(prompt))
        placement = PLACEMENT.get()
        if placement is not None:
            placement["admission"] = request_id  # from here on the ticket (or admit's 429) writes the ledger record
        ticket = self.admission.admit(caller, model.name, endpoint, request_id, len(prompt), reserve)  # 403, 429
        stream = self.generate(model, request_id, prompt, params, caller.tenant)
        try:
            first = await _first(stream)
        except BaseException as e:
            status = ("cancelled" if isinstance(e, asyncio.CancelledError) else
                      "rejected" if isinstance(e, APIError) and e.code == "overloaded" else "failed")
            await ticket.finish(status, len(prompt), 0, 0, None, durable=False, detail=str(e))
            raise
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        tools = isinstance(body, ChatCompletionRequest) and body.tool_choice_name != "none"
        echo = ""
        if isinstance(body, CompletionRequest) and body.echo:
            echo = body.prompt if isinstance(body.prompt, str) else model.tokenizer.decode(prompt)
        return Started(model, request_id, first, stream, include_usage, params.logprobs is not None, ticket,
                       n=params.n, tools=tools, echo=echo, prompt=prompt if echo else [])

    async def generate(self, model: ServedModel, request_id: str, prompt: list[int], params: SamplingParams,
                       tenant: Tenant = ANONYMOUS) -> AsyncGenerator[engine_pb2.GenerateResponse, None]:
        """The worker's response stream, kept whole across replica failures.

        A replica that fails before its first response (gone, draining, full) is excluded and
        the request placed again, up to MAX_PLACEMENTS times. A replica lost mid-stream is
        excluded too and the request continues on another one, which re-prefills the prompt
        plus the tokens already streamed (``resume``) and streams only what follows, at most
        ``max_resumes`` times; after that the stream ends with an error."""
        failed: list[str] = []  # replicas this request left: refused it, failed before responding, or were lost
        lost_ids: list[str] = []  # of those, lost mid-stream: a resume avoids only these (a refusal is transient)
        delivered: list[int] = []  # output tokens already passed on, and their text
        text = ""
        resumes = 0
        # What the worker allows in all; a request that delivered as much has nothing left to resume.
        limit = model.max_model_len - len(prompt)
        if params.max_tokens is not None:
            limit = min(limit, params.max_tokens)
        last_error: grpc.aio.AioRpcError | None = None
        while True:
            try:
                picked = await self._pick_for(model, request_id, prompt, lost_ids if delivered else failed,
                                              resuming=bool(delivered))
            except APIError as e:
                refused = last_error is not None and last_error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                if refused and e.code == "no_replica" and last_error is not None:  # every replica refused: say why
                    raise _status_error(last_error) from e
                raise
            stub = engine_pb2_grpc.EngineServiceStub(self.channel(picked.address))
            request = engine_pb2.GenerateRequest(request_id=request_id, prompt_token_ids=prompt, sampling=to_proto(params),
                                                 tenant=tenant.name, priority=TIER_PRIORITY[tenant.tier])
            if delivered:
                request.resume.output_token_ids.extend(delivered)
                request.resume.text = text
                log.warning("resuming the stream on another replica", replica=picked.replica_id, lost=failed,
                            tokens_delivered=len(delivered), resume=resumes)
            else:
                request.ttft_objective_ms = int(1000 * self.ttft_objectives.get(tenant.tier, 0))
                if picked.prefill_address:
                    request.prefill.replica_id = picked.prefill_replica_id
                    request.prefill.address = picked.prefill_address
            call = stub.Generate(request, metadata=_trace_metadata())
            responded = finished = False
            finals = 0
            try:
                async for response in call:
                    if response.HasField("error"):
                        raise APIError(500, response.error.message, "server_error")
                    responded = True
                    if response.HasField("chunk"):
                        delivered.extend(response.chunk.token_ids)
                        text += response.chunk.text
                    finals += response.HasField("final")
                    finished = finals >= params.n  # n > 1: every sample's final
                    yield response
                if not finished:  # e.g. a worker that predates n > 1 and sent one final
                    raise APIError(503, f"the worker's stream ended with {finals} of {params.n} results",
                                   "server_error", code="incomplete")
                return
            except grpc.aio.AioRpcError as e:
                # Our own cancel (client gone) surfaces as CancelledError/GeneratorExit, never here.
                if finished:  # the result arrived; only the call's end was lost
                    return
                lost = responded and e.code() in LOST
                if not responded and e.code() in RETRYABLE and len(failed) + 1 < MAX_PLACEMENTS:
                    log.warning("replica failed before responding; placing again", replica=picked.replica_id,
                                code=e.code().name, details=e.details())
                elif lost and params.n == 1 and resumes < self.max_resumes and len(delivered) < limit:
                    resumes += 1
                    self.metrics.resumes.labels("ok").inc()
                    log.warning("replica lost mid-stream; continuing on another", replica=picked.replica_id,
                                code=e.code().name, details=e.details(), tokens_delivered=len(delivered),
                                resume=resumes, excluded=[*failed, picked.replica_id])
                elif lost:
                    log.warning("replica lost mid-stream; not resuming", replica=picked.replica_id,
                                code=e.code().name, details=e.details(), tokens_delivered=len(delivered),
                                resumes=resumes, max_resumes=self.max_resumes)
                    if len(delivered) >= limit:  # every token delivered, only the final lost: nothing to continue
                        raise APIError(503, f"the request's replica was lost after its last token: {e.details()}",
                                       "server_error", code="replica_lost") from e
                    self.metrics.resumes.labels("exhausted").inc()
                    raise APIError(503, f"the request's replica was lost mid-stream {resumes + 1} time(s); "
                                   f"gave up after {resumes} resume(s): {e.details()}", "server_error",
                                   code="replica_lost") from e
                else:
                    raise _status_error(e) from e
                failed.append(picked.replica_id)
                if lost:
                    lost_ids.append(picked.replica_id)
                last_error = e
            finally:
                call.cancel()  # no-op when finished; aborts the request when the client went away


def _trace_metadata() -> tuple[tuple[str, str], ...]:
    """The client request's id (bound by the HTTP middleware) for the next hop."""
    request_id = structlog.contextvars.get_contextvars().get("request_id")
    return request_id_metadata(request_id) if request_id else ()


def _status_error(e: grpc.aio.AioRpcError) -> APIError:
    code = e.code()
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        return APIError(400, e.details() or "invalid request")
    if code in (grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.UNAVAILABLE):
        return APIError(503, f"overloaded: {e.details()}", "server_error", code="overloaded",
                        headers={"retry-after": "2"})
    return APIError(500, f"worker error: {e.details()}", "server_error")


def to_proto(p: SamplingParams) -> common_pb2.SamplingParams:
    msg = common_pb2.SamplingParams(
        temperature=p.temperature, top_p=p.top_p, top_k=max(p.top_k, 0), min_p=p.min_p,
        presence_penalty=p.presence_penalty, frequency_penalty=p.frequency_penalty,
        repetition_penalty=p.repetition_penalty, stop=list(p.stop), ignore_eos=p.ignore_eos, min_tokens=p.min_tokens,
    )
    if p.max_tokens is not None:
        msg.max_tokens = p.max_tokens
    if p.seed is not None:
        msg.seed = p.seed
    if p.logprobs is not None:
        msg.logprobs = p.logprobs
    if p.n != 1:
        msg.n = p.n
    if p.prompt_logprobs is not None:
        msg.prompt_logprobs = p.prompt_logprobs
    msg.logit_bias.update(dict(p.logit_bias))
    if p.guided is not None:
        if p.guided.kind == "json_object":
            msg.guided.json_object = True
        else:
            setattr(msg.guided, p.guided.kind, p.guided.spec)
    return msg


def check_context(model: ServedModel, num_prompt: int, max_tokens: int | None) -> None:
    wanted = num_prompt + (max_tokens or 1)
    if wanted > model.max_model_len:
        raise APIError(
            400,
            f"This model's maximum context length is {model.max_model_len} tokens. However, you requested "
            f"{wanted} tokens ({num_prompt} in the prompt, {max_tokens or 1} for the completion).",
            param="messages", code="context_length_exceeded",
        )


def _json_body(schema: type) -> dict[str, Any]:
    """The OpenAPI request body of a route that parses its JSON itself (for clients and fuzzers)."""
    ref = {"$ref": f"#/components/schemas/{schema.__name__}"}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": ref}}}}


def _openapi(app: FastAPI) -> dict[str, Any]:
    if app.openapi_schema is None:
        schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
        components = schema.setdefault("components", {}).setdefault("schemas", {})
        for model in (ChatCompletionRequest, CompletionRequest):
            body = model.model_json_schema(ref_template="#/components/schemas/{model}")
            components.update(body.pop("$defs", {}))
            components[model.__name__] = body
        app.openapi_schema = schema
    return app.openapi_schema


def create_app(gateway: Gateway) -> FastAPI:
    app = FastAPI(title="tokenfleet gateway")
    app.openapi = lambda: _openapi(app)  # type: ignore[method-assign]

    @app.exception_handler(APIError)
    async def api_error(_: Request, exc: APIError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    @app.middleware("http")
    async def limit_body(request: Request, call_next):  # type: ignore[no-untyped-def]
        length = request.headers.get("content-length")
        if length is not None and int(length) > MAX_BODY_BYTES:
            return JSONResponse(APIError(413, f"request body over {MAX_BODY_BYTES} bytes").body(), status_code=413)
        return await call_next(request)

    @app.middleware("http")
    async def count_requests(request: Request, call_next):  # type: ignore[no-untyped-def]
        request_id = new_request_id(request.headers.get(REQUEST_ID_HEADER))
        placement: dict[str, str] = {}
        headers: dict[str, str] = {}
        tokens = PLACEMENT.set(placement), HEADERS.set(headers)
        try:
            with structlog.contextvars.bound_contextvars(request_id=request_id):
                if request.url.path.startswith("/v1/"):
                    try:
                        caller = gateway.admission.authenticate(request.headers.get("authorization"))
                    except APIError as e:
                        gateway.metrics.requests.labels(request.url.path, "401").inc()
                        response = JSONResponse(e.body(), status_code=e.status)
                        response.headers[REQUEST_ID_HEADER] = request_id
                        return response
                    CALLER.set(caller)
                    structlog.contextvars.bind_contextvars(tenant=caller.tenant.name, key_id=caller.key_id)
                response = await call_next(request)
                if request.url.path.startswith("/v1/"):
                    if response.status_code >= 400 and "admission" not in placement and request.method == "POST":
                        gateway.admission.refused(CALLER.get(), request_id, request.url.path, response.status_code)
                    gateway.metrics.requests.labels(request.url.path, str(response.status_code)).inc()
                    log.info("http request", path=request.url.path, status=response.status_code,
                             replica=placement.get("replica"))
        finally:
            PLACEMENT.reset(tokens[0])
            HEADERS.reset(tokens[1])
        response.headers[REQUEST_ID_HEADER] = request_id
        for name, value in headers.items():
            response.headers.setdefault(name, value)
        if "replica" in placement:
            response.headers[REPLICA_HEADER] = placement["replica"]
        return response

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(gateway.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/health")
    async def health() -> JSONResponse:
        status = "draining" if gateway.draining else "ok" if gateway.models.ready else "starting"
        return JSONResponse({"status": status}, status_code=200 if status == "ok" else 503)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [
            {"id": name, "object": "model", "created": created, "owned_by": "tokenfleet"}
            for name, created in gateway.models.names()]}

    @app.post("/v1/chat/completions", openapi_extra=_json_body(ChatCompletionRequest))
    async def chat(request: Request):  # type: ignore[no-untyped-def]
        timer = RequestTimer(gateway.metrics)
        body = await _parse(request, ChatCompletionRequest)
        run = await gateway.start_chat(body)
        if body.stream:
            return StreamingResponse(chat_events(run, timer), media_type="text/event-stream")
        return await chat_body(run, timer)

    @app.post("/v1/completions", openapi_extra=_json_body(CompletionRequest))
    async def completions(request: Request):  # type: ignore[no-untyped-def]
        timer = RequestTimer(gateway.metrics)
        body = await _parse(request, CompletionRequest)
        run = await gateway.start_completion(body)
        if body.stream:
            return StreamingResponse(completion_events(run, timer), media_type="text/event-stream")
        return await completion_body(run, timer)

    return app


async def _parse(request: Request, schema: type) -> Any:
    raw = await request.body()
    try:
        body = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as e:
        raise APIError(400, f"request body is not valid UTF-8 (byte {e.start})") from e
    except json.JSONDecodeError as e:
        raise APIError(400, f"request body is not valid JSON: {e}") from e
    if not isinstance(body, dict):
        raise APIError(400, f"request body must be a JSON object, got {type(body).__name__}")
    return validate_body(schema, body)


def validate_body(schema: type, body: Any) -> Any:
    """A decoded request body as ``schema`` (HTTP and the gRPC API); the first problem is a 400 naming the field."""
    try:
        return schema.model_validate(body)
    except ValidationError as e:
        first = e.errors()[0]
        param = ".".join(str(p) for p in first.get("loc", ()))
        raise APIError(400, f"{param}: {first.get('msg')}", param=param or None) from e


async def _first(stream: AsyncGenerator[engine_pb2.GenerateResponse, None]) -> engine_pb2.GenerateResponse:
    try:
        return await stream.__anext__()
    except StopAsyncIteration as e:
        raise APIError(500, "worker closed the stream without a result", "server_error") from e
