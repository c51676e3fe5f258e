"""The router's view of the fleet: membership from etcd (list + watch), the model registry from the
registry service (its Watch, through the registry client), load from each worker's ``Load`` stream.
Serves snapshots for the pure policies in tokenfleet.routing; keeps serving its last view while etcd
or the registry is away.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from dataclasses import dataclass, field

import grpc
import structlog
from tokenfleet.services.common.convert import layout_from_proto
from tokenfleet.services.registry.client import watch_registry

from tokenfleet.cluster.etcd import EtcdClient, KeyEvent, mirror_prefix
from tokenfleet.cluster.membership import ReplicaRecord
from tokenfleet.cluster.registry import RegistryView, UnknownModelError
from tokenfleet.kvcache.layout import KVLayout
from tokenfleet.routing.policies import FleetSnapshot, ReplicaLoad
from tokenfleet.security.plane import Plane
from tokenfleet.v1 import engine_pb2, engine_pb2_grpc

log = structlog.get_logger()
LOAD_INTERVAL_MS = 200


@dataclass
class Replica:
    """What the router knows of one replica (keyed by its etcd membership key)."""

    load: ReplicaLoad
    model: str
    version: str
    hashes: set[bytes] = field(default_factory=set)  # block hashes it reports cached (pool and second tier)
    tier_hashes: set[bytes] = field(default_factory=set)  # of those, held only in its second tier
    layout: KVLayout | None = None  # from its load reports (hash salt and block size key the prefix hashes)
    stream: asyncio.Task | None = None  # the Load stream that updates it


class FleetView:
    def __init__(self, etcd: EtcdClient, plane: Plane, registry_address: str | None = None):
        self.etcd = etcd
        self.plane = plane  # Load streams to workers, the registry's Watch
        self.registry_address = registry_address  # None: no registry; models are served by their plain names
        self.replicas: dict[str, Replica] = {}  # etcd key -> replica
        self.registry = RegistryView()
        self._watch: asyncio.Task | None = None

    async def start(self) -> None:
        watches = [mirror_prefix(self.etcd, "replicas/", self._reset, self._on_event)]
        if self.registry_address is not None:
            watches.append(self._follow_registry(self.registry_address))
        self._watch = asyncio.ensure_future(asyncio.gather(*watches))

    async def _follow_registry(self, address: str) -> None:
        """The registry's catalog as it changes; the last one is kept while the registry is away."""
        async for view in watch_registry(address, self.plane):
            self.registry = view

    async def stop(self) -> None:
        tasks = [t for t in [self._watch, *(r.stream for r in self.replicas.values())] if t is not None]
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task

    def resolve(self, ref: str) -> tuple[str, str]:
        """A request's model (name, alias or name@version) -> (name, version) through the registry.
        Without the registry's word: ``name@version`` (what gateways send, resolved already) is taken
        as it is when a replica serves it; replicas of unregistered models (standalone workers) are
        served by their plain name, any version."""
        try:
            record = self.registry.resolve(ref)
            return record.name, record.version
        except UnknownModelError:
            name, _, version = ref.partition("@")
            if version and any(r.model == name and r.version == version for r in self.replicas.values()):
                return name, version
            if any(r.model == ref for r in self.replicas.values()):
                return ref, ""
            raise

    @staticmethod
    def _serves(replica: Replica, name: str, version: str) -> bool:
        return replica.model == name and (not version or not replica.version or replica.version == version)

    def snapshot(self, name: str, version: str = "") -> FleetSnapshot:
        return FleetSnapshot(tuple(r.load for r in self.replicas.values() if self._serves(r, name, version)))

    def prefix_view(self, snapshot: FleetSnapshot) -> tuple[KVLayout | None, dict[str, set[bytes]], dict[str, set[bytes]]]:
        """The KV layout to hash prompts with (its salt and block size), each snapshot replica's reported
        hashes, and of those the ones only in its second tier. Replicas of one model share a layout; one
        that differs never matches (its hashes differ)."""
        ids = {r.replica_id for r in snapshot.replicas}
        members = [r for r in self.replicas.values() if r.load.replica_id in ids]
        layout = next((r.layout for r in members if r.layout is not None), None)
        return layout, {r.load.replica_id: r.hashes for r in members}, {r.load.replica_id: r.tier_hashes for r in members}

    def note_assignment(self, replica_id: str, name: str, version: str = "") -> None:
        for replica in self.replicas.values():
            if replica.load.replica_id == replica_id and self._serves(replica, name, version):
                replica.load = dataclasses.replace(replica.load, pending_assignments=replica.load.pending_assignments + 1)

    def metric_rows(self) -> list[tuple[str, str, str, int]]:
        """(model, replica, state, effective load) per known replica, for /metrics."""
        return [(r.model, r.load.replica_id, r.load.state, r.load.effective_load) for r in self.replicas.values()]

    def _reset(self, listing: dict[str, bytes]) -> None:
        for key in set(self.replicas) - set(listing):
            self._remove(key)
        for key, raw in listing.items():
            self._upsert(key, ReplicaRecord.from_json(raw))

    def _on_event(self, event: KeyEvent) -> None:
        if event.value is None:
            self._remove(event.key)
        else:
            self._upsert(event.key, ReplicaRecord.from_json(event.value))

    def _upsert(self, key: str, record: ReplicaRecord) -> None:
        old = self.replicas.get(key)
        moved = old is None or old.load.address != record.address
        base = ReplicaLoad(record.replica_id, record.address) if moved or old is None else old.load
        load = dataclasses.replace(base, roles=record.roles, state=record.state)
        if old is None or moved:
            if old is not None and old.stream is not None:
                old.stream.cancel()
            replica = self.replicas[key] = Replica(load, record.model, record.model_version)
            replica.stream = asyncio.create_task(self._follow_load(key, record.address))
        else:
            old.load, old.model, old.version = load, record.model, record.model_version

    def _remove(self, key: str) -> None:
        replica = self.replicas.pop(key, None)
        if replica is not None and replica.stream is not None:
            replica.stream.cancel()

    async def _follow_load(self, key: str, address: str) -> None:
        while key in self.replicas:
            try:
                async with self.plane.channel(address, "worker") as channel:
                    stub = engine_pb2_grpc.EngineServiceStub(channel)
                    async for report in stub.Load(engine_pb2.LoadRequest(interval_ms=LOAD_INTERVAL_MS)):
                        self._apply(key, report)
            except grpc.aio.AioRpcError as e:
                log.debug("load stream interrupted", address=address, code=str(e.code()))
            replica = self.replicas.get(key)
            if replica is not None:  # unheard from: name it neither as a prefix's holder nor as a peer to fetch from
                replica.hashes, replica.tier_hashes = set(), set()
            await asyncio.sleep(0.5)

    def _apply(self, key: str, report: engine_pb2.LoadReport) -> None:
        replica = self.replicas.get(key)
        if replica is None:
            return
        if report.hashes_reset:
            replica.hashes = set(report.added_block_hashes)
            replica.tier_hashes = set(report.added_tier_block_hashes)
        else:
            replica.hashes.difference_update(report.removed_block_hashes)
            replica.hashes.update(report.added_block_hashes)
            replica.tier_hashes.difference_update(report.removed_tier_block_hashes)
            replica.tier_hashes.update(report.added_tier_block_hashes)
        if report.HasField("layout"):
            replica.layout = layout_from_proto(report.layout)
        draining = report.state == engine_pb2.WORKER_STATE_DRAINING
        replica.load = dataclasses.replace(
            replica.load,
            num_waiting=report.num_waiting,
            num_running=report.num_running,
            num_blocks_used=report.num_blocks_used,
            num_blocks_free=report.num_blocks_free,
            pending_assignments=0,  # the report reflects everything assigned before it
            adapters=frozenset(report.adapters),
            state="draining" if draining else replica.load.state,
            ttft_ms_recent=report.ttft_ms_recent,
            prefill_wait_s=report.num_queued_prompt_tokens / report.prefill_tokens_per_s
            if report.prefill_tokens_per_s > 0 else 0.0,
        )
