"""The second KV tier of a worker: blocks evicted from the engine's pool, kept in a store with its own byte
budget, restored into the pool on a prefix hit instead of being recomputed.

Flow (engine thread unless said): the block manager reports the cached blocks it evicts; the core copies
their K/V out of the pool before the step's forward overwrites them and ``offer``s each (hash, tenant,
bytes) here; a writer thread seals and stores them (off the step's critical path). At admission the
scheduler asks ``fetch_chain`` for the blocks following its pool hit: the longest leading run of them this
tier holds and can verify, their bytes ready to install before the forward reads them.

- Media (``kv_store.BlockStore``): ``MemoryStore`` (host memory) and ``DiskStore`` (one file per block, 0600).
- Records: magic, format version, tenant, a BLAKE2b digest of the plain payload keyed with the namespace,
  then the payload, optionally sealed with AES-GCM (``cipher_key``). ``fetch_chain`` verifies every
  record; one that fails is deleted, counted, and ends the run (its tokens are recomputed).
- Namespace: a digest of the KV layout and the model's weights. A store directory serves one namespace;
  the siblings of other namespaces (another model version or layout) are deleted when a tier opens.
- Budget: an LRU over every entry (``budget_bytes``) and, per tenant, ``tenant_quota_bytes``: a tenant
  over its quota evicts its own oldest entries first.
- Retention (``engine.retention``): entries whose hash a conversation retains are evicted only after every
  entry no conversation retains (the oldest of those first), until the retention's tier horizon (up to a day
  for ``prompt_cache_retention: "24h"``, past the pool's shorter window) or a release: the same pins the
  pool's block manager orders its eviction by, read through ``Retention.tier_pinned``.
- Hashes are the pool's, salted by the request's cache scope: isolation carries over unchanged.
"""

from __future__ import annotations

import hashlib
import os
import queue
import struct
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Container, KeysView, Sequence
from dataclasses import dataclass, field
from typing import cast

import structlog

from tokenfleet.engine.kv_store import DIGEST, HEADER, MAGIC, VERSION, BlockStore

log = structlog.get_logger(__name__)

@dataclass
class TierStats:
    offered: int = 0  # blocks evicted from the pool and handed to this tier
    stored: int = 0  # of those, written to the store
    dropped: int = 0  # not kept: the writer was behind, or the block exceeds the budget or its tenant's quota
    evicted: int = 0  # entries removed to make room (budget or quota)
    hits: int = 0  # blocks restored into the pool
    misses: int = 0  # lookups that found nothing past the pool's hit
    corrupt: int = 0  # records that failed verification (deleted; their tokens recomputed)
    bytes_written: int = 0
    bytes_read: int = 0
    restore_seconds: float = 0.0  # reading and verifying restored blocks
    bytes_used: int = 0  # gauge
    entries: int = 0  # gauge
    per_tenant_bytes: dict[str, int] = field(default_factory=dict)  # gauge


class PendingBlock:
    """A block's K/V bytes still on their way to host memory (on CUDA: a device -> pinned host copy on a
    side stream, so the step that evicted the block does not wait for it). Its size is known now;
    ``result()`` waits for the copy (the tier's writer thread does, or a restore that needs it first)."""

    __slots__ = ("size", "_wait", "_value", "_lock")

    def __init__(self, size: int, wait: Callable[[], bytes]):
        self.size, self._wait = size, wait
        self._value: bytes | None = None
        self._lock = threading.Lock()  # the writer thread and a restore may ask at once: one waits, once

    def __len__(self) -> int:
        return self.size

    def result(self) -> bytes:
        with self._lock:
            if self._value is None:
                self._value = self._wait()
                self._wait = _done  # drops the pinned batch buffer the copy closed over
            return self._value


def _done() -> bytes:
    raise RuntimeError("a PendingBlock's copy was already taken")


Payload = bytes | PendingBlock


def _bytes(payload: Payload) -> bytes:
    return payload.result() if isinstance(payload, PendingBlock) else payload


@dataclass
class _Entry:
    size: int
    tenant: str


class SecondTier:
    def __init__(self, store: BlockStore, budget_bytes: int, namespace: str, tenant_quota_bytes: int = 0,
                 cipher_key: bytes | None = None, max_pending: int = 256, retained: Container[bytes] = frozenset()):
        """``retained``: the hashes conversations retain for the tier now (the block manager's
        ``Retention.tier_pinned``, a live view), read at each eviction."""
        if budget_bytes <= 0:
            raise ValueError(f"budget_bytes must be positive, got {budget_bytes}")
        self.store = store
        self.budget_bytes = budget_bytes
        self.tenant_quota_bytes = tenant_quota_bytes
        self.retained = retained
        self._key = hashlib.blake2b(namespace.encode(), digest_size=32).digest()
        self._aead = _aead(cipher_key) if cipher_key else None
        self._index: OrderedDict[bytes, _Entry] = OrderedDict()  # LRU, oldest first (engine thread)
        self._tenant_bytes: dict[str, int] = {}
        self.stats = TierStats()
        self.version = 0  # bumped whenever the set of held hashes changes
        self._pending: dict[bytes, Payload] = {}  # payloads not yet written (fetches take them from here)
        self._lock = threading.Lock()  # guards _pending between the engine thread and the writer
        self._queue: queue.Queue[tuple[str, bytes, object] | None] = queue.Queue()
        self._max_pending = max_pending
        self._rebuild()
        self._writer = threading.Thread(target=self._write_loop, name=f"kv-tier-{store.name}", daemon=True)
        self._writer.start()

    # ---- engine thread ---------------------------------------------------------------------
    def __contains__(self, block_hash: object) -> bool:
        return block_hash in self._index

    def hashes(self) -> KeysView[bytes]:
        """The held block hashes, live (engine thread)."""
        return self._index.keys()

    def offer(self, block_hash: bytes, tenant: str, payload: Payload) -> None:
        """Keep an evicted block (its K/V bytes, copied out of the pool). Returns at once: the writer
        thread stores it. Dropped when the writer is behind or the block cannot fit."""
        self.stats.offered += 1
        if block_hash in self._index:
            self._index.move_to_end(block_hash)
            return
        size = self._record_size(tenant, payload)  # sealed on the writer thread, off the step's path
        quota = self.tenant_quota_bytes
        if size > self.budget_bytes or (quota and size > quota) or len(self._pending) >= self._max_pending:
            self.stats.dropped += 1
            return
        if quota:
            while self._tenant_bytes.get(tenant, 0) + size > quota:
                self._evict(self._victim(tenant))
        while self.stats.bytes_used + size > self.budget_bytes:
            self._evict(self._victim())
        self._index[block_hash] = _Entry(size, tenant)
        self._account(tenant, size)
        self.version += 1
        with self._lock:
            self._pending[block_hash] = payload
        self._queue.put(("write", block_hash, (tenant, payload)))

    def held_run(self, block_hashes: Sequence[bytes]) -> int:
        n = 0
        while n < len(block_hashes) and block_hashes[n] in self._index:
            n += 1
        return n

    def fetch_chain(self, block_hashes: Sequence[bytes]) -> list[bytes]:
        """Payloads of the longest leading run of ``block_hashes`` held here and verified; a record
        that fails verification is deleted and ends the run."""
        started = time.perf_counter()
        out: list[bytes] = []
        for h in block_hashes:
            if h not in self._index:
                break
            with self._lock:
                pending = self._pending.get(h)  # still in memory: nothing to verify
            payload, failed = None, False
            try:
                payload = _bytes(pending) if pending is not None else None
            except Exception as e:  # noqa: BLE001 - a copy that failed: like a damaged record, recomputed
                log.warning("kv_tier_pending_copy_failed", error=repr(e)[:300])
                failed = True
            if payload is None and not failed:
                record = self.store.read(h.hex())
                payload = self._open(record) if record is not None else None
                self.stats.bytes_read += len(record) if record is not None else 0
            if payload is None:
                self.stats.corrupt += 1
                log.warning("kv_tier_corrupt_block", store=self.store.name, block=h.hex()[:16])
                self._evict(h, count=False)
                break
            self._index.move_to_end(h)
            out.append(payload)
        if out:
            self.stats.hits += len(out)
            self.stats.restore_seconds += time.perf_counter() - started
        elif block_hashes:
            self.stats.misses += 1
        return out

    def snapshot(self) -> TierStats:
        stats = TierStats(**{**self.stats.__dict__, "per_tenant_bytes": dict(self._tenant_bytes)})
        stats.entries = len(self._index)
        return stats

    def flush(self, timeout: float = 30.0) -> None:
        """Wait until every queued write has landed (tests, shutdown)."""
        done = threading.Event()
        self._queue.put(("flush", b"", done))
        done.wait(timeout)

    def close(self) -> None:
        self.flush()
        self._queue.put(None)
        self._writer.join(timeout=30)

    # ---- internals ---------------------------------------------------------------------
    def _victim(self, tenant: str | None = None) -> bytes:
        """The entry to evict (of ``tenant``'s when given): the least recently used one no conversation retains,
        else the least recently used retained one. Walks past the retained entries at the old end: as many
        as the tenants' retention quotas allow."""
        oldest = None
        for h, entry in self._index.items():
            if tenant is not None and entry.tenant != tenant:
                continue
            if h not in self.retained:
                return h
            if oldest is None:
                oldest = h
        if oldest is None:
            raise KeyError(f"no entry to evict for tenant {tenant!r}")
        return oldest

    def _evict(self, block_hash: bytes, count: bool = True) -> None:
        entry = self._index.pop(block_hash)
        with self._lock:  # here, not on the writer: a re-offer queued after the delete keeps its payload
            self._pending.pop(block_hash, None)
        self._account(entry.tenant, -entry.size)
        self.version += 1
        if count:
            self.stats.evicted += 1
        self._queue.put(("delete", block_hash, None))

    def _account(self, tenant: str, size: int) -> None:
        self.stats.bytes_used += size
        left = self._tenant_bytes.get(tenant, 0) + size
        if left:
            self._tenant_bytes[tenant] = left
        else:
            self._tenant_bytes.pop(tenant, None)

    def _write_loop(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            op, block_hash, data = item
            try:
                if op == "write":
                    tenant, payload = cast(tuple[str, Payload], data)
                    record = self._seal(tenant, _bytes(payload))
                    self.store.write(block_hash.hex(), record)
                    self.stats.stored += 1
                    self.stats.bytes_written += len(record)
                    with self._lock:
                        if self._pending.get(block_hash) is payload:
                            del self._pending[block_hash]
                elif op == "delete":
                    self.store.delete(block_hash.hex())
                elif op == "flush":
                    cast(threading.Event, data).set()
            except Exception as e:  # noqa: BLE001 - a full disk or a failed copy loses the block, not the writer
                log.warning("kv_tier_write_failed", store=self.store.name, error=repr(e)[:300])
                with self._lock:
                    self._pending.pop(block_hash, None)

    def _record_size(self, tenant: str, payload: Payload) -> int:
        return HEADER.size + len(tenant.encode()) + DIGEST + len(payload) + (28 if self._aead is not None else 0)

    def _seal(self, tenant: str, payload: bytes) -> bytes:
        name = tenant.encode()
        digest = hashlib.blake2b(payload, key=self._key, digest_size=DIGEST).digest()
        body = payload
        flags = 0
        if self._aead is not None:
            nonce = os.urandom(12)
            body = nonce + self._aead.encrypt(nonce, payload, name)
            flags = 1
        return HEADER.pack(MAGIC, VERSION, flags, len(name)) + name + digest + body

    def _open(self, record: bytes) -> bytes | None:
        """The verified payload of a record, or None (damaged, foreign, or sealed with another key)."""
        try:
            magic, version, flags, name_len = HEADER.unpack_from(record)
        except struct.error:
            return None
        if magic != MAGIC or version != VERSION:
            return None
        start = HEADER.size
        name = record[start: start + name_len]
        digest = record[start + name_len: start + name_len + DIGEST]
        body = record[start + name_len + DIGEST:]
        if flags & 1:
            if self._aead is None:
                return None
            try:
                body = self._aead.decrypt(body[:12], body[12:], name)
            except Exception:  # InvalidTag: tampered or another key
                return None
        if hashlib.blake2b(body, key=self._key, digest_size=DIGEST).digest() != digest:
            return None
        return body

    def _tenant_of(self, record: bytes) -> str | None:
        try:
            magic, _, _, name_len = HEADER.unpack_from(record)
        except struct.error:
            return None
        return record[HEADER.size: HEADER.size + name_len].decode(errors="replace") if magic == MAGIC else None

    def _rebuild(self) -> None:
        """Index what the store already holds (a restarted worker keeps its disk tier): the most recently
        used records that fit the budget (a file's mtime is its last write or restore), the rest deleted."""
        found = sorted(self.store.scan(), key=lambda e: e[2], reverse=True)  # newest first: they fill the budget
        kept: list[tuple[bytes, _Entry]] = []
        for key, size, _, head in found:
            try:
                block_hash = bytes.fromhex(key)
            except ValueError:
                self.store.delete(key)
                continue
            tenant = self._tenant_of(head)
            if tenant is None or self.stats.bytes_used + size > self.budget_bytes:
                self.store.delete(key)
                continue
            kept.append((block_hash, _Entry(size, tenant)))
            self._account(tenant, size)
        for block_hash, entry in reversed(kept):  # the LRU index is oldest first
            self._index[block_hash] = entry
        if found:
            log.info("kv_tier_reopened", store=self.store.name, entries=len(self._index), bytes=self.stats.bytes_used)


def _aead(key: bytes):  # type: ignore[no-untyped-def]
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM

    if len(key) not in (16, 24, 32):
        raise ValueError(f"the KV tier key must be 16, 24 or 32 bytes, got {len(key)}")
    return AESGCM(key)


class StagedBlocks:
    """Blocks a peer replica sent for a prompt about to be admitted here (peer fetch), held in memory (least
    recently used first out when ``budget_bytes`` is needed) and restored by admissions like tier blocks."""

    def __init__(self, budget_bytes: int = 256 << 20):
        self.budget_bytes = budget_bytes
        self._blocks: OrderedDict[bytes, bytes] = OrderedDict()
        self._bytes = 0
        self.hits = 0
        self.received = 0

    def __contains__(self, block_hash: bytes) -> bool:
        return block_hash in self._blocks

    def put(self, block_hash: bytes, payload: bytes) -> None:
        if block_hash in self._blocks or len(payload) > self.budget_bytes:
            return
        while self._bytes + len(payload) > self.budget_bytes:
            _, old = self._blocks.popitem(last=False)
            self._bytes -= len(old)
        self._blocks[block_hash] = payload
        self._bytes += len(payload)
        self.received += 1

    def held_run(self, block_hashes: Sequence[bytes]) -> int:
        n = 0
        while n < len(block_hashes) and block_hashes[n] in self._blocks:
            n += 1
        return n

    def fetch_chain(self, block_hashes: Sequence[bytes]) -> list[bytes]:
        """Kept after a fetch (a prompt sent twice restores them twice); the budget evicts."""
        out = []
        for h in block_hashes:
            payload = self._blocks.get(h)
            if payload is None:
                break
            self._blocks.move_to_end(h)
            out.append(payload)
        self.hits += len(out)
        return out


class TierChain:
    """Several places restored blocks may come from, asked block by block in order (the second tier,
    then blocks staged from a peer)."""

    def __init__(self, tiers: Sequence[SecondTier | StagedBlocks]):
        self.tiers = list(tiers)

    def held_run(self, block_hashes: Sequence[bytes]) -> int:
        n = 0
        while n < len(block_hashes) and any(block_hashes[n] in t for t in self.tiers):
            n += 1
        return n

    def fetch_chain(self, block_hashes: Sequence[bytes]) -> list[bytes]:
        out: list[bytes] = []
        for i, h in enumerate(block_hashes):
            tier = next((t for t in self.tiers if h in t), None)
            got = tier.fetch_chain(block_hashes[i: i + 1]) if tier is not None else []
            if not got:
                break
            out += got
        return out
