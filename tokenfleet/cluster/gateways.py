"""Gateway membership in etcd (``gateways/<id>`` under a lease): how many gateways share each
tenant's budget. Each gateway enforces budget / live gateways; when one joins or leaves, the
others' shares follow within a watch event (and a dead one's lease TTL)."""

from __future__ import annotations

import asyncio
import dataclasses
import json
from dataclasses import dataclass

from tokenfleet.cluster.etcd import EtcdClient, KeyEvent, mirror_prefix
from tokenfleet.cluster.membership import SERVING, ReplicaRegistration

PREFIX = "gateways/"


@dataclass(frozen=True)
class GatewayRecord:
    replica_id: str
    address: str
    state: str = SERVING

    @property
    def key(self) -> str:
        if "/" in self.replica_id:
            raise ValueError(f"gateway id {self.replica_id!r} must not contain '/'")
        return PREFIX + self.replica_id

    def to_json(self) -> bytes:
        return json.dumps(dataclasses.asdict(self), sort_keys=True).encode()


class GatewayPeers:
    """Registers this gateway and counts the live ones."""

    def __init__(self, etcd: EtcdClient, record: GatewayRecord, ttl: int = 10):
        self.registration = ReplicaRegistration(etcd, record, ttl)  # type: ignore[arg-type]
        self.etcd = etcd
        self.live: set[str] = {record.key}
        self.synced = False  # a listing of gateways/ has been read at least once
        self._task: asyncio.Task | None = None

    async def start(self) -> None:
        await self.registration.start()
        self._task = asyncio.create_task(mirror_prefix(self.etcd, PREFIX, self._reset, self._on_event))

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
        await self.registration.stop()

    def share(self) -> float | None:
        """This gateway's share of every tenant's budget; None until the membership is known (etcd
        unreachable since start): budgets then fail closed rather than grant each gateway all of it."""
        return 1.0 / max(1, len(self.live)) if self.synced else None

    def _reset(self, listing: dict[str, bytes]) -> None:
        self.live = set(listing) | {self.registration.record.key}
        self.synced = True

    def _on_event(self, event: KeyEvent) -> None:
        if event.value is None:
            self.live.discard(event.key)
        else:
            self.live.add(event.key)
