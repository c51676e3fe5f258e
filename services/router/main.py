"""Router process: follow etcd membership and worker load, answer Pick."""

from __future__ import annotations

import argparse
from collections.abc import Sequence

import structlog
from tokenfleet.services.common.server import GrpcServer, run_service, serve_metrics
from tokenfleet.services.router.fleet import FleetView
from tokenfleet.services.router.servicer import Router

from tokenfleet.cluster.etcd import EtcdClient
from tokenfleet.telemetry.metrics import RouterMetrics
from tokenfleet.v1 import router_pb2, router_pb2_grpc

log = structlog.get_logger()
POLICIES = {"least-loaded": router_pb2.POLICY_LEAST_LOADED, "round-robin": router_pb2.POLICY_ROUND_ROBIN}


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="tokenfleet router", description="tokenfleet router")
    p.add_argument("--etcd", required=True, help="etcd endpoint host:port")
    p.add_argument("--etcd-root", default="/tokenfleet/v1/")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--policy", choices=sorted(POLICIES), default="least-loaded")
    p.add_argument("--grace-seconds", type=float, default=5.0)
    p.add_argument("--metrics-port", type=int, help="serve Prometheus /metrics on this port (0 = any free port)")
    return p.parse_args(argv)


async def serve(args: argparse.Namespace) -> None:
    etcd = EtcdClient(args.etcd, args.etcd_root)
    fleet = FleetView(etcd)
    await fleet.start()
    server = GrpcServer([router_pb2.DESCRIPTOR.services_by_name["RouterService"].full_name], args.host, args.port)
    metrics = RouterMetrics(fleet.metric_rows)
    router_pb2_grpc.add_RouterServiceServicer_to_server(Router(fleet, POLICIES[args.policy], metrics), server.server)
    await server.start()
    log.info("router serving", address=server.address, policy=args.policy)
    serve_metrics(metrics.registry, args.host, args.metrics_port)
    print(f"LISTENING {server.address}", flush=True)

    try:
        await server.run_until_signal(None, args.grace_seconds)
    finally:
        await fleet.stop()
        await etcd.close()


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    return run_service("router", serve, args)
