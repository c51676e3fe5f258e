"""Who may call what on the internal plane, and the audit log of administrative calls.

The caller's role is its client certificate's CN (``certs``: CN=<role>, issued by our CA; the TLS
handshake already refused anyone without one). ``POLICY`` maps every internal RPC to the roles
allowed to call it; an RPC missing from it is refused (deny by default, so a new RPC is closed
until someone decides who may call it). Refusals are PERMISSION_DENIED and are audited;
``ADMIN`` calls are audited with their outcome: who (role, certificate serial, peer address), what
(method and request), when.
"""

from __future__ import annotations

import datetime
import inspect
import json
import os
import threading
from collections.abc import Callable, Mapping
from typing import Any

import grpc
import structlog
from cryptography import x509
from google.protobuf import json_format

log = structlog.get_logger()
audit_log = structlog.get_logger("audit")

READERS = frozenset({"gateway", "router", "worker", "operator", "autoscaler"})
EVERYONE = frozenset({"gateway", "router", "registry", "worker", "operator", "autoscaler"})
OPERATORS = frozenset({"operator", "autoscaler"})

POLICY: Mapping[str, frozenset[str]] = {
    # engine workers: gateways place requests, decode workers pull KV from prefill workers
    "/tokenfleet.v1.EngineService/Generate": frozenset({"gateway"}),
    "/tokenfleet.v1.EngineService/Prefill": frozenset({"worker"}),
    "/tokenfleet.v1.EngineService/FetchBlocks": frozenset({"worker"}),
    "/tokenfleet.v1.EngineService/Load": frozenset({"router"}) | OPERATORS,
    "/tokenfleet.v1.EngineService/Abort": OPERATORS,
    "/tokenfleet.v1.EngineService/Release": frozenset({"gateway"}),  # a conversation ended at the gateway
    "/tokenfleet.v1.EngineService/Drain": OPERATORS,
    "/tokenfleet.v1.EngineService/LoadAdapter": OPERATORS,
    "/tokenfleet.v1.RouterService/Pick": frozenset({"gateway"}),
    # the registry: everyone who serves reads it; only operators change it
    "/tokenfleet.v1.RegistryService/GetModel": READERS,
    "/tokenfleet.v1.RegistryService/ListModels": READERS,
    "/tokenfleet.v1.RegistryService/Watch": READERS,
    "/tokenfleet.v1.RegistryService/RegisterModel": frozenset({"operator"}),
    "/tokenfleet.v1.RegistryService/SetAlias": frozenset({"operator"}),
    "/tokenfleet.v1.RegistryService/DeleteAlias": frozenset({"operator"}),
    "/tokenfleet.v1.RegistryService/SetModelStatus": frozenset({"operator"}),
    # the first worker of a version pins what its dtype "auto" resolves to, for the whole fleet
    "/tokenfleet.v1.RegistryService/PinNumerics": frozenset({"worker", "operator"}),
    "/grpc.health.v1.Health/Check": EVERYONE,
    "/grpc.health.v1.Health/Watch": EVERYONE,
    "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo": frozenset({"operator"}),
}
ADMIN = frozenset({
    "/tokenfleet.v1.EngineService/Abort", "/tokenfleet.v1.EngineService/Drain",
    "/tokenfleet.v1.EngineService/LoadAdapter",  # loads a filesystem path into a worker
    "/tokenfleet.v1.RegistryService/RegisterModel", "/tokenfleet.v1.RegistryService/SetAlias",
    "/tokenfleet.v1.RegistryService/DeleteAlias", "/tokenfleet.v1.RegistryService/SetModelStatus",
    "/tokenfleet.v1.RegistryService/PinNumerics",
})


def _first(auth: Mapping[str, list[bytes]], key: str) -> str:
    values = auth.get(key) or [b""]
    return values[0].decode(errors="replace")


def peer_role(context: grpc.aio.ServicerContext) -> str:
    """The caller's role (its certificate's CN), or "" without a verified certificate."""
    return _first(context.auth_context(), "x509_common_name")


def who(context: grpc.aio.ServicerContext) -> dict[str, str]:
    auth = context.auth_context()
    pem = _first(auth, "x509_pem_cert")
    serial = ""
    if pem:
        try:
            serial = f"{x509.load_pem_x509_certificate(pem.encode()).serial_number:x}"
        except ValueError:
            serial = "unreadable"
    return {"role": _first(auth, "x509_common_name"), "serial": serial, "peer": context.peer()}


class AuditLog:
    """Administrative calls and refusals: always to the ``audit`` logger, and appended to ``path``
    (JSON lines, one write per record, so several processes can share the file) when given."""

    def __init__(self, path: str | None = None, service: str = ""):
        self.path = path
        self.service = service
        self._lock = threading.Lock()

    def record(self, context: grpc.aio.ServicerContext, method: str, request: Any, outcome: str) -> None:
        entry = {
            "time": datetime.datetime.now(datetime.UTC).isoformat(timespec="milliseconds"),
            "service": self.service,
            "who": who(context),
            "method": method,
            "request": _summary(request),
            "outcome": outcome,
        }
        audit_log.info("audit", **entry)
        if self.path:
            line = (json.dumps(entry, sort_keys=True) + "\n").encode()
            with self._lock:
                fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
                try:
                    os.write(fd, line)
                finally:
                    os.close(fd)


def _summary(request: Any) -> Any:
    if request is None or not hasattr(request, "DESCRIPTOR"):
        return None
    text = json_format.MessageToDict(request, preserving_proto_field_name=True)
    return text if len(json.dumps(text)) <= 4096 else {"truncated": True}


class Authorizer(grpc.aio.ServerInterceptor):
    """Wraps every method handler: refuse callers whose role ``policy`` does not allow, audit ``admin`` calls."""

    def __init__(self, audit: AuditLog, policy: Mapping[str, frozenset[str]] = POLICY,
                 admin: frozenset[str] = ADMIN):
        self.audit = audit
        self.policy = policy
        self.admin = admin

    async def intercept_service(self, continuation: Callable, details: grpc.HandlerCallDetails) -> Any:
        handler = await continuation(details)
        if handler is None:
            return None
        method = details.method
        return _wrap(handler, _Guard(method, self.policy.get(method, frozenset()), method in self.admin, self.audit))


class _Guard:
    def __init__(self, method: str, allowed: frozenset[str], admin: bool, audit: AuditLog):
        self.method, self.allowed, self.admin, self.audit = method, allowed, admin, audit

    async def check(self, context: grpc.aio.ServicerContext, request: Any) -> None:
        role = peer_role(context)
        if role in self.allowed:
            return
        self.audit.record(context, self.method, request, "denied")
        log.warning("call refused", method=self.method, role=role or None, peer=context.peer())
        await context.abort(grpc.StatusCode.PERMISSION_DENIED,
                            f"role {role or '(none)'!r} may not call {self.method}")

    def done(self, context: grpc.aio.ServicerContext, request: Any, error: BaseException | None) -> None:
        if not self.admin:
            return
        code = context.code() if hasattr(context, "code") else None
        if error is not None:
            outcome = f"error: {type(error).__name__}"
        elif code not in (None, grpc.StatusCode.OK):
            outcome = f"error: {code}"
        else:
            outcome = "ok"
        self.audit.record(context, self.method, request, outcome)


def _wrap(handler: grpc.RpcMethodHandler, guard: _Guard) -> grpc.RpcMethodHandler:
    if handler.unary_unary is not None:
        return grpc.unary_unary_rpc_method_handler(_unary(handler.unary_unary, guard), handler.request_deserializer,
                                                   handler.response_serializer)
    if handler.unary_stream is not None:
        return grpc.unary_stream_rpc_method_handler(_streaming(handler.unary_stream, guard, True),
                                                    handler.request_deserializer, handler.response_serializer)
    if handler.stream_unary is not None:
        return grpc.stream_unary_rpc_method_handler(_unary(handler.stream_unary, guard, unary_request=False),
                                                    handler.request_deserializer, handler.response_serializer)
    return grpc.stream_stream_rpc_method_handler(_streaming(handler.stream_stream, guard, False),
                                                 handler.request_deserializer, handler.response_serializer)


def _unary(behavior: Callable, guard: _Guard, unary_request: bool = True) -> Callable:
    async def call(request: Any, context: grpc.aio.ServicerContext) -> Any:
        shown = request if unary_request else None
        await guard.check(context, shown)
        try:
            response = await behavior(request, context)
        except BaseException as e:
            guard.done(context, shown, e)
            raise
        guard.done(context, shown, None)
        return response

    return call


def _streaming(behavior: Callable, guard: _Guard, unary_request: bool) -> Callable:
    """Async generators stay generators (the servicers'), coroutines that ``context.write`` stay coroutines."""
    if inspect.isasyncgenfunction(behavior):
        async def stream(request: Any, context: grpc.aio.ServicerContext) -> Any:
            await guard.check(context, request if unary_request else None)
            async for response in behavior(request, context):
                yield response

        return stream

    async def write(request: Any, context: grpc.aio.ServicerContext) -> Any:
        await guard.check(context, request if unary_request else None)
        return await behavior(request, context)

    return write
