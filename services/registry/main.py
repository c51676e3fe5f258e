"""Registry process: RegistryService over etcd."""

from __future__ import annotations

import argparse
from collections.abc import Sequence

import structlog
from prometheus_client import CollectorRegistry
from tokenfleet.services.common.server import GrpcServer, run_service, serve_metrics
from tokenfleet.services.registry.servicer import Registry

from tokenfleet.cluster.etcd import EtcdClient
from tokenfleet.security import plane as plane_args
from tokenfleet.security.authz import AuditLog
from tokenfleet.security.plane import Plane
from tokenfleet.telemetry.metrics import RegistryCollector
from tokenfleet.v1 import registry_pb2, registry_pb2_grpc

log = structlog.get_logger()


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="tokenfleet registry", description="tokenfleet model registry")
    p.add_argument("--etcd", required=True, help="etcd endpoint host:port")
    p.add_argument("--etcd-root", default="/tokenfleet/v1/")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--grace-seconds", type=float, default=5.0)
    p.add_argument("--metrics-port", type=int, help="serve Prometheus /metrics on this port (0 = any free port)")
    plane_args.add_arguments(p)
    return p.parse_args(argv)


MAX_MESSAGE_BYTES = 1 << 20  # one model record or alias per request


async def serve(args: argparse.Namespace) -> None:
    metrics = CollectorRegistry()
    plane = Plane.from_args(args, "registry", metrics)
    etcd = EtcdClient(args.etcd, args.etcd_root, identity=plane.identity)
    registry = Registry(etcd)
    await registry.start()
    server = GrpcServer([registry_pb2.DESCRIPTOR.services_by_name["RegistryService"].full_name], args.host, args.port,
                        plane=plane, audit=AuditLog(args.audit_log, "registry"), max_message_bytes=MAX_MESSAGE_BYTES)
    registry_pb2_grpc.add_RegistryServiceServicer_to_server(registry, server.server)
    await server.start()
    log.info("registry serving", address=server.address)
    metrics.register(RegistryCollector(lambda: ([(r.name, r.status) for r in registry.view.models.values()],
                                                len(registry.view.aliases))))
    serve_metrics(metrics, args.host, args.metrics_port)
    print(f"LISTENING {server.address}", flush=True)

    try:
        await server.run_until_signal(None, args.grace_seconds)
    finally:
        await registry.stop()
        await etcd.close()


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    return run_service("registry", serve, args)
