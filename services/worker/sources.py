"""Which prefill replicas a decode worker may pull a prompt's KV from.

A Generate that names a prefill replica makes this worker connect there and install the blocks it
receives into its prefix cache, where every tenant's later requests reuse them. So the source must
be a replica the fleet registered: its membership record in etcd (``replicas/<model>/<id>``) has
the address named, the prefill role, and this worker's model version and KV layout. The channel
then checks the other end holds a worker certificate (``plane``). A worker without etcd accepts
no prefill source.
"""

from __future__ import annotations

import asyncio
import contextlib

import structlog

from tokenfleet.cluster.etcd import EtcdClient, KeyEvent, mirror_prefix
from tokenfleet.cluster.membership import ReplicaRecord

log = structlog.get_logger()
SYNC_WAIT_S = 5.0  # a worker that just started waits this long for its first view of the fleet


class PrefillSourceError(PermissionError):
    """The named prefill replica is not one this worker may take KV from (PERMISSION_DENIED)."""


class PrefillSources:
    def __init__(self, etcd: EtcdClient | None, model: str, version: str, layout_key: str):
        self.etcd = etcd
        self.model, self.version, self.layout_key = model, version, layout_key
        self.records: dict[str, ReplicaRecord] = {}  # replica id -> record, this model's replicas only
        self.synced = asyncio.Event()
        self._task: asyncio.Task | None = None

    async def start(self) -> None:
        if self.etcd is not None:
            self._task = asyncio.create_task(mirror_prefix(self.etcd, f"replicas/{self.model}/", self._reset,
                                                           self._apply))

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    def _reset(self, listing: dict[str, bytes]) -> None:
        self.records = {}
        for raw in listing.values():
            self._add(raw)
        self.synced.set()

    def _apply(self, event: KeyEvent) -> None:
        if event.value is None:
            self.records.pop(event.key.rpartition("/")[2], None)
        else:
            self._add(event.value)

    def _add(self, raw: bytes) -> None:
        try:
            record = ReplicaRecord.from_json(raw)
        except (ValueError, TypeError) as e:
            log.warning("unreadable replica record ignored", error=str(e))
            return
        self.records[record.replica_id] = record

    async def check_peer(self, replica_id: str, address: str) -> None:
        """PrefillSourceError unless ``replica_id`` at ``address`` is a registered replica of this model
        version and KV layout (any role): a peer this worker may fetch prefix blocks from."""
        await self.check(replica_id, address, role=None)

    async def check(self, replica_id: str, address: str, role: str | None = "prefill") -> None:
        """PrefillSourceError unless ``replica_id`` at ``address`` may send this worker KV."""
        if self.etcd is None:
            raise PrefillSourceError("this worker has no fleet membership view (--etcd): it accepts no prefill source")
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.synced.wait(), SYNC_WAIT_S)
        record = self.records.get(replica_id)
        problem = None
        if record is None:
            problem = "is not registered for this model"
        elif record.address != address:
            problem = f"is registered at {record.address}, not at {address}"
        elif role is not None and role not in record.roles:
            problem = f"is not a {role} replica"
        elif record.model_version != self.version:
            problem = f"serves version {record.model_version!r}, this worker {self.version!r}"
        elif record.kv_layout != self.layout_key:
            problem = "has another KV layout"
        if problem is not None:
            log.warning("prefill source refused", replica=replica_id, address=address, problem=problem)
            raise PrefillSourceError(f"prefill replica {replica_id!r} {problem}: refused as a KV source")
