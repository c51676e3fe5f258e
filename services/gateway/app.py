"""The OpenAI-compatible HTTP API over the gateway's pipeline (pipeline.py): parse the body,
authenticate, run the pipeline, render its events with the OpenAI encoder (JSON or SSE)."""

from __future__ import annotations

from typing import Any

import structlog
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.background import BackgroundTask
from tokenfleet.services.gateway.batch_api import add_batch_routes
from tokenfleet.services.gateway.http_body import json_body, peer
from tokenfleet.services.gateway.openai_encoder import OpenAIEncoder
from tokenfleet.services.gateway.pipeline import Call, Gateway, client_deadline, request_trace, trace_request, validate_body
from tokenfleet.services.gateway.responses_api import Responses, add_response_routes

from tokenfleet.api.openai_schema import APIError, ChatCompletionRequest, CompletionRequest
from tokenfleet.batch.store import BatchStore
from tokenfleet.telemetry.metrics import RequestTimer
from tokenfleet.telemetry.request_id import HEADER as REQUEST_ID_HEADER
from tokenfleet.telemetry.request_id import new_request_id

log = structlog.get_logger()
MAX_BODY_BYTES = 4 << 20
# Per route: what a body may hold, counted as it arrives (a chunked body has no Content-Length).
BODY_LIMITS = {"/v1/chat/completions": MAX_BODY_BYTES, "/v1/completions": MAX_BODY_BYTES}
REPLICA_HEADER = "x-tokenfleet-replica"
PREFIX_EXPECTED_HEADER = "x-tokenfleet-prefix-expected"  # prompt tokens the router expected the replica to hold


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


def create_app(gateway: Gateway, api_docs: bool = False, batches: BatchStore | None = None,
               batch_url: str = "", responses: Responses | None = None) -> FastAPI:
    """The API app. ``api_docs``: also serve /openapi.json, /docs and /redoc (off by default: the API
    port is public). /metrics is not here: the gateway serves it on its own port (--metrics-port).
    ``batches``: the batch tier's store (the Files and Batch endpoints answer 404 without one, naming ``batch_url``,
    where the fleet serves it). ``responses``: the Responses API's state (default: no store, so nothing is stored
    and every stored id is unknown)."""
    if api_docs:
        app = FastAPI(title="tokenfleet gateway")
    else:
        app = FastAPI(title="tokenfleet gateway", openapi_url=None, docs_url=None, redoc_url=None)
    app.openapi = lambda: _openapi(app)  # type: ignore[method-assign]

    @app.exception_handler(APIError)
    async def api_error(_: Request, exc: APIError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    @app.exception_handler(RequestValidationError)
    async def bad_parameter(_: Request, exc: RequestValidationError) -> JSONResponse:
        """A query or path parameter of the wrong type (e.g. ``limit=x``): 400 in OpenAI's shape, not FastAPI's 422."""
        first = exc.errors()[0] if exc.errors() else {}
        where = ".".join(str(part) for part in first.get("loc", ())[1:]) or None
        error = APIError(400, f"{where or 'a parameter'}: {first.get('msg', 'invalid')}", param=where)
        return JSONResponse(error.body(), status_code=400)

    @app.middleware("http")
    async def observe(request: Request, call_next):  # type: ignore[no-untyped-def]
        """The request id (bound to the logs, passed to the next hop, echoed back), and the API's
        request metric and log line."""
        request_id = new_request_id(request.headers.get(REQUEST_ID_HEADER))
        request.state.request_id = request_id
        with structlog.contextvars.bound_contextvars(request_id=request_id):
            response = await call_next(request)
            if request.url.path.startswith("/v1/"):
                call = getattr(request.state, "call", None)
                gateway.metrics.requests.labels(route_label(request), str(response.status_code)).inc()
                log.info("http request", path=request.url.path, status=response.status_code,
                         replica=call.placement.replica if call is not None else None)
        response.headers[REQUEST_ID_HEADER] = request_id
        return response

    @app.get("/health")
    async def health() -> JSONResponse:
        status = "draining" if gateway.draining else "ok" if gateway.models.ready else "starting"
        return JSONResponse({"status": status}, status_code=200 if status == "ok" else 503)

    @app.get("/v1/models")
    async def models(request: Request) -> dict[str, Any]:
        gateway.admission.authenticate(request.headers.get("authorization"), peer(request))
        return {"object": "list", "data": [
            {"id": name, "object": "model", "created": created, "owned_by": "tokenfleet",
             **({"tokenfleet": served} if (served := gateway.models.numerics(name)) else {})}
            for name, created in gateway.models.names()]}

    @app.post("/v1/chat/completions", openapi_extra=_json_body(ChatCompletionRequest))
    async def chat(request: Request) -> Response:
        return await _serve(gateway, request, chat=True)

    @app.post("/v1/completions", openapi_extra=_json_body(CompletionRequest))
    async def completions(request: Request) -> Response:
        return await _serve(gateway, request, chat=False)

    add_batch_routes(app, gateway, batches, batch_url)
    add_response_routes(app, responses or Responses(gateway, None), _headers)
    return app


async def _serve(gateway: Gateway, request: Request, chat: bool) -> Response:
    """One API request: caller, body, pipeline, encoder. An error before the response starts is an
    OpenAI error body (and, before admission, a `rejected` ledger record); one after it, inside a
    stream, is the stream's last event."""
    operation = "chat" if chat else "text_completion"  # gen_ai.operation.name
    call = request.state.call = Call(request.state.request_id, request.url.path, trace=request_trace(
        operation, request.state.request_id, attributes={"http.request.method": "POST", "url.path": request.url.path}))
    call.deadline = client_deadline(request.headers)
    timer = RequestTimer(gateway.metrics)
    authenticated = False
    try:
        call.caller = gateway.admission.authenticate(request.headers.get("authorization"), peer(request))
        authenticated = True
        structlog.contextvars.bind_contextvars(tenant=call.caller.tenant.name, key_id=call.caller.key_id)
        gateway.admission.precheck(call.caller, call.request_id, call.endpoint, call.headers)  # cheap checks first
        body = await _parse(request, ChatCompletionRequest if chat else CompletionRequest)
        prepared = await gateway.prepare(body, call)
        trace_request(call.trace, operation, call.caller.tenant, prepared, body)
        run = await gateway.open(call, prepared)
        encoder = OpenAIEncoder.of(prepared)
        events = gateway.events(run, timer)
        if body.stream:
            stream = encoder.chat_stream(events) if chat else encoder.completion_stream(events)
            return StreamingResponse(stream, media_type="text/event-stream", headers=_headers(call),
                                     background=BackgroundTask(run.abandon))  # runs also when the client left
        whole = await (encoder.chat_body(events) if chat else encoder.completion_body(events))
        return JSONResponse(whole, headers=_headers(call))
    except APIError as e:
        if authenticated and not call.admitted:
            gateway.admission.refused(call.caller, call.request_id, call.endpoint, e.status)
        call.trace.set(**{"http.response.status_code": e.status, "error.type": e.code or e.type})
        call.trace.end(e)
        return JSONResponse(e.body(), status_code=e.status, headers=_headers(call, e.headers))
    except BaseException as e:
        call.trace.end(e)
        raise


def route_label(request: Request) -> str:
    """The metric label of a request: its route's template, never the raw path (which callers,
    authenticated or not, could vary without bound)."""
    route = request.scope.get("route")
    return getattr(route, "path", None) or "unmatched"


def _headers(call: Call, own: dict[str, str] | None = None) -> dict[str, str]:
    """The response's headers: its own, the tenant's rate-limit state, and for internal callers
    the replica that served it and the prompt tokens the router expected it to hold (the usage says what it found)."""
    headers = {**call.headers, **(own or {})}
    if call.placement.replica is not None and call.caller.sees_placement:
        headers[REPLICA_HEADER] = call.placement.replica
        if call.placement.expected_cached_tokens is not None:
            headers[PREFIX_EXPECTED_HEADER] = str(call.placement.expected_cached_tokens)
    return headers


async def _parse(request: Request, schema: type) -> Any:
    return validate_body(schema, await json_body(request, BODY_LIMITS.get(request.url.path, MAX_BODY_BYTES)))
