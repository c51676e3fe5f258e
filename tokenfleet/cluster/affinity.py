"""The prefix-affinity map in etcd: ``affinity/<model>/<anchor hex>`` -> the replicas that hold
that prefix (JSON). Routers mirror it (list + watch), so several routers share it and a
restarted one routes by it at once; they write an entry only when an assignment changes (a
new prefix, a spill to a second home), never per request.

Entries live under leases of minutes: a router grants a fresh lease every half TTL and writes
with the current one, so an entry disappears about ``ttl`` seconds after its last write. An
active prefix whose entry expired is simply written again at its next placement.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections import Counter
from collections.abc import Sequence

import structlog

from tokenfleet.cluster.etcd import ETCD_ERRORS, EtcdClient, KeyEvent, mirror_prefix

log = structlog.get_logger()
PREFIX = "affinity/"
DEFAULT_TTL = 600


def affinity_key(model: str, anchor: bytes) -> str:
    if "/" in model:
        raise ValueError(f"model name {model!r} must not contain '/'")
    return f"{PREFIX}{model}/{anchor.hex()}"


class AffinityMap:
    def __init__(self, etcd: EtcdClient, ttl: int = DEFAULT_TTL):
        self.etcd = etcd
        self.ttl = ttl
        self.homes: dict[str, tuple[str, ...]] = {}  # key -> replica ids, oldest home first
        self._counts: Counter[str] | None = None  # replica id -> prefixes homed there (cached)
        self.synced = asyncio.Event()
        self.num_writes = 0
        self._lease: tuple[int, float] | None = None  # (lease id, granted at)
        self._task: asyncio.Task | None = None
        self._writes: set[asyncio.Task] = set()

    async def start(self) -> None:
        self._task = asyncio.create_task(mirror_prefix(self.etcd, PREFIX, self._reset, self._on_event))

    async def stop(self) -> None:
        for task in [self._task, *self._writes]:
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task

    def homes_of(self, model: str, anchor: bytes) -> tuple[str, ...]:
        return self.homes.get(affinity_key(model, anchor), ())

    def homes_count(self) -> Counter[str]:
        """Replica id -> how many prefixes it is a home of (recounted after changes only)."""
        if self._counts is None:
            self._counts = Counter(r for homes in self.homes.values() for r in homes)
        return self._counts

    def record(self, model: str, anchor: bytes, homes: Sequence[str]) -> None:
        """Set the anchor's homes now (this router) and in etcd (in the background)."""
        key = affinity_key(model, anchor)
        self.homes[key] = tuple(homes)
        self._counts = None
        task = asyncio.create_task(self._write(key, tuple(homes)))
        self._writes.add(task)
        task.add_done_callback(self._writes.discard)

    async def _write(self, key: str, homes: tuple[str, ...]) -> None:
        try:
            lease = await self._current_lease()
            await self.etcd.put(key, json.dumps({"replicas": list(homes)}).encode(), lease)
            self.num_writes += 1
        except ETCD_ERRORS as e:  # keep routing by the local copy; the next change writes again
            self._lease = None  # it may be the lease that is gone (etcd restarted without its data)
            log.warning("affinity write failed", key=key, error=str(e))

    async def _current_lease(self) -> int:
        now = time.monotonic()
        if self._lease is None or now - self._lease[1] > self.ttl / 2:
            self._lease = (await self.etcd.grant_lease(self.ttl), now)
        return self._lease[0]

    def _reset(self, listing: dict[str, bytes]) -> None:
        self.homes = {key: _parse(raw) for key, raw in listing.items()}
        self._counts = None
        self.synced.set()

    def _on_event(self, event: KeyEvent) -> None:
        self._counts = None
        if event.value is None:
            self.homes.pop(event.key, None)
        else:
            self.homes[event.key] = _parse(event.value)


def _parse(raw: bytes) -> tuple[str, ...]:
    try:
        return tuple(str(r) for r in json.loads(raw).get("replicas", []))
    except (ValueError, AttributeError):
        return ()
