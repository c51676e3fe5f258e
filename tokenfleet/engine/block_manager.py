"""KV block manager: integers only (free list, ref counts, hash -> block, LRU of cached blocks).

Every block is in exactly one of four states:

    free       ref 0, no hash             in ``_free_ids`` (FIFO)
    cached     ref 0, has hash            in ``_evictable`` (LRU: oldest first) = the prefix cache
    retained   ref 0, has a pinned hash   in ``_retained`` (LRU: oldest first)
    in use     ref > 0                    in one or more block tables

Allocation takes free blocks first, then evicts the least recently used cached block, and only
when neither is left the least recently used retained one, so allocation never fails while any
block has ref 0 (no fragmentation: blocks are interchangeable; retention orders eviction and
never reserves a block). A hash is pinned while a conversation retains it for the pool
(``engine.retention``: ``retain``, ``release``, ``expire``; a pin past its pool horizon but not its
tier horizon leaves its blocks plain cached here); a retained block a request takes leaves
``_retained`` while in use and returns to it when freed if its hash is still pinned.

Sharing (prefix hits, ``fork``) is copy-on-write: a request about to write into a shared,
partially filled last block gets a private copy, returned as a (src, dst) pair for the model
runner to copy. The manager never mutates a request.

KV groups (``windows``, one per group of layers: tokenfleet.kvcache.layout.kv_groups): a request
has one table per group, all drawn from the one pool. A sliding-window group's table keeps only
the blocks its window still reaches from the next position to compute (``start``); the entries
before are the null block (block 0, reserved, never allocated), and the blocks they held are
released (cached ones stay in the prefix cache's LRU). A prefix hit must hold, in every
sliding-window group, the blocks the window reaches from the hit's end. One group with window 0
(a Llama) is the plain case: no null block, one table.

Slightly above 500 lines on purpose: the four states above and their moves must stay in one class
for ``check_invariants`` to see them; the retention bookkeeping that stands alone (which hashes are
pinned, by whom, until when) lives in ``engine.retention``.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import KeysView, Sequence
from dataclasses import dataclass

from tokenfleet.engine.retention import Retention
from tokenfleet.kvcache.layout import window_first_block

NULL_BLOCK = 0  # with sliding-window groups: what a table holds where the window no longer reaches


@dataclass(frozen=True)
class SlotAllocation:
    new_block_ids: list[int]
    copies: list[tuple[int, int]]  # (src, dst) block pairs to copy before the forward


_NOTHING_NEW = SlotAllocation(new_block_ids=[], copies=[])  # shared: callers only read allocations


class PrefixHit(list[int]):
    """A cached prefix: its block ids in the first group (a plain list of them), and ``tables``, the
    ids in every group (the null block where a sliding window no longer reaches the hit's end)."""

    tables: tuple[list[int], ...] = ()

class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, windows: Sequence[int] = (0,),
                 retention: Retention | None = None):
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError(f"num_blocks ({num_blocks}) and block_size ({block_size}) must be positive")
        if not windows or any(w < 0 for w in windows):
            raise ValueError(f"windows must be one non-negative window per KV group, got {windows}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.windows = tuple(windows)
        self._windowed = any(self.windows)
        self._null = NULL_BLOCK if self._windowed else -1  # -1: no null block (every id is a real block)
        first = 1 if self._windowed else 0
        if num_blocks <= first:
            raise ValueError(f"num_blocks ({num_blocks}) leaves no block besides the null block")
        self._ref_counts = [0] * num_blocks
        self._block_hash: list[bytes | None] = [None] * num_blocks
        self._block_group = [0] * num_blocks  # the group whose hash map names the block (when hashed)
        self._hash_to_block: list[dict[bytes, int]] = [{} for _ in self.windows]
        self._free_ids: deque[int] = deque(range(first, num_blocks))
        self._evictable: OrderedDict[int, None] = OrderedDict()
        self._retained: OrderedDict[int, None] = OrderedDict()  # evicted only when _evictable is empty
        self.retention = retention if retention is not None else Retention()
        self._prefetched: set[int] = set()  # cached blocks ``adopt`` installed that no request has taken yet
        self.num_retained_evicted = 0  # retained blocks evicted under pressure (demoted, with a second tier)
        self.num_prefetch_hits = 0  # adopted blocks a request then took
        self._tables: dict[str, list[list[int]]] = {}  # request -> one table per group
        self._num_slots: dict[str, int] = {}  # tokens each table covers
        self._num_hashed: dict[str, int] = {}  # leading blocks of each table already hashed
        self._num_dropped: dict[str, list[int]] = {}  # per group: leading entries that are the null block
        self.hash_version = 0  # bumped whenever the set of cached hashes changes
        # Second tier (engine.kv_tier): cached blocks evicted for reuse, (block, hash, owner), until the
        # engine copies them out (before anything writes the block again). Kept only when tracking.
        self.track_evictions = False
        self.evicted: list[tuple[int, bytes, str]] = []
        self._block_owner = [""] * num_blocks  # who computed a cached block (its tenant)

    # ---- queries ---------------------------------------------------------------------
    @property
    def capacity(self) -> int:
        """Blocks requests can hold (the null block excluded)."""
        return self.num_blocks - (1 if self._windowed else 0)

    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation can take now (free + evictable cached + retained)."""
        return len(self._free_ids) + len(self._evictable) + len(self._retained)

    @property
    def num_plain_free_blocks(self) -> int:
        """Blocks an allocation takes before any retained one (free + evictable cached)."""
        return len(self._free_ids) + len(self._evictable)

    @property
    def num_retained_idle_blocks(self) -> int:
        """Retained blocks no request holds now."""
        return len(self._retained)

    @property
    def num_used_blocks(self) -> int:
        return self.capacity - self.num_free_blocks

    @property
    def num_cached_blocks(self) -> int:
        """Blocks holding a prefix hash (in use or evictable), every group."""
        return sum(len(m) for m in self._hash_to_block)

    def block_table(self, request_id: str) -> list[int]:
        """The first group's table (every layer's, for a model of one group)."""
        tables = self._tables.get(request_id)
        return tables[0] if tables else []

    def block_tables(self, request_id: str) -> list[list[int]]:
        """One table per group."""
        return self._tables.get(request_id, [])

    def has_request(self, request_id: str) -> bool:
        return request_id in self._tables

    def ref_count(self, block_id: int) -> int:
        return self._ref_counts[block_id]

    def cached_hashes(self) -> set[bytes]:
        return set(self._hash_to_block[0])

    def cached_hash_view(self) -> KeysView[bytes]:
        """The first group's cached hashes, live and uncopied (read-only; for callers that test
        membership often). Full-attention groups come first: a hash here is a block whose KV is here."""
        return self._hash_to_block[0].keys()

    def cached_blocks(self) -> list[tuple[int, bytes, str]]:
        """The first group's cached blocks as (block id, hash, owner), least recently used first: the
        evictable ones in eviction order, then those requests hold now."""
        found = self._hash_to_block[0]
        idle = [b for b in (*self._evictable, *self._retained) if self._block_group[b] == 0 and self._block_hash[b] in found]
        held = set(idle)
        busy = [b for b in found.values() if b not in held]
        return [(b, self._block_hash[b] or b"", self._block_owner[b]) for b in idle + busy]

    def cached_block(self, block_hash: bytes) -> int | None:
        """The first group's block holding ``block_hash``, if cached (its KV is computed)."""
        return self._hash_to_block[0].get(block_hash)

    def blocks_for(self, num_tokens: int, max_chunk: int) -> int:
        """Most blocks one request of ``num_tokens`` tokens holds at once, computed in chunks of at
        most ``max_chunk`` tokens (sliding-window groups hold a window and a chunk)."""
        blocks = -(-num_tokens // self.block_size)
        held = 0
        for window in self.windows:
            held += blocks if not window else min(blocks, -(-(window + max_chunk) // self.block_size) + 1)
        return held

    def match_prefix(self, block_hashes: Sequence[bytes]) -> PrefixHit:
        """The longest cached prefix of ``block_hashes`` usable in every group; changes nothing."""
        maps = self._hash_to_block
        n = len(block_hashes)
        for g, window in enumerate(self.windows):
            if not window:
                for i in range(n):
                    if block_hashes[i] not in maps[g]:
                        n = i
                        break
        while True:  # shrink n until every sliding-window group holds what its window reaches from n
            miss = self._window_miss(block_hashes, n)
            if miss is None:
                break
            n = miss  # any longer hit whose window reaches the missing block misses too
        hit = PrefixHit(self._hit_ids(0, block_hashes, n))
        hit.tables = (hit, *(self._hit_ids(g, block_hashes, n) for g in range(1, len(self.windows))))
        return hit

    def _window_miss(self, block_hashes: Sequence[bytes], n: int) -> int | None:
        for g, window in enumerate(self.windows):
            if window:
                for i in range(window_first_block(n * self.block_size, window, self.block_size), n):
                    if block_hashes[i] not in self._hash_to_block[g]:
                        return i
        return None

    def _hit_ids(self, g: int, block_hashes: Sequence[bytes], n: int) -> list[int]:
        window, found = self.windows[g], self._hash_to_block[g]
        first = window_first_block(n * self.block_size, window, self.block_size)
        return [self._null] * first + [found[h] for h in block_hashes[first:n]]

    def blocks_needed(self, request_id: str, num_tokens: int, prefix_block_ids: Sequence[int] = (),
                      start: int | None = None) -> int:
        """Allocatable blocks that ``allocate_slots`` with the same arguments would consume (once the
        entries a window no longer reaches from ``start`` are dropped)."""
        tables = self._tables.get(request_id)
        prefix_tables = _prefix_tables(prefix_block_ids, len(self.windows))
        target = -(-num_tokens // self.block_size)
        needed = 0
        for g, window in enumerate(self.windows):
            covered = len(tables[g]) if tables else len(prefix_tables[g])
            first = window_first_block(start, window, self.block_size) if start is not None else 0
            needed += max(0, target - max(covered, first))
            needed += sum(1 for b in prefix_tables[g] if b != self._null and self._ref_counts[b] == 0)  # leave the LRU
        return needed + len(self._copies_needed(request_id, num_tokens))

    # ---- mutations ---------------------------------------------------------------------
    def allocate_slots(
        self, request_id: str, num_tokens: int, prefix_block_ids: Sequence[int] = (), start: int | None = None
    ) -> SlotAllocation | None:
        """Grow ``request_id``'s tables to cover ``num_tokens`` tokens; None (and no change but
        window drops) if short. ``start``: the first position the coming step computes; sliding-window
        groups drop (release) the blocks their window no longer reaches from it.

        ``prefix_block_ids`` (from ``match_prefix``) may be given only on a request's first
        allocation; they are shared, not copied.
        """
        tables = self._tables.get(request_id)
        if tables is not None and self._windowed and start is not None:
            self._drop_outside_window(request_id, start)
        if tables is not None and not prefix_block_ids and num_tokens <= len(tables[0]) * self.block_size \
                and not self._copies_needed(request_id, num_tokens):
            # Fast path (most decode steps): the tables cover the tokens and their last blocks are ours.
            if num_tokens > self._num_slots[request_id]:
                self._num_slots[request_id] = num_tokens
            return _NOTHING_NEW
        if prefix_block_ids and tables is not None:
            raise ValueError(f"prefix blocks given for {request_id}, which already has a table")
        if self.blocks_needed(request_id, num_tokens, prefix_block_ids, start) > self.num_free_blocks:
            return None
        prefix_tables = _prefix_tables(prefix_block_ids, len(self.windows))
        if tables is None:
            tables = self._tables[request_id] = [[] for _ in self.windows]
            for table, prefix in zip(tables, prefix_tables):
                for block_id in prefix:
                    if block_id != self._null:
                        self._take_ref(block_id)
                    table.append(block_id)
            self._num_hashed[request_id] = len(prefix_block_ids)
            self._num_slots[request_id] = len(prefix_block_ids) * self.block_size
            self._num_dropped[request_id] = [
                window_first_block(len(prefix_block_ids) * self.block_size, w, self.block_size) for w in self.windows]
        copies = []
        for g in self._copies_needed(request_id, num_tokens):
            table = tables[g]
            src = table[-1]
            dst = self._pop_free()
            self._release(src)
            table[-1] = dst
            copies.append((src, dst))
        target = -(-num_tokens // self.block_size)
        new_ids = []
        dropped = self._num_dropped[request_id]
        for g, window in enumerate(self.windows):
            table = tables[g]
            first = window_first_block(start, window, self.block_size) if start is not None else 0
            if len(table) < min(first, target):
                table.extend([self._null] * (min(first, target) - len(table)))  # never read: no block behind
                dropped[g] = len(table)
            fresh = [self._pop_free() for _ in range(target - len(table))]
            table.extend(fresh)
            new_ids += fresh
        self._num_slots[request_id] = max(self._num_slots[request_id], num_tokens)
        return SlotAllocation(new_block_ids=[b for _, b in copies] + new_ids, copies=copies)

    def take_evicted(self) -> list[tuple[int, bytes, str]]:
        """The cached blocks evicted since the last call: (block id, hash, owner). Their KV is still in
        the pool until something writes those blocks again."""
        evicted, self.evicted = self.evicted, []
        return evicted

    def cache_blocks(self, request_id: str, block_hashes: Sequence[bytes], owner: str = "") -> None:
        """Record hashes of the request's leading full blocks whose KV is now computed (``owner``: the
        tenant whose request computed them, for the second tier's quotas)."""
        tables = self._tables[request_id]
        start = self._num_hashed.get(request_id, 0)
        end = min(len(block_hashes), len(tables[0]))
        for g, table in enumerate(tables):
            found = self._hash_to_block[g]
            for i in range(start, end):
                block_id, h = table[i], block_hashes[i]
                if block_id != self._null and self._block_hash[block_id] is None and h not in found:
                    self._block_hash[block_id] = h
                    self._block_group[block_id] = g
                    self._block_owner[block_id] = owner
                    found[h] = block_id
                    self.hash_version += 1
                # else: the same content is already cached in another block; keep one copy.
        self._num_hashed[request_id] = max(start, end)

    def fork(self, parent_id: str, child_id: str) -> None:
        """Give ``child_id`` the parent's blocks, shared (ref counted), copy-on-write."""
        if child_id in self._tables:
            raise ValueError(f"{child_id} already has a block table")
        tables = [list(t) for t in self._tables[parent_id]]
        for table in tables:
            for block_id in table:
                if block_id != self._null:
                    self._ref_counts[block_id] += 1
        self._tables[child_id] = tables
        self._num_slots[child_id] = self._num_slots[parent_id]
        self._num_hashed[child_id] = self._num_hashed.get(parent_id, 0)
        self._num_dropped[child_id] = list(self._num_dropped[parent_id])

    def free(self, request_id: str) -> None:
        """Drop the request's tables. Hashed blocks go to the LRU tail first so they are evicted first."""
        tables = self._tables.pop(request_id, [])
        self._num_slots.pop(request_id, None)
        self._num_hashed.pop(request_id, None)
        self._num_dropped.pop(request_id, None)
        for table in tables:
            for block_id in reversed(table):
                if block_id != self._null:
                    self._release(block_id)

    def trim(self, request_id: str, num_tokens: int) -> None:
        """Shrink the request's tables to cover ``num_tokens`` tokens: the blocks past them go back (speculative
        verification allocated slots for proposed tokens that were rejected). Never below its hashed blocks."""
        tables = self._tables.get(request_id)
        if tables is None or num_tokens >= self._num_slots[request_id]:
            return
        keep = max(-(-num_tokens // self.block_size), self._num_hashed.get(request_id, 0))
        for table in tables:
            while len(table) > keep:
                block_id = table.pop()
                if block_id != self._null:
                    self._release(block_id)
        self._num_slots[request_id] = num_tokens if keep == -(-num_tokens // self.block_size) else keep * self.block_size

    def reset_prefix_cache(self) -> None:
        """Evict every cached block that no request uses (retained ones too; their pins stay)."""
        for lru in (self._evictable, self._retained):
            while lru:
                block_id, _ = lru.popitem(last=False)
                self._forget_hash(block_id)
                self._free_ids.append(block_id)

    # ---- retention (engine.retention) ----------------------------------------------------
    def retain(self, key: str, owner: str, block_hashes: Sequence[bytes], now: float, seconds: float) -> None:
        """Keep the blocks of ``block_hashes`` (a finished request's full blocks, prompt and output) above plain
        LRU under ``key`` (its conversation) until ``now + seconds`` (clamped by the retention's pool maximum; the
        second tier ranks them for longer: ``Retention.pin``), replacing ``key``'s earlier retention. Call after
        the request's blocks were freed."""
        self._restack(self.retention.pin(key, owner, block_hashes, now, seconds))

    def release(self, key: str) -> int:
        """End ``key``'s retention now, for the pool and the tier: its blocks go back to plain LRU (unless another
        conversation retains them). Returns how many blocks it retained (0: unknown or already ended)."""
        pin, changed = self.retention.unpin(key)
        self._restack(changed)
        return len(pin.hashes) if pin is not None else 0

    def expire(self, now: float) -> int:
        """Pass the retention horizons that are due: blocks past their pool horizon go to the oldest end of the
        plain LRU. Returns how many retentions ended altogether (past their tier horizon too)."""
        expired, changed = self.retention.expire(now)
        self._restack(changed)
        return expired

    def adopt(self, blocks: Sequence[tuple[bytes, str]]) -> list[tuple[int, bytes]]:
        """Blocks for cached content arriving from outside (a prefetch from the second tier): one per (hash,
        owner) not cached yet, taken from free or plain cached blocks only (never a retained one), ref 0,
        hashed in the first group. Returns (block id, hash) pairs, in order; the caller installs their K/V
        before any step can read them. Stops early when only retained blocks are left."""
        ids = []
        for h, owner in blocks:
            if not self.num_plain_free_blocks:
                break
            if h in self._hash_to_block[0]:
                continue
            block_id = self._pop_free()
            self._ref_counts[block_id] = 0
            self._block_hash[block_id], self._block_group[block_id], self._block_owner[block_id] = h, 0, owner
            self._hash_to_block[0][h] = block_id
            self.hash_version += 1
            (self._retained if h in self.retention else self._evictable)[block_id] = None
            self._prefetched.add(block_id)
            ids.append((block_id, h))
        return ids

    def _restack(self, changed: Sequence[bytes]) -> None:
        """Move the idle blocks of hashes whose pinned state changed to the LRU they now belong to: newly pinned
        ones to ``_retained`` (tail blocks first: evicted first, as ``free`` orders them), unpinned ones to the
        oldest end of ``_evictable`` (a conversation released or not back in time is the least likely prefix)."""
        idle = [b for h in changed for found in self._hash_to_block
                if (b := found.get(h)) is not None and not self._ref_counts[b]]
        for block_id in reversed(idle):  # appended at the newest end: the tail first
            if block_id in self._evictable and self._block_hash[block_id] in self.retention:
                del self._evictable[block_id]
                self._retained[block_id] = None
        for block_id in idle:  # moved to the oldest end one by one: the tail ends first
            if block_id in self._retained and self._block_hash[block_id] not in self.retention:
                del self._retained[block_id]
                self._evictable[block_id] = None
                self._evictable.move_to_end(block_id, last=False)

    # ---- internals ---------------------------------------------------------------------
    def _drop_outside_window(self, request_id: str, start: int) -> None:
        """Release the blocks sliding-window groups no longer reach from ``start`` (the null block
        takes their place); cached ones stay in the prefix cache until evicted."""
        tables, dropped = self._tables[request_id], self._num_dropped[request_id]
        for g, window in enumerate(self.windows):
            if window:
                table = tables[g]
                limit = min(len(table), window_first_block(start, window, self.block_size))
                for i in range(dropped[g], limit):
                    if table[i] != self._null:
                        self._release(table[i])
                        table[i] = self._null
                dropped[g] = max(dropped[g], limit)

    def _copies_needed(self, request_id: str, num_tokens: int) -> list[int]:
        """Groups whose partial last block is shared and about to be written (copy-on-write)."""
        tables = self._tables.get(request_id)
        if not tables:
            return []
        covered = self._num_slots.get(request_id, 0)
        if covered % self.block_size == 0 or num_tokens <= covered:
            return []
        return [g for g, table in enumerate(tables) if table[-1] != self._null and self._ref_counts[table[-1]] > 1]

    def _take_ref(self, block_id: int) -> None:
        if self._ref_counts[block_id] == 0:
            if block_id in self._evictable:
                del self._evictable[block_id]
            else:
                del self._retained[block_id]
            if block_id in self._prefetched:
                self._prefetched.discard(block_id)
                self.num_prefetch_hits += 1
        self._ref_counts[block_id] += 1

    def _release(self, block_id: int) -> None:
        self._ref_counts[block_id] -= 1
        if self._ref_counts[block_id] == 0:
            h = self._block_hash[block_id]
            if h is None:
                self._free_ids.append(block_id)
            else:
                (self._retained if h in self.retention else self._evictable)[block_id] = None

    def _pop_free(self) -> int:
        if self._free_ids:
            block_id = self._free_ids.popleft()
        else:
            if self._evictable:
                block_id, _ = self._evictable.popitem(last=False)
            else:  # only retained blocks are left: a running or arriving request is never refused for them
                block_id, _ = self._retained.popitem(last=False)
                self.num_retained_evicted += 1
            h = self._block_hash[block_id]
            if self.track_evictions and h is not None:
                self.evicted.append((block_id, h, self._block_owner[block_id]))
            self._forget_hash(block_id)
        self._ref_counts[block_id] = 1
        return block_id

    def _forget_hash(self, block_id: int) -> None:
        h = self._block_hash[block_id]
        if h is not None:
            del self._hash_to_block[self._block_group[block_id]][h]
            self._block_hash[block_id] = None
            self._prefetched.discard(block_id)
            self.hash_version += 1

    def check_invariants(self) -> None:
        """Raise ``InvariantError`` if the bookkeeping is inconsistent. For tests and debugging."""
        refs = [0] * self.num_blocks
        for request_id, tables in self._tables.items():
            _check(len(tables) == len(self.windows), f"{request_id}: {len(tables)} tables for {len(self.windows)} groups")
            expected = -(-self._num_slots.get(request_id, 0) // self.block_size)
            for table in tables:
                for block_id in table:
                    if block_id != self._null:
                        refs[block_id] += 1
                _check(len(table) == expected, f"{request_id}: {len(table)} blocks for {expected}")
        _check(refs == self._ref_counts, "ref counts disagree with block tables")
        free = set(self._free_ids)
        _check(len(free) == len(self._free_ids), "duplicate in free list")
        _check(not free & set(self._evictable), "block both free and evictable")
        _check(not (free | set(self._evictable)) & set(self._retained), "block both retained and free or evictable")
        problem = self.retention.problem()
        _check(problem is None, f"retention: {problem}")
        for block_id in range(self.num_blocks):
            h, ref = self._block_hash[block_id], self._ref_counts[block_id]
            in_free, in_lru, in_kept = block_id in free, block_id in self._evictable, block_id in self._retained
            if block_id == self._null:
                _check(not in_free and not in_lru and not in_kept and h is None, "the null block is allocatable or hashed")
                continue
            if ref > 0:
                _check(not in_free and not in_lru and not in_kept, f"block {block_id} in use and free")
            else:
                _check(in_free + in_lru + in_kept == 1, f"block {block_id} lost (ref 0, in no list) or in two")
                _check(in_free == (h is None), f"block {block_id}: hash/list mismatch")
                _check(in_kept == (h is not None and h in self.retention), f"block {block_id}: retained/pin mismatch")
            _check(block_id not in self._prefetched or (h is not None and ref == 0),
                   f"block {block_id}: prefetched yet uncached or in use")
            if h is not None:
                found = self._hash_to_block[self._block_group[block_id]]
                _check(found.get(h) == block_id, f"block {block_id}: hash map mismatch")
        _check(self.num_cached_blocks == sum(h is not None for h in self._block_hash), "stale hash entries")


def _prefix_tables(prefix: Sequence[int], num_groups: int) -> tuple[Sequence[int], ...]:
    tables = getattr(prefix, "tables", ())
    if tables:
        return tables
    if num_groups > 1 and prefix:
        raise ValueError("a prefix for several KV groups must come from match_prefix")
    return (prefix,) * num_groups if num_groups == 1 else tuple([] for _ in range(num_groups))


class InvariantError(AssertionError):
    """The block manager's bookkeeping is inconsistent (a bug, never a user error)."""


def _check(condition: bool, message: str) -> None:
    if not condition:
        raise InvariantError(message)
