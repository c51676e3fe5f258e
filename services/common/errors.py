"""The one place where domain exceptions become gRPC status codes."""

from __future__ import annotations

import functools
import inspect
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc
import structlog

from tokenfleet.api.openai_schema import APIError
from tokenfleet.cluster.registry import RegistryConflictError
from tokenfleet.engine.interface import EngineOverloadedError, EngineStoppedError
from tokenfleet.engine.kv_transfer import KVLayoutError, KVTransferError
from tokenfleet.telemetry import tracing
from tokenfleet.telemetry.request_id import from_metadata

log = structlog.get_logger()

_CODES: list[tuple[type[BaseException], grpc.StatusCode]] = [
    (EngineOverloadedError, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (EngineStoppedError, grpc.StatusCode.UNAVAILABLE),
    (RegistryConflictError, grpc.StatusCode.ALREADY_EXISTS),
    (KVLayoutError, grpc.StatusCode.FAILED_PRECONDITION),
    (KVTransferError, grpc.StatusCode.ABORTED),
    (LookupError, grpc.StatusCode.NOT_FOUND),
    (PermissionError, grpc.StatusCode.PERMISSION_DENIED),
    (ValueError, grpc.StatusCode.INVALID_ARGUMENT),
]


_HTTP_STATUS = {400: grpc.StatusCode.INVALID_ARGUMENT, 401: grpc.StatusCode.UNAUTHENTICATED,
                403: grpc.StatusCode.PERMISSION_DENIED, 404: grpc.StatusCode.NOT_FOUND,
                413: grpc.StatusCode.INVALID_ARGUMENT, 429: grpc.StatusCode.RESOURCE_EXHAUSTED,
                501: grpc.StatusCode.UNIMPLEMENTED, 503: grpc.StatusCode.UNAVAILABLE}


def status_for(exc: BaseException) -> grpc.StatusCode:
    if isinstance(exc, APIError):  # the gateway's OpenAI-shaped errors, served over gRPC
        return _HTTP_STATUS.get(exc.status, grpc.StatusCode.INTERNAL)
    for kind, code in _CODES:
        if isinstance(exc, kind):
            return code
    return grpc.StatusCode.INTERNAL


async def _abort(context: grpc.aio.ServicerContext, exc: Exception, method: str) -> None:
    code = status_for(exc)
    if code is grpc.StatusCode.INTERNAL and not isinstance(exc, APIError):
        log.exception("handler failed", method=method)
        await context.abort(code, f"internal error: {type(exc).__name__}")
    if isinstance(exc, APIError) and "retry-after" in exc.headers:  # an overload refusal says when to come back
        context.set_trailing_metadata((("retry-after", exc.headers["retry-after"]),))
    await context.abort(code, str(exc))


def _log_context(request: Any, context: grpc.aio.ServicerContext) -> dict[str, str]:
    """The caller's request id (metadata, else the message's own request_id field) for structlog."""
    request_id = from_metadata(context.invocation_metadata()) or getattr(request, "request_id", "")
    return {"request_id": request_id} if request_id else {}


def _service(servicer: Any) -> str:
    """The proto service a servicer implements (its generated base class: ``EngineServiceServicer`` ->
    ``tokenfleet.v1.EngineService``)."""
    for base in type(servicer).__mro__:
        if base.__name__.endswith("Servicer") and base.__module__.endswith("_pb2_grpc"):
            return f"tokenfleet.v1.{base.__name__[: -len('Servicer')]}"
    return type(servicer).__name__


def _rpc_name(servicer: Any, method: str) -> str:
    return f"{_service(servicer)}/{method}"  # the gRPC semantic conventions' span name


def _rpc_attributes(servicer: Any, method: str) -> dict[str, str]:
    return {"rpc.system": "grpc", "rpc.service": _service(servicer), "rpc.method": method}


def map_errors(handler: Callable[..., Any]) -> Callable[..., Any]:
    """Decorate a servicer method (coroutine or async generator) so exceptions become statuses
    and every log line of the call carries the request id."""
    name = handler.__name__
    if inspect.isasyncgenfunction(handler):

        @functools.wraps(handler)
        async def stream(self: Any, request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            with structlog.contextvars.bound_contextvars(**_log_context(request, context)), \
                    tracing.server_span(_rpc_name(self, name), context.invocation_metadata(),
                                        _rpc_attributes(self, name)) as span:
                try:
                    async for item in handler(self, request, context):
                        yield item
                except grpc.aio.AbortError:  # the handler's own context.abort: its status stands
                    raise
                except Exception as exc:  # noqa: BLE001 - mapped to a status, INTERNAL is logged
                    tracing.record_error(span, exc)
                    await _abort(context, exc, name)

        return stream

    @functools.wraps(handler)
    async def unary(self: Any, request: Any, context: grpc.aio.ServicerContext) -> Any:
        with structlog.contextvars.bound_contextvars(**_log_context(request, context)), \
                tracing.server_span(_rpc_name(self, name), context.invocation_metadata(),
                                    _rpc_attributes(self, name)) as span:
            try:
                return await handler(self, request, context)
            except grpc.aio.AbortError:  # the handler's own context.abort: its status stands
                raise
            except Exception as exc:  # noqa: BLE001
                tracing.record_error(span, exc)
                await _abort(context, exc, name)

    return unary
