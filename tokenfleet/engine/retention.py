"""Retention: the cached blocks a conversation keeps above plain LRU, until when, and for which tenant.

A client in a tool-calling loop comes back with the same, longer transcript after a pause of seconds; under
plain LRU a busy pool evicts that transcript in the meantime and the next turn recomputes it. A request that
ends with ``retention_s`` pins the hashes of its full blocks (prompt and output) under its conversation: the
block manager keeps ref-0 blocks with a pinned hash in a second LRU that allocation takes from only after the
plain one, and the second tier evicts unpinned entries first. Nothing is ever refused for a pin: it orders
eviction, it never reserves.

Two horizons per pin. The pool's priority is scarce (a pool block held above LRU is one a running request
cannot reuse cheaply), so it lasts ``min(retention_s, max_seconds)``; the second tier is larger and slower, so
a conversation asked back within a day (``prompt_cache_retention: "24h"``) keeps the tier's priority for
``min(retention_s, tier_max_seconds)``, never less than the pool's. Between the two a pin is *tier-only*: its
blocks are plain LRU in the pool (a hit on them is a plain hit, prefetch leaves them in the tier) and the tier
still evicts them after every unpinned entry::

    now ---- pool horizon (until) ---- tier horizon (tier_until) ---->
    | pool and tier priority | tier priority only | nothing      |

Pure bookkeeping over block hashes: no blocks, no clock (callers pass ``now``). One pin per key (a
conversation digest, or a request id): pinning the key again replaces the earlier pin (the new transcript
contains the old one). A hash stays pinned while any pin holds it (conversations sharing a system prompt share
its blocks). Every mutation returns the hashes whose pinned-for-the-pool state changed, so the owner of the
blocks (``BlockManager``) moves only those; the tier reads ``tier_pinned``, a live view, at each eviction.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterator, KeysView, Sequence
from dataclasses import dataclass

_POOL, _TIER = 0, 1  # which horizon a deadline entry marks


@dataclass(frozen=True)
class Pin:
    """One key's retention: whose it is (the tenant, for quotas and metrics), until when for the pool and for
    the tier (``until <= tier_until``), which hashes (in chain order: a later block is useful only with the ones
    before it)."""

    owner: str
    until: float
    tier_until: float
    hashes: tuple[bytes, ...]
    seq: int  # tells a heap entry of a replaced pin from the live one


class Retention:
    """``max_seconds``: a request's pool priority is clamped to it. ``tier_max_seconds``: its tier priority is
    clamped to it (0: no longer than the pool's; a worker without a second tier passes 0, so a day-long request
    holds nothing past the pool window). ``tenant_quota_blocks``: the distinct hashes one tenant's pins may hold
    (0 = no quota); over it, that tenant's oldest pins are released first.

    The quota counts pins of both kinds, pool and tier-only, rather than a separate tier quota: a tier-only pin
    still takes the tier's priority from other tenants' entries, for up to a day, so it spends the same budget;
    and since the oldest pins are released first, a tenant's tier-only pins (usually its oldest) make room for
    its live conversations before any of those loses its place."""

    def __init__(self, max_seconds: float = 300.0, tenant_quota_blocks: int = 0, tier_max_seconds: float = 86400.0):
        if max_seconds < 0 or tier_max_seconds < 0 or tenant_quota_blocks < 0:
            raise ValueError(f"retention limits must be >= 0, got {max_seconds} s (pool), {tier_max_seconds} s "
                             f"(tier) and {tenant_quota_blocks} blocks")
        self.max_seconds = max_seconds
        self.tier_max_seconds = tier_max_seconds
        self.tenant_quota_blocks = tenant_quota_blocks
        self._pins: dict[str, Pin] = {}  # every pin (either horizon live); oldest first (the quota releases those)
        self._pool_keys: dict[str, None] = {}  # the pins whose pool horizon is live, oldest first
        self._counts: dict[bytes, int] = {}  # hash -> pool-live pins holding it
        self._tier_counts: dict[bytes, int] = {}  # hash -> pins holding it (both kinds)
        self._owned: dict[str, dict[bytes, int]] = {}  # owner -> hash -> that owner's pins holding it (both kinds)
        self._deadlines: list[tuple[float, int, int, str]] = []  # heap of (time, seq, _POOL/_TIER, key); stale skipped
        self._seq = itertools.count()
        self.version = 0  # bumped whenever the set of hashes pinned for the pool changes (prefetch reads it)

    # ---- queries (the pool's and the tier's eviction paths: dictionary lookups) ------------
    def __contains__(self, block_hash: object) -> bool:
        """Pinned for the pool: a live pool horizon holds it."""
        return block_hash in self._counts

    @property
    def tier_pinned(self) -> KeysView[bytes]:
        """The hashes pinned for the tier (any pin holds them), a live view: the tier keeps it and reads it at
        each eviction."""
        return self._tier_counts.keys()

    def __len__(self) -> int:
        """Pins of both kinds."""
        return len(self._pins)

    @property
    def num_pool_pins(self) -> int:
        return len(self._pool_keys)

    def get(self, key: str) -> Pin | None:
        return self._pins.get(key)

    def in_pool(self, key: str) -> bool:
        """Whether ``key``'s pin still has the pool's priority."""
        return key in self._pool_keys

    def newest_first(self) -> Iterator[Pin]:
        """The pins of both kinds, most recently made first."""
        return reversed(list(self._pins.values()))

    def pool_pins_newest_first(self) -> Iterator[Pin]:
        """The pins whose pool horizon is live, most recently made first (the conversations likeliest to come back
        soon: those prefetch brings back; a tier-only one waits in the tier for its next turn)."""
        return (self._pins[key] for key in reversed(list(self._pool_keys)))

    def owner_blocks(self) -> dict[str, int]:
        """Distinct hashes pinned per owner (both kinds: what the quota counts)."""
        return {owner: len(hashes) for owner, hashes in self._owned.items()}

    @property
    def num_hashes(self) -> int:
        """Distinct hashes pinned, for the pool or the tier."""
        return len(self._tier_counts)

    # ---- mutations -------------------------------------------------------------------
    def pin(self, key: str, owner: str, hashes: Sequence[bytes], now: float, seconds: float) -> list[bytes]:
        """Pin ``hashes`` under ``key`` for the pool until ``now + min(seconds, max_seconds)`` and for the tier
        until ``now + min(seconds, tier_max_seconds)`` (not before the pool's), replacing ``key``'s earlier pin;
        then release ``owner``'s oldest other pins while it is over its quota (a pin larger than the quota keeps
        its leading blocks). Returns the hashes whose pinned-for-the-pool state changed."""
        touched: dict[bytes, bool] = {}  # hash -> pinned for the pool before this call
        self._drop(key, touched)
        quota = self.tenant_quota_blocks
        kept = tuple(dict.fromkeys(hashes))[: quota or None]
        pool_s = max(0.0, min(seconds, self.max_seconds))
        tier_s = max(pool_s, min(seconds, self.tier_max_seconds))
        if kept and tier_s > 0:
            pin = Pin(owner, now + pool_s, now + tier_s, kept, next(self._seq))
            self._pins[key] = pin
            heapq.heappush(self._deadlines, (pin.tier_until, pin.seq, _TIER, key))
            if pool_s > 0:
                self._pool_keys[key] = None
                if pin.until < pin.tier_until:
                    heapq.heappush(self._deadlines, (pin.until, pin.seq, _POOL, key))
            owned = self._owned.setdefault(owner, {})
            for h in kept:
                touched.setdefault(h, h in self._counts)
                if pool_s > 0:
                    self._counts[h] = self._counts.get(h, 0) + 1
                self._tier_counts[h] = self._tier_counts.get(h, 0) + 1
                owned[h] = owned.get(h, 0) + 1
            while quota and len(owned) > quota:
                oldest = next(k for k, p in self._pins.items() if p.owner == owner and k != key)
                self._drop(oldest, touched)
        return self._changed(touched)

    def unpin(self, key: str) -> tuple[Pin | None, list[bytes]]:
        """Release ``key``'s pin, both horizons: (the pin, or None if it had none; the hashes no longer pinned
        for the pool)."""
        pin = self._pins.get(key)
        touched: dict[bytes, bool] = {}
        self._drop(key, touched)
        return pin, self._changed(touched)

    def expire(self, now: float) -> tuple[int, list[bytes]]:
        """Pass the horizons that are ``now`` or before: a pool horizon leaves its pin tier-only, a tier horizon
        releases it. Returns (how many pins were released, the hashes no longer pinned for the pool)."""
        touched: dict[bytes, bool] = {}
        expired = 0
        while self._deadlines and self._deadlines[0][0] <= now:
            _, seq, horizon, key = heapq.heappop(self._deadlines)
            pin = self._pins.get(key)
            if pin is None or pin.seq != seq:
                continue
            if horizon == _TIER:
                self._drop(key, touched)
                expired += 1
            else:
                self._leave_pool(key, pin, touched)
        return expired, self._changed(touched)

    # ---- internals -------------------------------------------------------------------
    def _leave_pool(self, key: str, pin: Pin, touched: dict[bytes, bool]) -> None:
        if key not in self._pool_keys:
            return
        del self._pool_keys[key]
        for h in pin.hashes:
            touched.setdefault(h, True)
            _decrement(self._counts, h)

    def _drop(self, key: str, touched: dict[bytes, bool]) -> None:
        pin = self._pins.get(key)
        if pin is None:
            return
        self._leave_pool(key, pin, touched)
        del self._pins[key]
        owned = self._owned[pin.owner]
        for h in pin.hashes:
            _decrement(self._tier_counts, h)
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
        tier_counts: dict[bytes, int] = {}
        owned: dict[str, dict[bytes, int]] = {}
        for key, pin in self._pins.items():
            for h in pin.hashes:
                if key in self._pool_keys:
                    counts[h] = counts.get(h, 0) + 1
                tier_counts[h] = tier_counts.get(h, 0) + 1
                per = owned.setdefault(pin.owner, {})
                per[h] = per.get(h, 0) + 1
        if counts != self._counts or tier_counts != self._tier_counts or owned != self._owned:
            return "retention counts disagree with its pins"
        if not self._pool_keys.keys() <= self._pins.keys() or any(p.until > p.tier_until for p in self._pins.values()):
            return "a pool horizon outlives its pin"
        queued = {(seq, horizon, k) for _, seq, horizon, k in self._deadlines}
        if any((p.seq, _TIER, k) not in queued for k, p in self._pins.items()):
            return "a pin has no tier deadline"
        if any((p.seq, _POOL, k) not in queued for k, p in self._pins.items()
               if k in self._pool_keys and p.until < p.tier_until):
            return "a pool-live pin has no pool deadline"
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
