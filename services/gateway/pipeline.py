"""The gateway's one request pipeline, shared by the OpenAI HTTP API and the public gRPC API:
validate (the transports parse into the pydantic requests) -> prepare (render, tokenize, check
the context; request.py: the one request object, made at this edge) -> admit (the tenant's budget) -> place
(dispatch.py: Pick, Generate, resume) -> events (choices.py turns worker responses into events.py's typed choice
events, which the transports' encoders render).

Who is calling, where the request was placed and the response headers it earned travel in an
explicit ``Call``, not in context variables.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import math
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import structlog
from pydantic import ValidationError
from tokenfleet.services.gateway import events as ev
from tokenfleet.services.gateway.catalog import ModelCatalog, ServedModel
from tokenfleet.services.gateway.choices import FINISH, Translator
from tokenfleet.services.gateway.dispatch import (
    DEFAULT_STALL_TIMEOUT_S,
    NO_SPARE_CAPACITY,
    WORKER_CHANNEL_OPTIONS,
    Dispatcher,
    Job,
    Placement,
)
from tokenfleet.services.gateway.preparer import Preparer
from tokenfleet.services.gateway.request import Edge, Prepared

from tokenfleet.api.chat_template import render_chat
from tokenfleet.api.openai_schema import (
    DEFAULT_RETENTION_WINDOW_S,
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
)
from tokenfleet.api.tools import prepare_messages, tool_format
from tokenfleet.routing.model_router import RouteInput
from tokenfleet.security.plane import Channels, Plane
from tokenfleet.telemetry import tracing
from tokenfleet.telemetry.metrics import GatewayMetrics, RequestTimer
from tokenfleet.telemetry.tracing import Trace
from tokenfleet.tenancy.admission import ANONYMOUS_CALLER, Admission, Caller, Ticket
from tokenfleet.tenancy.tenants import Tenant
from tokenfleet.v1 import common_pb2, engine_pb2

log = structlog.get_logger()
# How long a client waits for its response to start, in seconds: the official openai client sends its timeout as
# x-stainless-read-timeout; other clients may send x-request-timeout. A request is queued (preparation, the worker's
# queue) only while it can still start before then.
DEADLINE_HEADERS = ("x-request-timeout", "x-stainless-read-timeout")
DEFAULT_DEADLINE_S = 600.0  # the official client's default timeout
MAX_DEADLINE_S = 3600.0
# served without retention: "quota-exceeded" (the tenant's retention quota), "unavailable" (the database cannot count it)
RETENTION_HEADER = "x-tokenfleet-retention"


class RetentionLedger(Protocol):
    """Where the tenants' retained transcripts are counted (tokenfleet.responses.store.ResponseStore)."""

    def reserve_retention(self, tenant: str, key: str, tokens: int, seconds: float, quota_tokens: int = 0,
                          request: str = "") -> bool: ...
    def settle_retention(self, tenant: str, key: str, tokens: int, kv_bytes: int, seconds: float = 0.0,
                         request: str = "") -> None: ...
    def abandon_retention(self, tenant: str, key: str, request: str = "") -> None: ...


@dataclass
class Call:
    """One client request as the transports and the pipeline share it."""

    request_id: str
    endpoint: str  # the ledger's and metrics' name for the API (an HTTP path, or grpc:<method>)
    caller: Caller = ANONYMOUS_CALLER
    placement: Placement = field(default_factory=Placement)
    headers: dict[str, str] = field(default_factory=dict)  # response headers earned (rate-limit state)
    admitted: bool = False  # past admission: from here the ticket (or admission's 429) writes the ledger record
    trace: Trace = field(default_factory=Trace)  # the request's span (telemetry.tracing), ended with its stream
    # a batch line (services/gateway/batch_runner.py): placed only on spare capacity, and its ledger record is kept
    # on the ticket for the runner to write with the line's result
    batch_line: bool = False
    ticket: Ticket | None = None  # its admission (set by Gateway.open): a batch line's record is kept on it
    deadline: float | None = None  # time.monotonic() when the client stops waiting for the response to start


@dataclass
class Run:
    """A request placed on a worker whose first response has arrived."""

    prepared: Prepared
    first: engine_pb2.GenerateResponse
    stream: AsyncGenerator[engine_pb2.GenerateResponse, None]
    ticket: Ticket | None = None  # the admitted request's budget reservation, settled when it ends
    usage: common_pb2.Usage = field(default_factory=common_pb2.Usage)  # totals over the samples so far
    trace: Trace = field(default_factory=Trace)
    retention: RetentionLedger | None = None  # where its retention was reserved (settled when it completes)
    retention_key: str = ""

    @property
    def model(self) -> ServedModel:
        return self.prepared.model

    @property
    def request_id(self) -> str:
        return self.prepared.request_id

    @property
    def n(self) -> int:
        return self.prepared.params.n

    @property
    def include_usage(self) -> bool:
        return self.prepared.include_usage

    async def abandon(self) -> None:
        """The response ended without its events being read to the end (or at all: a client gone before
        the first byte): cancel the worker's request and settle the reservation. A no-op after a
        complete run."""
        await self.stream.aclose()
        self.trace.end("the client went away before the stream was read")  # a no-op after a complete run
        await settle(self.ticket, "cancelled", detail="the client went away before the stream was read")


@dataclass
class Gateway:
    routers: Sequence[str]  # router addresses, tried in turn
    models: ModelCatalog
    metrics: GatewayMetrics = field(default_factory=GatewayMetrics)
    draining: bool = False  # set on SIGTERM: /health says so, open streams finish
    max_resumes: int = 2  # a stream whose replica dies is continued elsewhere at most this many times
    stall_timeout: float = DEFAULT_STALL_TIMEOUT_S  # a stream whose worker is silent this long goes elsewhere
    admission: Admission = field(default_factory=Admission)  # API keys, budgets, the ledger
    ttft_objectives: dict[str, float] | None = None  # per tier, as the operator set them (early rejection)
    plane: Plane = field(default_factory=Plane.plaintext)  # the internal plane: router and workers
    preparer: Preparer = field(default_factory=Preparer)  # templating, tokenizing, grammars: off the event loop
    retention_window_s: float = DEFAULT_RETENTION_WINDOW_S  # prompt_cache_retention "in_memory" (--retention-window-s)
    # counts retained transcripts against the tenants' retention quotas (None: no database, no quota)
    retention: RetentionLedger | None = None
    dispatcher: Dispatcher = field(init=False)

    def __post_init__(self) -> None:
        self.dispatcher = Dispatcher(list(self.routers), self.metrics, Channels(self.plane, WORKER_CHANNEL_OPTIONS),
                                     self.max_resumes, stall_timeout=self.stall_timeout)
        if self.ttft_objectives is not None:
            self.dispatcher.ttft_objectives = dict(self.ttft_objectives)

    async def prepare_chat(self, body: ChatCompletionRequest, tenant: Tenant, deadline: float | None = None,
                           client_request_id: str = "") -> Prepared:
        """``tenant``: with the body's ``user``, the conversation's key for an alias's canary split; its tier, a feature
        of the model router's when ``body.model`` is a routing alias; its pinned versions (model name -> ref), applied
        first; its cache group and priority, the request's."""
        fmt = body.response_format.type if body.response_format is not None else "text"
        limit = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        name = self._route(dict(tenant.pins).get(body.model, body.model), RouteInput(
            [(m.role, m.text()) for m in body.messages], tools=body.tool_choice_name != "none",
            json_mode=fmt != "text", tier=tenant.tier, max_tokens=limit or 0))
        model = await self.models.get(name, body.user or tenant.name)
        prepared = await self.preparer.run(self._prepare_chat, model, body, self._edge(tenant, client_request_id),
                                           deadline=deadline)
        prepared.requested_model = body.model if name != body.model else ""
        return prepared

    async def prepare_completion(self, body: CompletionRequest, tenant: Tenant, deadline: float | None = None,
                                 client_request_id: str = "") -> Prepared:
        text = body.prompt if isinstance(body.prompt, str) else ""
        name = self._route(dict(tenant.pins).get(body.model, body.model),
                           RouteInput([("user", text)], tier=tenant.tier, max_tokens=body.max_tokens or 0))
        model = await self.models.get(name, body.user or tenant.name)
        prepared = await self.preparer.run(self._prepare_completion, model, body, self._edge(tenant, client_request_id),
                                           deadline=deadline)
        prepared.requested_model = body.model if name != body.model else ""
        return prepared

    def _edge(self, tenant: Tenant, client_request_id: str) -> Edge:
        return Edge(tenant, client_request_id, self.retention_window_s)

    async def prepare(self, body: ChatCompletionRequest | CompletionRequest, call: Call) -> Prepared:
        """``body`` prepared for ``call``'s tenant: chat or completion by its type. ``call.deadline``: the client's;
        still waiting for a preparation thread then, it is refused."""
        tenant = call.caller.tenant
        if isinstance(body, ChatCompletionRequest):
            return await self.prepare_chat(body, tenant, call.deadline, call.request_id)
        return await self.prepare_completion(body, tenant, call.deadline, call.request_id)

    def _route(self, name: str, request: RouteInput) -> str:
        """The model router: a routing alias's choice for this request (counted in metrics, logged); other names
        as they are."""
        policy = self.models.route_policy(name)
        if policy is None:
            return name
        target, p = policy.choose(request)
        self.metrics.routed.labels(name, target).inc()
        log.info("routed", alias=name, model=target, p_small_agrees=round(p, 3))
        return target

    def _prepare_chat(self, model: ServedModel, body: ChatCompletionRequest, edge: Edge) -> Prepared:
        """In a preparer thread: parameters and grammar, the chat template, the tokens."""
        params = body.sampling_params()
        tools = body.tool_choice_name != "none"
        try:
            messages = [{**m.model_dump(exclude_none=True), "content": m.text()} for m in body.messages]
            functions = [t.model_dump(exclude_none=True) for t in body.tools or []] if tools else None
            messages = prepare_messages(messages, functions, tool_format(model.tool_format))
            prompt = model.tokenizer.encode(render_chat(model.tokenizer, messages))
        except ValueError as e:
            raise APIError(400, str(e), param="messages") from e
        check_context(model, len(prompt), params.max_tokens)
        return Prepared(model, edge.request(model, body, prompt, params, f"chatcmpl-{uuid.uuid4().hex}"),
                        _include_usage(body), tools=tools)

    def _prepare_completion(self, model: ServedModel, body: CompletionRequest, edge: Edge) -> Prepared:
        """In a preparer thread."""
        params = body.sampling_params()
        text = body.prompt if isinstance(body.prompt, str) else None
        prompt = model.tokenizer.encode_prompt(text) if text is not None else list(body.prompt)
        if not prompt:
            raise APIError(400, "prompt must not be empty", param="prompt")
        check_context(model, len(prompt), params.max_tokens)
        echo, added = "", 0
        if body.echo:
            echo = text if text is not None else model.tokenizer.decode(prompt)
            added = model.tokenizer.added_prefix(text) if text is not None else 0
        return Prepared(model, edge.request(model, body, prompt, params, f"cmpl-{uuid.uuid4().hex}"),
                        _include_usage(body), echo=echo, echo_added=added, chat=False)

    async def open(self, call: Call, prepared: Prepared) -> Run:
        """Admit (403, 429), place and wait for the first response: errors before it become proper
        statuses, not a broken stream."""
        model, params, prompt, limit = prepared.model, prepared.params, prepared.prompt, prepared.limit
        call.admitted = True
        call.ticket = None
        # a routed request is allowed by the alias the tenant asked for; its ledger record names both
        ticket = self.admission.admit(call.caller, prepared.requested_model or model.name, call.endpoint,
                                      prepared.request_id, len(prompt), len(prompt) + params.n * limit, call.headers,
                                      defer=call.batch_line)
        call.ticket = ticket
        if prepared.requested_model:
            ticket.model, ticket.requested_model = model.name, prepared.requested_model
        call.trace.event("admitted")
        try:
            key = await self._reserve_retention(call, prepared, len(prompt) + params.n * limit)
        except BaseException as e:  # cancelled while the database counted it: the ticket is settled, never leaked
            call.trace.end(e)
            await settle(ticket, "cancelled", detail=str(e))
            raise
        request = prepared.request if prepared.request.limit == limit else dataclasses.replace(prepared.request, limit=limit)
        job = Job(model.ref, request, call.caller.tenant, call.placement, trace=call.trace,
                  spare_only=call.batch_line, deadline=call.deadline)
        stream = self.dispatcher.generate(job)
        try:
            first = await _first(stream)
        except BaseException as e:
            call.trace.end(e)
            if key:  # it will not run here: its reservation goes (a previous turn's figure comes back)
                await _abandon_retention(self.retention, call.caller.tenant.name, key, prepared.request_id)
            if isinstance(e, APIError) and e.code == NO_SPARE_CAPACITY:  # a batch line that waits: it never ran
                ticket.release()
                raise
            status = ("cancelled" if isinstance(e, asyncio.CancelledError) else
                      "rejected" if isinstance(e, APIError) and e.code == "overloaded" else "failed")
            await settle(ticket, status, detail=str(e))
            # a client's own mistake (400s) says nothing about the version: a rollout must not count it as a failure
            client_error = isinstance(e, APIError) and e.status < 500 and e.code != "overloaded"
            self.metrics.settled(model.ref, "client_error" if client_error else status)
            raise
        return Run(prepared, first, stream, ticket, trace=call.trace, retention=self.retention if key else None,
                   retention_key=key)

    async def _reserve_retention(self, call: Call, prepared: Prepared, tokens: int) -> str:
        """A request that asks the engine to retain its transcript counts against its tenant's retention quota
        first (reserved with the check, so concurrent turns cannot pass it together): over it, the request is
        served without retention (``prepared.request.retention_s`` becomes 0, the RETENTION_HEADER says so). The
        key it was counted under ("": nothing counted)."""
        spec, tenant = prepared.request, call.caller.tenant
        if spec.retention_s <= 0 or self.retention is None:
            return ""
        key = spec.conversation or prepared.request_id
        try:
            if await asyncio.to_thread(self.retention.reserve_retention, tenant.name, key, tokens, spec.retention_s,
                                       tenant.retention_tokens, prepared.request_id):
                return key
            call.headers[RETENTION_HEADER] = "quota-exceeded"
        except Exception as e:  # the database cannot count it (busy, full): served, not retained uncounted
            log.warning("retention not reserved", error=str(e))
            call.headers[RETENTION_HEADER] = "unavailable"
        prepared.request = dataclasses.replace(spec, retention_s=0.0)
        return ""

    async def events(self, run: Run, timer: RequestTimer) -> AsyncIterator[ev.ChoiceEvent]:
        """The run's typed choice events (events.py), ending with ``Ended``; leaving early (client
        gone, error) closes the worker stream, which cancels the request."""
        translator = Translator(run.prepared)
        async with responses_of(run, timer, self.metrics) as responses:  # from the first event on: leaving early settles
            for event in translator.start():
                yield event
            async for r in responses:
                for event in translator.feed(r):
                    yield event
        u = run.usage
        yield ev.Ended(ev.Usage(u.prompt_tokens, u.completion_tokens, u.cached_prompt_tokens))


def request_trace(operation: str, request_id: str, kind: str = "server", attributes: Mapping[str, Any] | None = None
                  ) -> Trace:
    """A request's own span (an HTTP or gRPC request, a batch line), with the attributes each of them carries."""
    return Trace.start(operation, kind, {"gen_ai.operation.name": operation, "gen_ai.system": "tokenfleet",
                                         "tokenfleet.request_id": request_id, **(attributes or {})})


def trace_request(trace: Trace, operation: str, tenant: Tenant, prepared: Prepared, body: Any = None) -> None:
    """The request span's GenAI attributes (and, only when TOKENFLEET_TRACE_CONTENT is on and ``body`` is given,
    the prompt)."""
    params = prepared.params
    trace.rename(f"{operation} {prepared.model.name}")
    trace.set(**{"gen_ai.request.model": prepared.requested_model or prepared.model.name,
                 "gen_ai.request.max_tokens": params.max_tokens, "gen_ai.request.temperature": params.temperature,
                 "gen_ai.request.top_p": params.top_p, "gen_ai.request.choice.count": params.n,
                 "tokenfleet.tenant": tenant.name, "tokenfleet.tier": tenant.tier,
                 "tokenfleet.model_version": prepared.model.ref, "tokenfleet.prompt_tokens": len(prepared.prompt)})
    if body is not None and tracing.record_content():
        dumped = body.model_dump(exclude_none=True)
        trace.event("gen_ai.prompt", content=json.dumps(dumped.get("messages", dumped.get("prompt")), default=str))


def validate_body(schema: type, body: Any) -> Any:
    """A decoded request body as ``schema`` (HTTP and the gRPC API); the first problem is a 400 naming the field."""
    try:
        return schema.model_validate(body)
    except ValidationError as e:
        first = e.errors()[0]
        param = ".".join(str(p) for p in first.get("loc", ()))
        raise APIError(400, f"{param}: {first.get('msg')}", param=param or None) from e


def client_deadline(headers: Mapping[str, str], now: float | None = None) -> float:
    """When the client stops waiting (time.monotonic()): its own timeout header (DEADLINE_HEADERS, seconds, at most
    MAX_DEADLINE_S), else DEFAULT_DEADLINE_S; a header that is not a positive number is ignored."""
    seconds = DEFAULT_DEADLINE_S
    for name in DEADLINE_HEADERS:
        try:
            value = float(headers.get(name) or "nan")
        except ValueError:
            continue
        if math.isfinite(value) and value > 0:
            seconds = min(value, MAX_DEADLINE_S)
            break
    return (time.monotonic() if now is None else now) + seconds


def _include_usage(body: ChatCompletionRequest | CompletionRequest) -> bool:
    return bool(body.stream_options and body.stream_options.include_usage)


def check_context(model: ServedModel, num_prompt: int, max_tokens: int | None) -> None:
    wanted = num_prompt + (max_tokens or 1)
    if wanted > model.max_model_len:
        raise APIError(
            400,
            f"This model's maximum context length is {model.max_model_len} tokens. However, you requested "
            f"{wanted} tokens ({num_prompt} in the prompt, {max_tokens or 1} for the completion).",
            param="messages", code="context_length_exceeded",
        )


async def _first(stream: AsyncGenerator[engine_pb2.GenerateResponse, None]) -> engine_pb2.GenerateResponse:
    try:
        return await stream.__anext__()
    except StopAsyncIteration as e:
        raise APIError(500, "worker closed the stream without a result", "server_error") from e


@contextlib.asynccontextmanager
async def responses_of(run: Run, timer: RequestTimer, metrics: GatewayMetrics | None = None):
    """The whole worker stream, timed and counted; the ticket is settled (billed durably before the
    client can see the end) when the last final arrives, or on the way out when the stream was cut. The
    request's outcome is counted per model version in ``metrics``."""
    usage = run.usage
    produced = finals = 0

    def ttft_ms() -> float | None:
        return 1000 * (timer.first - timer.start) if timer.first is not None else None

    reasons: list[str] = []
    content = tracing.record_content()
    text: list[str] = []

    async def timed() -> AsyncIterator[engine_pb2.GenerateResponse]:
        nonlocal produced, finals
        pending: list[engine_pb2.GenerateResponse] = [run.first]
        async for response in _chain(pending, run.stream):
            if response.HasField("chunk"):
                if not produced and response.chunk.token_ids:
                    run.trace.event("first_token")
                timer.on_chunk(len(response.chunk.token_ids))
                produced += len(response.chunk.token_ids)
                if content:
                    text.append(response.chunk.text)
            elif response.HasField("final"):
                reasons.append(FINISH.get(response.final.finish_reason, "unknown"))
                finals += 1  # the prompt is counted once: the samples share it
                usage.prompt_tokens = response.final.usage.prompt_tokens
                usage.cached_prompt_tokens = response.final.usage.cached_prompt_tokens
                usage.completion_tokens += response.final.usage.completion_tokens
                usage.retained_bytes += response.final.usage.retained_bytes
                if finals == run.n:
                    await settle(run.ticket, "ok", usage.prompt_tokens, usage.cached_prompt_tokens,
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
        run.trace.set(**{"gen_ai.usage.input_tokens": usage.prompt_tokens, "gen_ai.usage.output_tokens": produced,
                         "gen_ai.response.finish_reasons": reasons, "gen_ai.response.model": run.model.name,
                         "tokenfleet.cached_tokens": usage.cached_prompt_tokens})
        if content:
            run.trace.event("gen_ai.choice", content="".join(text))
        run.trace.end(None if finals == run.n else detail)
        if metrics is not None:
            ok = finals == run.n
            metrics.settled(run.model.ref, "ok" if ok else status, timer.ttft_s, timer.tpot_s if ok else None)
            if run.ticket is not None:  # what the ledger bills: the whole usage, or what was produced before the cut
                metrics.charge(run.ticket.caller.tenant.name, run.model.name,
                               usage.prompt_tokens or run.ticket.prompt_tokens, usage.cached_prompt_tokens,
                               usage.completion_tokens if ok else produced)
        await settle(run.ticket, status, completion=produced, ttft_ms=ttft_ms(), detail=detail)  # cut: what was produced
        if run.retention is not None and run.ticket is not None:
            if finals == run.n:
                await _settle_retention(run)
            else:  # cut short: the engine retained nothing for it
                await _abandon_retention(run.retention, run.ticket.caller.tenant.name, run.retention_key,
                                         run.request_id)


async def _settle_retention(run: Run) -> None:
    """The retention a completed run reserved, as the engine reported it (none retained: the figure goes)."""
    assert run.retention is not None and run.ticket is not None
    u = run.usage
    try:
        await asyncio.to_thread(run.retention.settle_retention, run.ticket.caller.tenant.name, run.retention_key,
                                u.prompt_tokens + u.completion_tokens, u.retained_bytes,
                                run.prepared.request.retention_s, run.request_id)
    except Exception as e:  # a busy database: the reservation stands until its window ends
        log.warning("retention not settled", error=str(e))


async def _abandon_retention(ledger: RetentionLedger | None, tenant: str, key: str, request_id: str) -> None:
    if ledger is None:
        return
    try:
        await asyncio.to_thread(ledger.abandon_retention, tenant, key, request_id)
    except Exception as e:  # a busy database: the reservation stands until its window ends
        log.warning("retention reservation not returned", error=str(e))


async def settle(ticket: Ticket | None, status: str, prompt: int | None = None, cached: int = 0, completion: int = 0,
                 ttft_ms: float | None = None, detail: str = "") -> None:
    """The one place a request's ticket is settled: its budget reconciled to what was used and its ledger record
    written, durably (awaited before the client sees the end) for a completed request ("ok"), in the background for
    one that failed, was refused or was cut. ``prompt``: the usage's prompt tokens (default: the admitted prompt's).
    A no-op once settled (the first outcome stands)."""
    if ticket is None or ticket.settled:
        return
    await ticket.finish(status, ticket.prompt_tokens if prompt is None else prompt, cached, completion, ttft_ms,
                        durable=status == "ok", detail=detail)


async def _chain(first: list[engine_pb2.GenerateResponse], rest: AsyncGenerator[engine_pb2.GenerateResponse, None]
                 ) -> AsyncIterator[engine_pb2.GenerateResponse]:
    for response in first:
        yield response
    async for response in rest:
        yield response
