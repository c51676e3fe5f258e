"""The router's view of the fleet: membership and the model registry from etcd (list + watch),
load from each worker's ``Load`` stream. Serves snapshots for the pure policies in tokenfleet.routing; keeps serving
its last view while etcd is away.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses

import grpc
import structlog

from tokenfleet.cluster.etcd import EtcdClient, KeyEvent, mirror_prefix
from tokenfleet.cluster.membership import ReplicaRecord
from tokenfleet.cluster.registry import RegistryView, UnknownModelError, follow_registry
from tokenfleet.routing.policies import FleetSnapshot, ReplicaLoad
from tokenfleet.v1 import engine_pb2, engine_pb2_grpc

log = structlog.get_logger()
LOAD_INTERVAL_MS = 200


class FleetView:
    def __init__(self, etcd: EtcdClient):
        self.etcd = etcd
        self.loads: dict[str, ReplicaLoad] = {}  # etcd key -> latest load
        self.hashes: dict[str, set[bytes]] = {}  # etcd key -> block hashes the replica reports cached
        self.layouts: dict[str, tuple[str, int]] = {}  # etcd key -> (hash salt, block size) from its reports
        self.models: dict[str, tuple[str, str]] = {}  # etcd key -> (model name, version)
        self.registry = RegistryView()
        self._streams: dict[str, asyncio.Task] = {}
        self._watch: asyncio.Task | None = None

    async def start(self) -> None:
        self._watch = asyncio.ensure_future(asyncio.gather(
            mirror_prefix(self.etcd, "replicas/", self._reset, self._on_event),
            follow_registry(self.etcd, self.registry)))

    async def stop(self) -> None:
        tasks = [t for t in [self._watch, *self._streams.values()] if t is not None]
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task

    def resolve(self, ref: str) -> tuple[str, str]:
        """A request's model (name, alias or name@version) -> (name, version) through the registry.
        Replicas of unregistered models (standalone workers) are served by their plain name, any version."""
        try:
            record = self.registry.resolve(ref)
            return record.name, record.version
        except UnknownModelError:
            if any(name == ref for name, _ in self.models.values()):
                return ref, ""
            raise

    def _serves(self, key: str, name: str, version: str) -> bool:
        model = self.models.get(key)
        return model is not None and model[0] == name and (not version or not model[1] or model[1] == version)

    def snapshot(self, name: str, version: str = "") -> FleetSnapshot:
        return FleetSnapshot(tuple(load for key, load in self.loads.items() if self._serves(key, name, version)))

    def prefix_view(self, snapshot: FleetSnapshot) -> tuple[tuple[str, int] | None, dict[str, set[bytes]]]:
        """(hash salt, block size) to hash prompts with, and each snapshot replica's reported hashes.
        Replicas of one model share a layout; one that differs never matches (its hashes differ)."""
        ids = {r.replica_id for r in snapshot.replicas}
        keys = [key for key, load in self.loads.items() if load.replica_id in ids]
        layout = next((self.layouts[key] for key in keys if key in self.layouts), None)
        return layout, {self.loads[key].replica_id: self.hashes.get(key, set()) for key in keys}

    def note_assignment(self, replica_id: str, name: str, version: str = "") -> None:
        for key, load in self.loads.items():
            if load.replica_id == replica_id and self._serves(key, name, version):
                self.loads[key] = dataclasses.replace(load, pending_assignments=load.pending_assignments + 1)

    def metric_rows(self) -> list[tuple[str, str, str, int]]:
        """(model, replica, state, effective load) per known replica, for /metrics."""
        return [(self.models[key][0], load.replica_id, load.state, load.effective_load)
                for key, load in self.loads.items() if key in self.models]

    def _reset(self, listing: dict[str, bytes]) -> None:
        for key in set(self.loads) - set(listing):
            self._remove(key)
        for key, raw in listing.items():
            self._upsert(key, ReplicaRecord.from_json(raw))

    def _on_event(self, event: KeyEvent) -> None:
        if event.value is None:
            self._remove(event.key)
        else:
            self._upsert(event.key, ReplicaRecord.from_json(event.value))

    def _upsert(self, key: str, record: ReplicaRecord) -> None:
        old = self.loads.get(key)
        base = old if old is not None and old.address == record.address else ReplicaLoad(record.replica_id, record.address)
        self.loads[key] = dataclasses.replace(base, roles=record.roles, state=record.state)
        self.models[key] = (record.model, record.model_version)
        if key not in self._streams or old is None or old.address != record.address:
            self._restart_stream(key, record.address)

    def _remove(self, key: str) -> None:
        self.loads.pop(key, None)
        self.hashes.pop(key, None)
        self.layouts.pop(key, None)
        self.models.pop(key, None)
        task = self._streams.pop(key, None)
        if task is not None:
            task.cancel()

    def _restart_stream(self, key: str, address: str) -> None:
        old = self._streams.pop(key, None)
        if old is not None:
            old.cancel()
        self._streams[key] = asyncio.create_task(self._follow_load(key, address))

    async def _follow_load(self, key: str, address: str) -> None:
        while key in self.loads:
            try:
                async with grpc.aio.insecure_channel(address) as channel:
                    stub = engine_pb2_grpc.EngineServiceStub(channel)
                    async for report in stub.Load(engine_pb2.LoadRequest(interval_ms=LOAD_INTERVAL_MS)):
                        self._apply(key, report)
            except grpc.aio.AioRpcError as e:
                log.debug("load stream interrupted", address=address, code=str(e.code()))
            await asyncio.sleep(0.5)

    def _apply(self, key: str, report: engine_pb2.LoadReport) -> None:
        load = self.loads.get(key)
        if load is None:
            return
        if report.hashes_reset:
            self.hashes[key] = set(report.added_block_hashes)
        else:
            held = self.hashes.setdefault(key, set())
            held.difference_update(report.removed_block_hashes)
            held.update(report.added_block_hashes)
        if report.HasField("layout"):
            self.layouts[key] = (report.layout.hash_salt, report.layout.block_size)
        draining = report.state == engine_pb2.WORKER_STATE_DRAINING
        self.loads[key] = dataclasses.replace(
            load,
            num_waiting=report.num_waiting,
            num_running=report.num_running,
            num_blocks_used=report.num_blocks_used,
            num_blocks_free=report.num_blocks_free,
            pending_assignments=0,  # the report reflects everything assigned before it
            state="draining" if draining else load.state,
        )
