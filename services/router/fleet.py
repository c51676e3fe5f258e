"""The router's view of the fleet: membership from etcd (list + watch), load from each worker's
``Load`` stream. Serves snapshots for the pure policies in tokenfleet.routing; keeps serving
its last view while etcd is away.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses

import grpc
import structlog

from tokenfleet.cluster.etcd import ETCD_ERRORS, EtcdClient
from tokenfleet.cluster.membership import ReplicaRecord
from tokenfleet.routing.policies import FleetSnapshot, ReplicaLoad
from tokenfleet.v1 import engine_pb2, engine_pb2_grpc

log = structlog.get_logger()
LOAD_INTERVAL_MS = 200


class FleetView:
    def __init__(self, etcd: EtcdClient):
        self.etcd = etcd
        self.loads: dict[str, ReplicaLoad] = {}  # etcd key -> latest load
        self.models: dict[str, str] = {}  # etcd key -> model name
        self._streams: dict[str, asyncio.Task] = {}
        self._watch: asyncio.Task | None = None

    async def start(self) -> None:
        self._watch = asyncio.create_task(self._follow_membership())

    async def stop(self) -> None:
        tasks = [t for t in [self._watch, *self._streams.values()] if t is not None]
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task

    def snapshot(self, model: str) -> FleetSnapshot:
        return FleetSnapshot(tuple(load for key, load in self.loads.items() if self.models.get(key) == model))

    def has_model(self, model: str) -> bool:
        return model in self.models.values()

    def note_assignment(self, replica_id: str, model: str) -> None:
        for key, load in self.loads.items():
            if load.replica_id == replica_id and self.models.get(key) == model:
                self.loads[key] = dataclasses.replace(load, pending_assignments=load.pending_assignments + 1)

    async def _follow_membership(self) -> None:
        while True:
            try:
                current = await self.etcd.get_prefix("replicas/")
                for key in set(self.loads) - set(current):
                    self._remove(key)
                for key, raw in current.items():
                    self._upsert(key, ReplicaRecord.from_json(raw))
                async for event in self.etcd.watch_prefix("replicas/"):
                    if event.value is None:
                        self._remove(event.key)
                    else:
                        self._upsert(event.key, ReplicaRecord.from_json(event.value))
            except ETCD_ERRORS as e:
                log.warning("etcd unavailable; routing on the last view", error=str(e))
                await asyncio.sleep(0.5)

    def _upsert(self, key: str, record: ReplicaRecord) -> None:
        old = self.loads.get(key)
        base = old if old is not None and old.address == record.address else ReplicaLoad(record.replica_id, record.address)
        self.loads[key] = dataclasses.replace(base, roles=record.roles, state=record.state)
        self.models[key] = record.model
        if key not in self._streams or old is None or old.address != record.address:
            self._restart_stream(key, record.address)

    def _remove(self, key: str) -> None:
        self.loads.pop(key, None)
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
