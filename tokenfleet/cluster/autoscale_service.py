"""The autoscaler service: one active instance (an etcd election), the fleet's load in, replica counts out.

Every ``interval`` seconds, for each pool (a model's workers of one role: ``smol/both``, ``smol/decode``...):
1. Read the pool's load from the workers' Load streams, through the router's ``FleetView``: serving replicas,
   running and waiting requests, and the fullest replica's KV usage.
2. Ask ``autoscale.Autoscaler`` for the desired count.
3. Apply it through a driver:
   - ``LocalDriver``: the `tokenfleet up` process's own workers;
   - ``ComposeDriver``: `docker compose up --scale`;
   - ``KubernetesDriver``: the scale subresource of a Deployment.
4. Record the decision and its reasons in etcd (``autoscale/decisions/<model>/<role>``), the log and Prometheus
   gauges.

Operators steer it through etcd: ``autoscale/control/<model>/<role>`` holds ``{"paused": true}`` or
``{"replicas": n}`` (`tokenfleet autoscale --pause/--resume/--set POOL N`).

Scale-down drops nothing. The driver picks the least-loaded replica. It takes it out of supervision and drains
it (Drain: no new picks; open streams finish), then stops it.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import itertools
import json
import os
import signal
import socket
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import structlog

from tokenfleet.cluster.autoscale import Autoscaler, Decision, Sample
from tokenfleet.cluster.etcd import ETCD_ERRORS, EtcdClient

log = structlog.get_logger("tokenfleet.autoscale")

LEADER_KEY = "autoscale/leader"
DECISIONS = "autoscale/decisions/"
CONTROL = "autoscale/control/"


@dataclass(frozen=True)
class PoolReplica:
    replica_id: str
    address: str
    running: int
    waiting: int
    ttft_recent: float = 0.0
    prefill_wait: float = 0.0
    kv_usage: float = 0.0


class Driver(Protocol):
    def starting(self, pool: str) -> int:
        """Replicas started for ``pool`` that do not serve yet."""

    async def scale(self, pool: str, desired: int, serving: Sequence[PoolReplica]) -> None:
        """Bring ``pool`` to ``desired`` replicas (``serving``: the ones the fleet sees now)."""


def pool_of(model: str, roles: Sequence[str]) -> str:
    role = "both" if {"decode", "prefill"} <= set(roles) else (roles[0] if roles else "decode")
    return f"{model}/{role}"


class AutoscaleService:
    def __init__(self, etcd: EtcdClient, fleet: Any, scaler: Autoscaler, driver: Driver, interval: float = 2.0,
                 pools: Sequence[str] = (), leader_ttl: int = 10, name: str = "", metrics: Any = None):
        self.etcd, self.fleet, self.scaler, self.driver = etcd, fleet, scaler, driver
        self.interval = interval
        self.pools = tuple(pools)  # pools to manage ("" = every pool the fleet shows)
        self.leader_ttl = leader_ttl
        self.name = name or f"{socket.gethostname()}-{id(self):x}"
        self.metrics = metrics
        self.history: dict[str, collections.deque[Sample]] = collections.defaultdict(lambda: collections.deque(maxlen=600))
        self.decisions: list[tuple[float, Decision]] = []  # (when, decision) of every change, for reports
        self.timeline: list[tuple[float, str, int, int]] = []  # (when, pool, serving, starting) every tick
        self._scaling: dict[str, asyncio.Task] = {}

    async def run(self, stop: asyncio.Event) -> None:
        """Campaign for leadership, then scale until ``stop``; leadership lost (lease gone) -> campaign again."""
        while not stop.is_set():
            lease = await self._campaign(stop)
            if lease is None:
                return
            log.info("autoscaler leading", name=self.name)
            keeper = asyncio.ensure_future(self._keep(lease))
            try:
                while not stop.is_set() and not keeper.done():
                    await self.tick()
                    with contextlib.suppress(asyncio.TimeoutError):
                        await asyncio.wait_for(stop.wait(), self.interval)
            finally:
                keeper.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await keeper
                await self.etcd.revoke_lease(lease)

    async def _campaign(self, stop: asyncio.Event) -> int | None:
        while not stop.is_set():
            try:
                lease = await self.etcd.grant_lease(self.leader_ttl)
                if await self.etcd.put_if_absent(LEADER_KEY, self.name.encode(), lease):
                    return lease
                await self.etcd.revoke_lease(lease)
            except ETCD_ERRORS as e:
                log.warning("autoscaler election failed", error=str(e))
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(stop.wait(), self.leader_ttl / 2)
        return None

    async def _keep(self, lease: int) -> None:
        while True:
            await asyncio.sleep(self.leader_ttl / 3)
            try:
                if await self.etcd.refresh_lease(lease) <= 0:
                    log.warning("autoscaler lost its lease")
                    return
            except ETCD_ERRORS as e:
                log.warning("autoscaler lease refresh failed", error=str(e))

    def pool_replicas(self) -> dict[str, list[PoolReplica]]:
        pools: dict[str, list[PoolReplica]] = collections.defaultdict(list)
        for replica in list(self.fleet.replicas.values()):
            load = replica.load
            if load.state != "serving":
                continue
            pools[pool_of(replica.model, load.roles)].append(PoolReplica(
                load.replica_id, load.address, load.num_running, load.num_waiting, load.ttft_ms_recent / 1000,
                load.prefill_wait_s, load.kv_utilization))
        return pools

    async def tick(self) -> list[Decision]:
        now = time.monotonic()
        serving = self.pool_replicas()
        names = self.pools or tuple(sorted(serving))
        out = []
        for pool in names:
            replicas = serving.get(pool, [])
            await self._control(pool)
            sample = Sample(now, len(replicas), sum(r.running for r in replicas), sum(r.waiting for r in replicas),
                            max((r.kv_usage for r in replicas), default=0.0), self.driver.starting(pool),
                            max((r.ttft_recent for r in replicas), default=0.0),
                            max((r.prefill_wait for r in replicas), default=0.0))
            self.history[pool].append(sample)
            self.timeline.append((now, pool, sample.replicas, sample.starting))
            if pool in self._scaling and not self._scaling[pool].done():
                continue  # the last change is still under way
            decision = self.scaler.decide(pool, list(self.history[pool]), now)
            out.append(decision)
            if self.metrics is not None:
                self.metrics.observe(decision, sample, len(getattr(self.driver, "standby", ())))
            if decision.delta:
                self.decisions.append((now, decision))
                log.info("autoscale", pool=pool, current=decision.current, desired=decision.desired,
                         reasons=list(decision.reasons))
                await self._record(pool, decision)
                self._scaling[pool] = asyncio.ensure_future(self.driver.scale(pool, decision.desired, replicas))
        return out

    async def _control(self, pool: str) -> None:
        try:
            raw = await self.etcd.get(CONTROL + pool)
        except ETCD_ERRORS:
            return
        control = json.loads(raw) if raw else {}
        self.scaler.pause(pool, bool(control.get("paused")))
        self.scaler.override(pool, int(control["replicas"]) if "replicas" in control else None)

    async def _record(self, pool: str, decision: Decision) -> None:
        value = json.dumps({"when": time.time(), "current": decision.current, "desired": decision.desired,
                            "reasons": list(decision.reasons), "by": self.name}).encode()
        with contextlib.suppress(*ETCD_ERRORS):
            await self.etcd.put(DECISIONS + pool, value)


class AutoscaleMetrics:
    def __init__(self, registry: Any = None):
        from prometheus_client import Counter, Gauge

        self.desired = Gauge("tokenfleet_autoscaler_desired_replicas", "Replicas the autoscaler wants", ["pool"],
                             registry=registry)
        self.serving = Gauge("tokenfleet_autoscaler_serving_replicas", "Serving replicas it sees", ["pool"],
                             registry=registry)
        self.demand = Gauge("tokenfleet_autoscaler_demand", "Running + waiting requests", ["pool"], registry=registry)
        self.standby = Gauge("tokenfleet_autoscaler_standby_replicas", "Warm-pool replicas (loaded, not serving)",
                             ["pool"], registry=registry)
        self.changes = Counter("tokenfleet_autoscaler_changes", "Scale decisions by direction", ["pool", "direction"],
                               registry=registry)

    def observe(self, decision: Decision, sample: Sample, standby: int = 0) -> None:
        self.desired.labels(decision.pool).set(decision.desired)
        self.standby.labels(decision.pool).set(standby)
        self.serving.labels(decision.pool).set(sample.replicas)
        self.demand.labels(decision.pool).set(sample.demand)
        if decision.delta:
            self.changes.labels(decision.pool, "up" if decision.delta > 0 else "down").inc()


class LocalDriver:
    """`tokenfleet up --autoscale`: starts workers like the first one (each on its own port, its own replica id) and
    drains then stops them. ``cluster``: the launcher's ``Cluster``; ``template``: the worker name to copy.

    Warm pool (``warm_pool`` > 0): that many extra workers are kept loaded and warmed up but out of the fleet
    (``--standby``: not registered in etcd), within ``max_replicas`` together with the serving ones. A scale-up
    activates one (SIGUSR1: it registers and serves within a second) instead of a cold start of several seconds of
    weight loading and warm-up, then the pool is refilled while there is room. ``visible(replica_id)`` says whether
    the fleet sees a replica serving; an activation waits for it, so the next decision counts it."""

    def __init__(self, cluster: Any, template: str, drain: Any, prefix: str = "worker-", warm_pool: int = 0,
                 max_replicas: int = 1, visible: Any = None):
        self.cluster = cluster
        self.template = template
        self.drain = drain  # async (address) -> None: the Drain RPC
        self.prefix = prefix
        self.warm_pool, self.max_replicas = warm_pool, max_replicas
        self.visible = visible
        self.standby: list[str] = []  # warm-pool workers, oldest first
        self._filling = 0
        self._starting: dict[str, int] = collections.defaultdict(int)
        self._ids = itertools.count(1 + max(int(n[len(prefix):]) for n, _ in cluster.processes
                                            if n.startswith(prefix) and n[len(prefix):].isdigit()))

    def starting(self, pool: str) -> int:
        return self._starting[pool]

    def _workers(self) -> int:
        return sum(1 for n, _ in self.cluster.processes if n.startswith(self.prefix))

    async def fill(self) -> None:
        """Start standby workers until the warm pool is full or serving + standby reach ``max_replicas``."""
        while self.warm_pool and len(self.standby) + self._filling < self.warm_pool \
                and self._workers() + self._filling < self.max_replicas:
            self._filling += 1
            name = f"{self.prefix}{next(self._ids)}"
            try:
                args = (*self._args(name), "--standby")
                await asyncio.to_thread(self.cluster.spawn, name, *args, threads=self.cluster.specs[self.template][1])
                self.standby.append(name)
                log.info("warm pool: a standby worker is ready", worker=name)
            except Exception as e:  # noqa: BLE001 - tried again after the next scale change
                log.warning("warm pool: could not start a standby worker", worker=name, error=str(e))
                return
            finally:
                self._filling -= 1

    async def scale(self, pool: str, desired: int, serving: Sequence[PoolReplica]) -> None:
        current = len(serving) + self._starting[pool]
        if desired > current:
            await asyncio.gather(*(self._add(pool) for _ in range(desired - current)))
        elif desired < len(serving):
            ours = {n for n, _ in self.cluster.processes}
            victims = sorted(serving, key=lambda r: (r.running + r.waiting, r.replica_id))  # least loaded first
            victims = [v for v in victims if v.replica_id != self.template and v.replica_id in ours]
            await asyncio.gather(*(self._remove(v) for v in victims[: len(serving) - desired]))
        asyncio.ensure_future(self.fill())  # room may have opened (or closed) for the warm pool

    def _args(self, name: str) -> tuple[str, ...]:
        args = _without(self.cluster.specs[self.template][0], ("--port", "--metrics-port", "--host"))
        args = (*args, "--metrics-port", "0") if "--metrics-port" in self.cluster.specs[self.template][0] else args
        return _replaced(args, "--replica-id", name)

    async def _add(self, pool: str) -> None:
        self._starting[pool] += 1
        try:
            while self._filling and not self.standby:  # one is loading: sooner ready than a cold start begun now
                await asyncio.sleep(0.1)
            if self.standby:
                await self._activate(self.standby.pop(0))
                return
            name = f"{self.prefix}{next(self._ids)}"
            address = await asyncio.to_thread(self.cluster.spawn, name, *self._args(name),
                                              threads=self.cluster.specs[self.template][1])
            log.info("autoscale started a worker", worker=name, address=address)
        except Exception as e:  # noqa: BLE001 - the next tick sees the count unchanged and decides again
            log.warning("autoscale could not start a worker", error=str(e))
        finally:
            self._starting[pool] -= 1

    async def _activate(self, name: str) -> None:
        proc = next((p for n, p in self.cluster.processes if n == name), None)
        if proc is None or proc.poll() is not None:
            raise RuntimeError(f"standby worker {name} is gone")
        args, threads = self.cluster.specs[name]
        self.cluster.specs[name] = (tuple(a for a in args if a != "--standby"), threads)  # a restart serves at once
        os.kill(proc.pid, signal.SIGUSR1)
        log.info("autoscale activated a standby worker", worker=name)
        deadline = time.monotonic() + 30
        while self.visible is not None and not self.visible(name) and time.monotonic() < deadline:
            await asyncio.sleep(0.1)

    async def _remove(self, replica: PoolReplica) -> None:
        name = replica.replica_id
        proc = self.cluster.retire(name)  # out of supervision first: a drained worker exits by itself
        if proc is None:
            return
        try:
            await self.drain(replica.address)
        except Exception as e:  # noqa: BLE001 - stop it anyway; its streams resume elsewhere
            log.warning("drain failed", worker=name, error=str(e))
        await asyncio.to_thread(_stop, proc)
        log.info("autoscale stopped a worker", worker=name)


class ComposeDriver:
    """docker compose: ``docker compose -f FILE up -d --no-recreate --scale SERVICE=N`` (one service per pool)."""

    def __init__(self, compose_file: str, services: dict[str, str], project: str = ""):
        self.compose_file, self.services, self.project = compose_file, services, project

    def starting(self, pool: str) -> int:
        return 0

    def command(self, pool: str, desired: int) -> list[str]:
        cmd = ["docker", "compose", "-f", self.compose_file]
        if self.project:
            cmd += ["-p", self.project]
        return [*cmd, "up", "-d", "--no-recreate", "--scale", f"{self.services[pool]}={desired}",
                self.services[pool]]

    async def scale(self, pool: str, desired: int, serving: Sequence[PoolReplica]) -> None:
        if pool not in self.services:
            log.warning("no compose service for pool", pool=pool)
            return
        done = await asyncio.to_thread(subprocess.run, self.command(pool, desired), capture_output=True, text=True)
        if done.returncode:
            log.warning("docker compose scale failed", pool=pool, stderr=done.stderr[-500:])


class KubernetesDriver:
    """The scale subresource of a Deployment or StatefulSet, through the official ``kubernetes`` client: reads the
    current ``spec.replicas`` and patches it. Pods get their certificates and drain on preStop as the manifests say
    (deploy/kubernetes)."""

    def __init__(self, targets: dict[str, tuple[str, str]], namespace: str = "tokenfleet", api: Any = None):
        self.targets = targets  # pool -> (kind "Deployment" | "StatefulSet", name)
        self.namespace = namespace
        self.api = api

    def _apps(self) -> Any:
        if self.api is None:
            from kubernetes import client, config

            try:
                config.load_incluster_config()
            except config.ConfigException:
                config.load_kube_config()
            self.api = client.AppsV1Api()
        return self.api

    def starting(self, pool: str) -> int:
        return 0

    async def scale(self, pool: str, desired: int, serving: Sequence[PoolReplica]) -> None:
        if pool not in self.targets:
            log.warning("no Kubernetes workload for pool", pool=pool)
            return
        kind, name = self.targets[pool]
        apps = self._apps()
        patch = {"spec": {"replicas": desired}}
        if kind == "StatefulSet":
            await asyncio.to_thread(apps.patch_namespaced_stateful_set_scale, name, self.namespace, patch)
        else:
            await asyncio.to_thread(apps.patch_namespaced_deployment_scale, name, self.namespace, patch)

    def replicas(self, pool: str) -> int:
        kind, name = self.targets[pool]
        apps = self._apps()
        read = apps.read_namespaced_stateful_set_scale if kind == "StatefulSet" else apps.read_namespaced_deployment_scale
        return int(read(name, self.namespace).spec.replicas or 0)


def _without(args: Sequence[str], flags: Sequence[str]) -> tuple[str, ...]:
    out: list[str] = []
    skip = False
    for a in args:
        if skip:
            skip = False
            continue
        if a in flags:
            skip = True
            continue
        out.append(a)
    return tuple(out)


def _replaced(args: Sequence[str], flag: str, value: str) -> tuple[str, ...]:
    out = list(args)
    if flag in out:
        out[out.index(flag) + 1] = value
    else:
        out += [flag, value]
    return tuple(out)


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
