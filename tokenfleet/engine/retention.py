"""Retention: the cached blocks a conversation keeps above plain LRU, until when, and for which tenant.

A client in a tool-calling loop comes back with the same, longer transcript after a pause of seconds; under
plain LRU a busy pool evicts that transcript in the meantime and the next turn recomputes it. A request that
ends with ``retention_s`` pins the hashes of its full blocks (prompt and output) under its conversation: the
block manager keeps ref-0 blocks with a pinned hash in a second LRU that allocation takes from only after the
plain one, and the second tier evicts unpinned entries first. Nothing is ever refused for a pin: it orders
eviction, it never reserves.

Pure bookkeeping over block hashes: no blocks, no clock (callers pass ``now``). One pin per key (a
conversation digest, or a request id): pinning the key again replaces the earlier pin (the new transcript
contains the old one). A hash stays pinned while any pin holds it (conversations sharing a system prompt share
its blocks). Every mutation returns the hashes whose pinned state changed, so the owner of the blocks
(``BlockManager``) moves only those.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Pin:
    """One key's retention: whose it is (the tenant, for quotas and metrics), until when, which hashes (in chain
    order: a later block is useful only with the ones before it)."""

    owner: str
    until: float
    hashes: tuple[bytes, ...]
    seq: int  # tells a heap entry of a replaced pin from the live one


class Retention:
    """``max_seconds``: a request's retention is clamped to it. ``tenant_quota_blocks``: the distinct hashes one
    tenant's pins may hold (0 = no quota); over it, that tenant's oldest pins are released first."""

    def __init__(self, max_seconds: float = 300.0, tenant_quota_blocks: int = 0):
        if max_seconds < 0 or tenant_quota_blocks < 0:
            raise ValueError(f"retention limits must be >= 0, got {max_seconds} s and {tenant_quota_blocks} blocks")
        self.max_seconds = max_seconds
        self.tenant_quota_blocks = tenant_quota_blocks
        self._pins: dict[str, Pin] = {}  # insertion order: oldest pin first (the quota releases from the front)
        self._counts: dict[bytes, int] = {}  # hash -> pins holding it
        self._owned: dict[str, dict[bytes, int]] = {}  # owner -> hash -> that owner's pins holding it
        self._deadlines: list[tuple[float, int, str]] = []  # heap of (until, seq, key); stale entries skipped
        self._seq = itertools.count()
        self.version = 0  # bumped whenever the set of pinned hashes changes

    # ---- queries ---------------------------------------------------------------------
    def __contains__(self, block_hash: object) -> bool:
        return block_hash in self._counts

    def __len__(self) -> int:
        return len(self._pins)

    def get(self, key: str) -> Pin | None:
        return self._pins.get(key)

    def newest_first(self) -> Iterator[Pin]:
        """The pins, most recently made first (the conversations likeliest to come back soon)."""
        return reversed(list(self._pins.values()))

    def owner_blocks(self) -> dict[str, int]:
        """Distinct hashes pinned per owner."""
        return {owner: len(hashes) for owner, hashes in self._owned.items()}

    @property
    def num_hashes(self) -> int:
        return len(self._counts)

    # ---- mutations -------------------------------------------------------------------
    def pin(self, key: str, owner: str, hashes: Sequence[bytes], now: float, seconds: float) -> list[bytes]:
        """Pin ``hashes`` under ``key`` until ``now + min(seconds, max_seconds)``, replacing ``key``'s earlier pin;
        then release ``owner``'s oldest other pins while it is over its quota (a pin larger than the quota keeps
        its leading blocks). Returns the hashes whose pinned state changed."""
        touched: dict[bytes, bool] = {}  # hash -> pinned before this call
        self._drop(key, touched)
        quota = self.tenant_quota_blocks
        kept = tuple(dict.fromkeys(hashes))[: quota or None]
        seconds = min(seconds, self.max_seconds)
        if kept and seconds > 0:
            pin = Pin(owner, now + seconds, kept, next(self._seq))
            self._pins[key] = pin
            heapq.heappush(self._deadlines, (pin.until, pin.seq, key))
            owned = self._owned.setdefault(owner, {})
            for h in kept:
                touched.setdefault(h, h in self._counts)
                self._counts[h] = self._counts.get(h, 0) + 1
                owned[h] = owned.get(h, 0) + 1
            while quota and len(owned) > quota:
                oldest = next(k for k, p in self._pins.items() if p.owner == owner and k != key)
                self._drop(oldest, touched)
        return self._changed(touched)

    def unpin(self, key: str) -> tuple[Pin | None, list[bytes]]:
        """Release ``key``'s pin: (the pin, or None if it had none; the hashes no longer pinned)."""
        pin = self._pins.get(key)
        touched: dict[bytes, bool] = {}
        self._drop(key, touched)
        return pin, self._changed(touched)

    def expire(self, now: float) -> tuple[int, list[bytes]]:
        """Release every pin whose deadline is ``now`` or before: (how many, the hashes no longer pinned)."""
        touched: dict[bytes, bool] = {}
        expired = 0
        while self._deadlines and self._deadlines[0][0] <= now:
            _, seq, key = heapq.heappop(self._deadlines)
            pin = self._pins.get(key)
            if pin is not None and pin.seq == seq:
                self._drop(key, touched)
                expired += 1
        return expired, self._changed(touched)

    # ---- internals -------------------------------------------------------------------
    def _drop(self, key: str, touched: dict[bytes, bool]) -> None:
        pin = self._pins.pop(key, None)
        if pin is None:
            return
        owned = self._owned[pin.owner]
        for h in pin.hashes:
            touched.setdefault(h, True)
            _decrement(self._counts, h)
            _decrement(owned, h)
        if not owned:
            del self._owned[pin.owner]

    def _changed(self, touched: dict[bytes, bool]) -> list[bytes]:
        changed = [h for h, before in touched.items() if before != (h in self._counts)]
        if changed:
            self.version += 1
        return changed

    def problem(self) -> str | None:
        """What is inconsistent in the bookkeeping, or None (``BlockManager.check_invariants`` asks)."""
        counts: dict[bytes, int] = {}
        owned: dict[str, dict[bytes, int]] = {}
        for pin in self._pins.values():
            for h in pin.hashes:
                counts[h] = counts.get(h, 0) + 1
                per = owned.setdefault(pin.owner, {})
                per[h] = per.get(h, 0) + 1
        if counts != self._counts or owned != self._owned:
            return "retention counts disagree with its pins"
        live = {(p.seq, k) for k, p in self._pins.items()}
        if not live <= {(seq, k) for _, seq, k in self._deadlines}:
            return "a pin has no deadline"
        quota = self.tenant_quota_blocks
        if quota and any(len(h) > quota for h in self._owned.values()):
            return "a tenant holds more pinned blocks than its quota"
        return None


def _decrement(counts: dict[bytes, int], h: bytes) -> None:
    left = counts[h] - 1
    if left:
        counts[h] = left
    else:
        del counts[h]
