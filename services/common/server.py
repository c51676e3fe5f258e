"""gRPC server bootstrap: health, reflection, graceful stop on SIGTERM/SIGINT with a grace period.

An internal server listens on its ``Plane``: mutual TLS (callers authorized by role and
administrative calls audited, ``tokenfleet.security.authz``) unless the process runs ``--insecure``.
The gateway's public gRPC API is not on the internal plane: ``public=True`` (callers present API keys).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys
import threading
from collections.abc import Awaitable, Callable, Sequence

import grpc
import structlog
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from prometheus_client import CollectorRegistry, start_http_server

from tokenfleet.security.authz import AuditLog, Authorizer
from tokenfleet.security.identity import IdentityError
from tokenfleet.security.plane import Plane
from tokenfleet.telemetry import tracing
from tokenfleet.telemetry.logging import configure_logging

log = structlog.get_logger()


DEFAULT_MAX_MESSAGE_BYTES = 4 << 20  # gRPC's own default; each service passes what its messages need
# Our clients ping idle connections every 10 s (the gateway's WORKER_CHANNEL_OPTIONS: a partitioned peer is
# noticed). gRPC servers by default refuse pings on a connection without calls and more often than every 5 min:
# after two such pings they send GOAWAY "too_many_pings", the connection drops, and the client doubles its ping
# interval each time, so partitions went unnoticed for longer and longer. Accept them, at up to one per 5 s.
SERVER_KEEPALIVE_OPTIONS = [
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.min_ping_interval_without_data_ms", 5_000),  # the server-side minimum
]


class GrpcServer:
    """One grpc.aio server with the standard services. ``plane`` None: a public server (plaintext, no
    role checks: the gateway's API, whose callers authenticate with API keys)."""

    def __init__(self, service_names: Sequence[str], host: str = "127.0.0.1", port: int = 0,
                 plane: Plane | None = None, audit: AuditLog | None = None,
                 max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES, public_tls: tuple[bytes, bytes] | None = None):
        secure = plane is not None and plane.secure
        self.server = grpc.aio.server(
            options=[("grpc.max_receive_message_length", max_message_bytes), *SERVER_KEEPALIVE_OPTIONS],
            interceptors=[Authorizer(audit or AuditLog())] if secure else None,
        )
        self.health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        self.service_names = list(service_names)
        names = [*self.service_names, health.SERVICE_NAME, reflection.SERVICE_NAME]
        reflection.enable_server_reflection(names, self.server)
        self.stop_requested = asyncio.Event()  # set by SIGTERM/SIGINT or by the service itself (e.g. Drain)
        bind = f"{host}:{port}"
        if plane is not None:
            self.port = plane.add_port(self.server, bind)
        elif public_tls is not None:  # (key, certificate chain): TLS without client certificates
            self.port = self.server.add_secure_port(bind, grpc.ssl_server_credentials([public_tls]))
        else:
            self.port = self.server.add_insecure_port(bind)
        if self.port == 0:
            raise OSError(f"could not bind {host}:{port}")
        self.address = f"{host}:{self.port}"
        self.plane = plane
        self._watch: asyncio.Task | None = None

    async def start(self) -> None:
        await self.server.start()
        if self.plane is not None:  # rotation and expiry, even when idle
            self._watch = self.plane.watch()
        await self._set_status(health_pb2.HealthCheckResponse.SERVING)

    async def _set_status(self, status: int) -> None:
        for name in ["", *self.service_names]:
            await self.health.set(name, status)

    async def run_until_signal(self, on_drain: Callable[[], Awaitable[None]] | None, grace_seconds: float) -> None:
        """Serve until SIGTERM/SIGINT or ``stop_requested``, then: report NOT_SERVING, ``on_drain()``,
        stop with a grace period."""
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.stop_requested.set)
        await self.stop_requested.wait()
        log.info("draining", address=self.address)
        await self._set_status(health_pb2.HealthCheckResponse.NOT_SERVING)
        if on_drain is not None:
            await on_drain()
        _exit_if_stuck(grace_seconds + SHUTDOWN_SLACK_S)
        await self.stop(grace_seconds)

    async def stop(self, grace_seconds: float) -> None:
        """Refuse new calls, let running ones finish for up to ``grace_seconds``, then cancel them."""
        await self._set_status(health_pb2.HealthCheckResponse.NOT_SERVING)
        await self.server.stop(grace_seconds)
        if self._watch is not None:
            self._watch.cancel()
        log.info("stopped", address=self.address)


SHUTDOWN_SLACK_S = 30.0  # after the drain: the grace period plus this much for the service's own cleanup


def _exit_if_stuck(seconds: float) -> None:
    """A watchdog for the end of a service's life: if the process is still here after ``seconds`` (a cleanup that
    hangs: an etcd or gRPC close that never returns), log it and exit with status 1 rather than hang its supervisor.
    It was seen once in a while in CI (a plaintext registry not gone 60 s after SIGTERM); the hang's cause is not
    found yet."""
    def expire() -> None:
        log.error("shutdown did not finish; exiting", seconds=seconds)
        print(f"shutdown did not finish within {seconds:.0f} s; exiting", file=sys.stderr, flush=True)
        os._exit(1)

    timer = threading.Timer(seconds, expire)
    timer.daemon = True
    timer.start()


def serve_metrics(registry: CollectorRegistry, host: str, port: int | None) -> None:
    """Prometheus /metrics on ``port`` (0 = any free port; None = off); prints ``METRICS host:port``."""
    if port is None:
        return
    http_server, _ = start_http_server(port, addr=host, registry=registry)
    print(f"METRICS {host}:{http_server.server_port}", flush=True)


def run_service(name: str, serve: Callable[[argparse.Namespace], Awaitable[None]], args: argparse.Namespace) -> int:
    """A service process's main: JSON logs, traces when turned on (telemetry.tracing), uvloop when installed,
    ``serve(args)`` until it returns."""
    configure_logging(name)
    tracing.setup(name)
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    try:
        asyncio.run(serve(args))
    except IdentityError as e:  # no usable certificate: say so and exit, no traceback
        log.error("cannot start: no usable certificate", error=str(e))
        print(f"{name}: {e}", file=sys.stderr)
        return 2
    return 0
