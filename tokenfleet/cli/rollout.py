"""`tokenfleet models rollout`: a canary rollout (cluster.rollout) wired to the registry (the alias's split), the
gateways' /metrics (per-version counters) and etcd (the rollout's record and its operator controls)."""

from __future__ import annotations

import argparse
import asyncio
import json
import shlex
import subprocess
import threading
import urllib.request
from collections.abc import Coroutine
from typing import Any

from tokenfleet.cli.context import add_registry_arguments, cluster_context, registry_stub
from tokenfleet.cluster.rollout import Rollout, RolloutConfig, VersionStats, merge_stats, parse_version_stats
from tokenfleet.services.registry.convert import view_from_snapshot

ROLLOUTS = "rollouts/"
CONTROLS = ("pause", "resume", "abort")


def add_parser(models: Any) -> None:
    p = models.add_parser("rollout", help="move ALIAS to a new version in canary steps, rolling back on a regression")
    p.add_argument("alias")
    p.add_argument("--to", help="NAME@VERSION to roll out (the alias's current target stays the baseline)")
    p.add_argument("--steps", default="0.05,0.25,0.5,1", help="canary weights, increasing, the last usually 1")
    p.add_argument("--step-seconds", type=float, default=60.0, help="how long each weight is held and watched")
    p.add_argument("--min-requests", type=int, default=5, help="canary requests in a step before its errors count")
    p.add_argument("--max-error-increase", type=float, default=0.05, help="canary error rate minus the baseline's")
    p.add_argument("--max-latency-ratio", type=float, default=2.0, help="canary mean TTFT or TPOT over the baseline's")
    p.add_argument("--eval-command", default="", help="run once per step with TOKENFLEET_MODEL=the new version; its "
                   "last output line is a score")
    p.add_argument("--min-eval-score", type=float, help="roll back when the eval command scores below this")
    p.add_argument("--metrics", action="append", default=[], help="a gateway's /metrics host:port (repeat for each "
                   "gateway; default: the `tokenfleet up` cluster's)")
    p.add_argument("--etcd", help="etcd endpoint (default: the `tokenfleet up` cluster's)")
    p.add_argument("--etcd-root", default="/tokenfleet/v1/")
    g = p.add_mutually_exclusive_group()
    for command in CONTROLS:
        g.add_argument(f"--{command}", action="store_true", help=f"{command} the alias's running rollout")
    g.add_argument("--set-weight", type=float, help="manual override: set the canary's weight and hold it (paused)")
    g.add_argument("--status", action="store_true", help="print the alias's rollout record")
    add_registry_arguments(p)
    p.set_defaults(func=run_command)


class _Loop:
    """An event loop in a thread, for the synchronous rollout loop's etcd calls."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, daemon=True).start()

    def __call__(self, coro: Coroutine[Any, Any, Any]) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout=30)


class ClusterIO:
    """RolloutIO over the registry service, the gateways' /metrics and etcd."""

    def __init__(self, args: argparse.Namespace, registry_stub: Any, etcd: Any, run: _Loop, current: str):
        self.args, self.stub, self.etcd, self.run, self.current = args, registry_stub, etcd, run, current

    def _alias(self, target: str, canary: str = "", weight: float = 0.0) -> None:
        from tokenfleet.v1 import registry_pb2

        self.stub.SetAlias(registry_pb2.SetAliasRequest(alias=self.args.alias, target=target, canary=canary,
                                                        canary_weight=weight), timeout=30)

    def set_weight(self, weight: float) -> None:
        self._alias(self.current, self.args.to, weight)

    def promote(self) -> None:
        self._alias(self.args.to)

    def roll_back(self) -> None:
        self._alias(self.current)

    def stats(self) -> dict[str, VersionStats]:
        readings = []
        for address in self.args.metrics:
            with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as response:
                readings.append(parse_version_stats(response.read().decode()))
        return merge_stats(readings)

    def control(self) -> str:
        key = f"{ROLLOUTS}{self.args.alias}/control"
        raw = self.run(self.etcd.get(key))
        if raw is None:
            return ""
        self.run(self.etcd.delete(key))
        return raw.decode()

    def record(self, state: dict[str, Any]) -> None:
        self.run(self.etcd.put(f"{ROLLOUTS}{self.args.alias}", json.dumps(state).encode()))

    def evaluate(self) -> float | None:
        if not self.args.eval_command:
            return None
        import os

        done = subprocess.run(shlex.split(self.args.eval_command), capture_output=True, text=True, timeout=600,
                              env={**os.environ, "TOKENFLEET_MODEL": self.args.to})
        lines = done.stdout.strip().splitlines()
        try:
            return float(lines[-1]) if done.returncode == 0 and lines else None
        except ValueError:
            return None


def run_command(args: argparse.Namespace) -> int:
    from tokenfleet.cluster.etcd import EtcdClient
    from tokenfleet.v1 import registry_pb2

    context = cluster_context(registry=args.registry, etcd=args.etcd, certs=args.certs, insecure=args.insecure)
    endpoint, identity = context.require_etcd(), context.etcd_identity()
    run = _Loop()
    etcd = run(_connect(EtcdClient, endpoint, args.etcd_root, identity))
    if args.status:
        raw = run(etcd.get(f"{ROLLOUTS}{args.alias}"))
        print(raw.decode() if raw else f"no rollout recorded for {args.alias}")
        return 0
    command = next((c for c in CONTROLS if getattr(args, c)), None)
    if command is None and args.set_weight is not None:
        if not 0.0 <= args.set_weight <= 1.0:
            raise ValueError("--set-weight is a share in [0, 1]")
        command = f"weight={args.set_weight}"
    if command is not None:
        run(etcd.put(f"{ROLLOUTS}{args.alias}/control", command.encode()))
        print(f"{args.alias}: {command} sent to its rollout")
        return 0
    if not args.to:
        raise ValueError("give --to NAME@VERSION (or a control: --pause, --resume, --abort, --set-weight, --status)")
    args.metrics = args.metrics or ([context.state["gateway_metrics"]] if context.state.get("gateway_metrics") else [])
    if not args.metrics:
        raise ValueError("give each gateway's --metrics host:port (no `tokenfleet up` cluster to read them from)")
    if args.min_eval_score is not None and not args.eval_command:
        raise ValueError("--min-eval-score needs an --eval-command")
    stub = registry_stub(context)
    view = view_from_snapshot(stub.ListModels(registry_pb2.ListModelsRequest(), timeout=30))
    if args.alias not in view.aliases:
        raise ValueError(f"alias {args.alias!r} does not exist: point it at the current version first")
    # name@version on both sides: the gateways count per version, and a bare name would move with new versions
    current = view.resolve(view.aliases[args.alias]).ref
    args.to = view.resolve(args.to).ref
    if args.to == current:
        raise ValueError(f"{args.alias} already serves {current}")
    config = RolloutConfig(steps=tuple(float(w) for w in args.steps.split(",")), step_seconds=args.step_seconds,
                           min_requests=args.min_requests, max_error_increase=args.max_error_increase,
                           max_latency_ratio=args.max_latency_ratio, min_eval_score=args.min_eval_score)
    run(etcd.delete(f"{ROLLOUTS}{args.alias}/control"))  # a stale control must not steer this rollout
    rollout = Rollout(args.alias, current, args.to, config, ClusterIO(args, stub, etcd, run, current))
    result = rollout.run()
    print(f"{args.alias}: {result} ({rollout.history[-1]['detail']})")
    return 0 if result == "done" else 1


async def _connect(cls: Any, endpoint: str, root: str, identity: Any) -> Any:
    return cls(endpoint, root, identity=identity)
