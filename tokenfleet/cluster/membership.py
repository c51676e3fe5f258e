"""Replica membership in etcd: ``replicas/<model>/<replica_id>`` -> a JSON record, kept under a lease."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
from dataclasses import dataclass

import structlog

from tokenfleet.cluster.etcd import ETCD_ERRORS, EtcdClient

log = structlog.get_logger()
SERVING, DRAINING = "serving", "draining"


@dataclass(frozen=True)
class ReplicaRecord:
    replica_id: str
    model: str
    address: str  # host:port of the worker's gRPC server
    roles: tuple[str, ...]  # "decode", "prefill"
    model_version: str = ""
    num_blocks: int = 0
    max_running: int = 0
    state: str = SERVING
    kv_layout: str = ""  # KVLayout.key(): decode workers accept KV only from prefill replicas with theirs
    # "" or why this replica serves its record's pinned dtype although another is its machine's fastest
    numerics: str = ""

    @property
    def key(self) -> str:
        return replica_key(self.model, self.replica_id)

    def to_json(self) -> bytes:
        return json.dumps(dataclasses.asdict(self), sort_keys=True).encode()

    @classmethod
    def from_json(cls, raw: bytes) -> ReplicaRecord:
        data = json.loads(raw)
        data["roles"] = tuple(data.get("roles", ()))
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})  # a newer writer's fields are skipped


def replica_key(model: str, replica_id: str) -> str:
    if "/" in model or "/" in replica_id:
        raise ValueError(f"model ({model!r}) and replica id ({replica_id!r}) must not contain '/'")
    return f"replicas/{model}/{replica_id}"


class ReplicaRegistration:
    """Registers a record under a lease and keeps it alive; re-registers after etcd outages.

    Never raises on etcd errors: a worker keeps serving while etcd is away.
    """

    def __init__(self, client: EtcdClient, record: ReplicaRecord, ttl: int = 10):
        self.client = client
        self.record = record
        self.ttl = ttl
        self.lease_id: int | None = None
        self._task: asyncio.Task | None = None
        self.registered = asyncio.Event()

    async def start(self) -> None:
        self._task = asyncio.create_task(self._keep_alive(), name=f"keepalive-{self.record.replica_id}")

    async def set_state(self, state: str) -> None:
        self.record = dataclasses.replace(self.record, state=state)
        if self.lease_id is not None:
            with contextlib.suppress(*ETCD_ERRORS):
                await self.client.put(self.record.key, self.record.to_json(), self.lease_id)

    async def stop(self) -> None:
        """Deregister now (delete the key, revoke the lease) rather than waiting for the TTL."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self.lease_id is not None:
            with contextlib.suppress(*ETCD_ERRORS):
                await self.client.delete(self.record.key)
            await self.client.revoke_lease(self.lease_id)
        self.lease_id = None

    async def _keep_alive(self) -> None:
        interval = max(self.ttl / 3, 0.2)
        while True:
            try:
                if self.lease_id is None or await self.client.refresh_lease(self.lease_id) <= 0:
                    await self._register()
            except ETCD_ERRORS as e:
                log.warning("etcd unreachable; serving on", replica=self.record.replica_id, error=str(e))
                await asyncio.sleep(min(interval, 1.0))
                continue
            await asyncio.sleep(interval)

    async def _register(self) -> None:
        self.lease_id = await self.client.grant_lease(self.ttl)
        await self.client.put(self.record.key, self.record.to_json(), self.lease_id)
        self.registered.set()
        log.info("registered", key=self.record.key, lease=self.lease_id)
