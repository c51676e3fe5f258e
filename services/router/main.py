"""Router process: follow etcd membership and worker load, answer Pick."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
from collections.abc import Sequence

import structlog
from prometheus_client import CollectorRegistry
from tokenfleet.services.common.server import GrpcServer, run_service, serve_metrics
from tokenfleet.services.router.fleet import FleetView
from tokenfleet.services.router.servicer import Router

from tokenfleet.cluster.affinity import DEFAULT_TTL, AffinityMap
from tokenfleet.cluster.etcd import EtcdClient
from tokenfleet.routing.conversations import ConversationConfig, ConversationHomes
from tokenfleet.routing.placement import DisaggConfig
from tokenfleet.routing.prefix import PrefixPolicyConfig
from tokenfleet.security import plane as plane_args
from tokenfleet.security.authz import AuditLog
from tokenfleet.security.plane import Plane
from tokenfleet.telemetry.metrics import RouterMetrics
from tokenfleet.v1 import router_pb2, router_pb2_grpc

log = structlog.get_logger()
POLICIES = {"prefix-aware": router_pb2.POLICY_PREFIX_AWARE, "least-loaded": router_pb2.POLICY_LEAST_LOADED,
            "round-robin": router_pb2.POLICY_ROUND_ROBIN}


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="tokenfleet router", description="tokenfleet router")
    p.add_argument("--etcd", required=True, help="etcd endpoint host:port")
    p.add_argument("--etcd-root", default="/tokenfleet/v1/")
    p.add_argument("--registry", help="registry address host:port: resolve model names, aliases and name@version "
                   "through the registry service. Without it, only unregistered models, served by name")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--policy", choices=sorted(POLICIES), default="prefix-aware")
    p.add_argument("--min-match-blocks", type=int, default=PrefixPolicyConfig.min_match_blocks,
                   help="prefix matches shorter than this many KV blocks are ignored (one short shared "
                   "system prompt does not pin traffic)")
    p.add_argument("--load-slack", type=float, default=PrefixPolicyConfig.load_slack,
                   help="stay on the replica holding a prefix until its load exceeds (1 + this) x the pool mean")
    p.add_argument("--spill-floor", type=int, default=PrefixPolicyConfig.spill_floor,
                   help="a replica with fewer requests than this is never too loaded to keep its prefixes' traffic")
    p.add_argument("--disagg-min-tokens", type=int, default=DisaggConfig.min_uncached_tokens,
                   help="a decode-only replica gets a separate prefill replica only for prompts with at least "
                   "this many tokens it does not hold")
    p.add_argument("--tier-block-value", type=float, default=PrefixPolicyConfig.tier_block_value,
                   help="a block in a replica's second tier, relative to one in its pool (1) and a recompute (0)")
    p.add_argument("--peer-block-value", type=float, default=PrefixPolicyConfig.peer_block_value,
                   help="a block the picked replica can fetch from a peer, on the same scale")
    p.add_argument("--peer-min-blocks", type=int, default=PrefixPolicyConfig.peer_min_blocks,
                   help="name a peer only when it holds at least this many more of the prompt's leading blocks")
    p.add_argument("--no-peer-fetch", action="store_true", help="never name a peer holding more of a prompt's "
                   "prefix than the picked replica (that replica then recomputes it)")
    p.add_argument("--affinity-ttl", type=int, default=DEFAULT_TTL,
                   help="seconds an affinity entry lives in etcd after its last write")
    p.add_argument("--conversation-ttl", type=float, default=ConversationConfig.ttl_s,
                   help="seconds the router remembers where a conversation was served last, after its last turn")
    p.add_argument("--conversation-max", type=int, default=ConversationConfig.max_entries,
                   help="conversations remembered at most (the least recently served are forgotten first)")
    p.add_argument("--batch-slots", type=int, default=8, help="batch work (the gateway's batch tier) goes only to "
                   "a replica with nothing waiting and fewer than this many requests running")
    p.add_argument("--grace-seconds", type=float, default=5.0)
    p.add_argument("--metrics-port", type=int, help="serve Prometheus /metrics on this port (0 = any free port)")
    plane_args.add_arguments(p)
    return p.parse_args(argv)


MAX_MESSAGE_BYTES = 4 << 20  # a Pick carries the prompt's token ids (5 bytes each at most: 800k tokens)


async def serve(args: argparse.Namespace) -> None:
    registry = CollectorRegistry()
    plane = Plane.from_args(args, "router", registry)
    etcd = EtcdClient(args.etcd, args.etcd_root, identity=plane.identity)
    fleet = FleetView(etcd, plane, args.registry)
    await fleet.start()
    affinity = AffinityMap(etcd, args.affinity_ttl)
    await affinity.start()
    with contextlib.suppress(TimeoutError):  # route by the recorded affinity from the first Pick on
        await asyncio.wait_for(affinity.synced.wait(), timeout=5)
    prefix = PrefixPolicyConfig(min_match_blocks=args.min_match_blocks, load_slack=args.load_slack,
                                spill_floor=args.spill_floor, tier_block_value=args.tier_block_value,
                                peer_block_value=0.0 if args.no_peer_fetch else args.peer_block_value,
                                peer_min_blocks=args.peer_min_blocks)
    server = GrpcServer([router_pb2.DESCRIPTOR.services_by_name["RouterService"].full_name], args.host, args.port,
                        plane=plane, audit=AuditLog(args.audit_log, "router"), max_message_bytes=MAX_MESSAGE_BYTES)
    metrics = RouterMetrics(fleet.metric_rows, registry)
    router = Router(fleet, POLICIES[args.policy], metrics, affinity, prefix, DisaggConfig(args.disagg_min_tokens),
                    peer_fetch=not args.no_peer_fetch, batch_slots=args.batch_slots,
                    conversations=ConversationHomes(ConversationConfig(args.conversation_ttl, args.conversation_max)))
    router_pb2_grpc.add_RouterServiceServicer_to_server(router, server.server)
    await server.start()
    log.info("router serving", address=server.address, policy=args.policy)
    serve_metrics(metrics.registry, args.host, args.metrics_port)
    print(f"LISTENING {server.address}", flush=True)

    try:
        await server.run_until_signal(None, args.grace_seconds)
    finally:
        await affinity.stop()
        await fleet.stop()
        await etcd.close()


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    return run_service("router", serve, args)
