"""`tokenfleet autoscale`: the autoscaler as a service (compose or Kubernetes driver), and its operator controls.

    tokenfleet autoscale --etcd etcd:2379 --registry registry:50060 --driver kubernetes \\
        --pool smol/decode=Deployment/decode --min-replicas 1 --max-replicas 8 --target-concurrency 32
    tokenfleet autoscale --pause smol/decode      # also --resume POOL, --set POOL N, --clear POOL, --status POOL

(`tokenfleet up --autoscale` runs the same service on the launcher's own processes.)
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import signal
from typing import Any

from tokenfleet.cli.context import cluster_context
from tokenfleet.cluster.autoscale import Autoscaler, ScalePolicy
from tokenfleet.cluster.autoscale_service import (
    CONTROL,
    DECISIONS,
    AutoscaleMetrics,
    AutoscaleService,
    ComposeDriver,
    KubernetesDriver,
)


def add_parser(sub: Any) -> None:
    p = sub.add_parser("autoscale", help="the autoscaler service (compose / Kubernetes workers), or steer a running one")
    p.add_argument("--etcd", help="etcd endpoint (default: the `tokenfleet up` cluster's)")
    p.add_argument("--etcd-root", default="/tokenfleet/v1/")
    p.add_argument("--registry", help="registry address (models by alias and version)")
    p.add_argument("--driver", choices=["compose", "kubernetes"], default="kubernetes")
    p.add_argument("--pool", action="append", default=[], metavar="POOL=TARGET",
                   help="a pool (MODEL/ROLE, ROLE: both, decode or prefill) and what scales it: a compose service "
                   "name, or KIND/NAME of a Kubernetes Deployment or StatefulSet; repeat per pool")
    p.add_argument("--compose-file", default="compose/docker-compose.yml")
    p.add_argument("--namespace", default="tokenfleet")
    p.add_argument("--min-replicas", type=int, default=1)
    p.add_argument("--max-replicas", type=int, default=4)
    p.add_argument("--max-step", type=int, default=1)
    p.add_argument("--target-concurrency", type=float, default=16.0,
                   help="requests (running + waiting) one replica serves within its objectives (`tokenfleet plan`)")
    p.add_argument("--lead-seconds", type=float, default=60.0, help="how far ahead the trend is projected")
    p.add_argument("--ttft-objective", type=float, default=0.0, help="seconds; a replica whose newcomers would wait "
                   "longer (queued prompt tokens / its prefill rate) adds one (0: off)")
    p.add_argument("--pool-policy", action="append", default=[], metavar="POOL:KEY=VALUE,...",
                   help="a pool's own policy over the defaults above, e.g. prefill and decode pools against their own "
                   "objectives: smol/prefill:ttft_objective=0.5,target_concurrency=8 smol/decode:target_concurrency=64,"
                   "max_replicas=16 (keys: the fields of cluster.autoscale.ScalePolicy)")
    p.add_argument("--interval", type=float, default=5.0)
    p.add_argument("--metrics-port", type=int, help="serve Prometheus /metrics on this port")
    p.add_argument("--certs", help="certificates folder (default: $TOKENFLEET_CERTS, else the `tokenfleet up` cluster's)")
    p.add_argument("--insecure", action="store_true", help="plaintext internal plane")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--pause", metavar="POOL", help="hold POOL at its current count")
    g.add_argument("--resume", metavar="POOL", help="return POOL to the policy")
    g.add_argument("--set", nargs=2, metavar=("POOL", "N"), help="manual override: hold POOL at N replicas")
    g.add_argument("--clear", metavar="POOL", help="drop POOL's pause or override")
    g.add_argument("--status", metavar="POOL", help="print POOL's last decision and its controls")
    p.set_defaults(func=run_command)


def pool_policies(specs: list[str], default: ScalePolicy) -> dict[str, ScalePolicy]:
    """``--pool-policy POOL:KEY=VALUE,...`` -> each pool's policy: the default with those fields replaced (ValueError
    for an unknown field or a bad value)."""
    fields = {f.name: f.type for f in dataclasses.fields(ScalePolicy)}
    out: dict[str, ScalePolicy] = {}
    for spec in specs:
        pool, sep, settings = spec.partition(":")
        if not sep or "/" not in pool or not settings:
            raise ValueError(f"--pool-policy takes MODEL/ROLE:KEY=VALUE,..., got {spec!r}")
        changes: dict[str, Any] = {}
        for item in settings.split(","):
            key, eq, value = item.partition("=")
            if not eq or key not in fields:
                raise ValueError(f"--pool-policy {pool}: {item!r} is not KEY=VALUE with KEY one of {', '.join(fields)}")
            if fields[key] in ("bool", bool):
                if value.lower() not in ("true", "false", "1", "0"):
                    raise ValueError(f"--pool-policy {pool}: {key} takes true or false, got {value!r}")
                changes[key] = value.lower() in ("true", "1")
            else:
                changes[key] = int(value) if fields[key] in ("int", int) else float(value)
        out[pool] = dataclasses.replace(out.get(pool, default), **changes)
    return out


def targets(specs: list[str]) -> dict[str, str]:
    out = {}
    for spec in specs:
        pool, sep, target = spec.partition("=")
        if not sep or "/" not in pool or not target:
            raise ValueError(f"--pool takes MODEL/ROLE=TARGET, got {spec!r}")
        out[pool] = target
    return out


def run_command(args: argparse.Namespace) -> int:
    # --registry has no default here: the fleet view follows the registry only when one is named
    context = cluster_context(etcd=args.etcd, certs=args.certs, insecure=args.insecure)
    endpoint, identity, plane = context.require_etcd(), context.etcd_identity(), context.plane
    control = next(((pool, value) for pool, value in (
        (args.pause, {"paused": True}), (args.resume, {}), (args.clear, {}),
        (args.set[0] if args.set else None, {"replicas": int(args.set[1])} if args.set else {})) if pool), None)
    if control is not None or args.status:
        return asyncio.run(_control(endpoint, args.etcd_root, identity, control, args.status))
    pools = targets(args.pool)
    if not pools:
        raise ValueError("give at least one --pool MODEL/ROLE=TARGET")
    if args.driver == "compose":
        driver: Any = ComposeDriver(args.compose_file, pools)
    else:
        kinds = {}
        for pool, target in pools.items():
            kind, sep, name = target.partition("/")
            if not sep or kind not in ("Deployment", "StatefulSet"):
                raise ValueError(f"a Kubernetes target is Deployment/NAME or StatefulSet/NAME, got {target!r}")
            kinds[pool] = (kind, name)
        driver = KubernetesDriver(kinds, args.namespace)
    policy = ScalePolicy(target_concurrency=args.target_concurrency, min_replicas=args.min_replicas,
                         max_replicas=args.max_replicas, max_step=args.max_step, lead_seconds=args.lead_seconds,
                         ttft_objective=args.ttft_objective)
    scaler = Autoscaler(pool_policies(args.pool_policy, policy), default=policy)
    return asyncio.run(_serve(args, endpoint, identity, plane, driver, scaler, tuple(pools)))


async def _control(endpoint: str, root: str, identity: Any, control: tuple[str, dict] | None, status: str | None) -> int:
    from tokenfleet.cluster.etcd import EtcdClient

    etcd = EtcdClient(endpoint, root, identity=identity)
    try:
        if status:
            decision = await etcd.get(DECISIONS + status)
            controls = await etcd.get(CONTROL + status)
            print(json.dumps({"pool": status, "last_decision": json.loads(decision) if decision else None,
                              "control": json.loads(controls) if controls else {}}, indent=1))
            return 0
        assert control is not None
        pool, value = control
        if value:
            await etcd.put(CONTROL + pool, json.dumps(value).encode())
        else:
            await etcd.delete(CONTROL + pool)
        print(f"{pool}: {value or 'back to the policy'}")
        return 0
    finally:
        await etcd.close()


async def _serve(args: argparse.Namespace, endpoint: str, identity: Any, plane: Any, driver: Any, scaler: Autoscaler,
                 pools: tuple[str, ...]) -> int:
    from prometheus_client import CollectorRegistry, start_http_server

    from tokenfleet.cluster.etcd import EtcdClient
    from tokenfleet.services.router.fleet import FleetView

    registry = CollectorRegistry()
    if args.metrics_port is not None:
        start_http_server(args.metrics_port, "0.0.0.0", registry=registry)
    etcd = EtcdClient(endpoint, args.etcd_root, identity=identity)
    fleet = FleetView(etcd, plane, args.registry)
    await fleet.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    service = AutoscaleService(etcd, fleet, scaler, driver, args.interval, pools,
                               metrics=AutoscaleMetrics(registry))
    try:
        await service.run(stop)
    finally:
        await fleet.stop()
        await etcd.close()
    return 0
