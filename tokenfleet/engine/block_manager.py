"""KV block manager: integers only (free list, ref counts, hash -> block, LRU of cached blocks).

Every block is in exactly one of three states:

    free       ref 0, no hash     in ``_free_ids`` (FIFO)
    cached     ref 0, has hash    in ``_evictable`` (LRU: oldest first) = the prefix cache
    in use     ref > 0            in one or more block tables

Allocation takes free blocks first and evicts the least recently used cached block only when
none is left, so allocation never fails while any block has ref 0 (no fragmentation: blocks
are interchangeable). Sharing (prefix hits, ``fork``) is copy-on-write: a request about to
write into a shared, partially filled last block gets a private copy, returned as a
(src, dst) pair for the model runner to copy. The manager never mutates a request.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import KeysView, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class SlotAllocation:
    new_block_ids: list[int]
    copies: list[tuple[int, int]]  # (src, dst) block pairs to copy before the forward


_NOTHING_NEW = SlotAllocation(new_block_ids=[], copies=[])  # shared: callers only read allocations


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError(f"num_blocks ({num_blocks}) and block_size ({block_size}) must be positive")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._ref_counts = [0] * num_blocks
        self._block_hash: list[bytes | None] = [None] * num_blocks
        self._hash_to_block: dict[bytes, int] = {}
        self._free_ids: deque[int] = deque(range(num_blocks))
        self._evictable: OrderedDict[int, None] = OrderedDict()
        self._tables: dict[str, list[int]] = {}
        self._num_slots: dict[str, int] = {}  # tokens each table covers
        self._num_hashed: dict[str, int] = {}  # leading blocks of each table already hashed
        self.hash_version = 0  # bumped whenever the set of cached hashes changes

    # ---- queries ---------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation can take now (free + evictable cached)."""
        return len(self._free_ids) + len(self._evictable)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    @property
    def num_cached_blocks(self) -> int:
        """Blocks holding a prefix hash (in use or evictable)."""
        return len(self._hash_to_block)

    def block_table(self, request_id: str) -> list[int]:
        return self._tables.get(request_id, [])

    def has_request(self, request_id: str) -> bool:
        return request_id in self._tables

    def ref_count(self, block_id: int) -> int:
        return self._ref_counts[block_id]

    def cached_hashes(self) -> set[bytes]:
        return set(self._hash_to_block)

    def cached_hash_view(self) -> KeysView[bytes]:
        """The cached hashes, live and uncopied (read-only; for callers that test membership often)."""
        return self._hash_to_block.keys()

    def match_prefix(self, block_hashes: Sequence[bytes]) -> list[int]:
        """Block ids of the longest cached prefix of ``block_hashes``; changes nothing."""
        hits = []
        for h in block_hashes:
            block_id = self._hash_to_block.get(h)
            if block_id is None:
                break
            hits.append(block_id)
        return hits

    def blocks_needed(self, request_id: str, num_tokens: int, prefix_block_ids: Sequence[int] = ()) -> int:
        """Allocatable blocks that ``allocate_slots`` with the same arguments would consume."""
        table = self._tables.get(request_id, [])
        covered = len(table) + len(prefix_block_ids)
        needed = max(0, -(-num_tokens // self.block_size) - covered)
        needed += sum(1 for b in prefix_block_ids if self._ref_counts[b] == 0)  # leave the LRU
        return needed + (1 if self._needs_copy(request_id, num_tokens) else 0)

    # ---- mutations ---------------------------------------------------------------------
    def allocate_slots(
        self, request_id: str, num_tokens: int, prefix_block_ids: Sequence[int] = ()
    ) -> SlotAllocation | None:
        """Grow ``request_id``'s table to cover ``num_tokens`` tokens; None (and no change) if short.

        ``prefix_block_ids`` (from ``match_prefix``) may be given only on a request's first
        allocation; they are shared, not copied.
        """
        table = self._tables.get(request_id)
        if table is not None and not prefix_block_ids and num_tokens <= len(table) * self.block_size \
                and not self._needs_copy(request_id, num_tokens):
            # Fast path (most decode steps): the table covers the tokens and its last block is ours.
            if num_tokens > self._num_slots[request_id]:
                self._num_slots[request_id] = num_tokens
            return _NOTHING_NEW
        if prefix_block_ids and table is not None:
            raise ValueError(f"prefix blocks given for {request_id}, which already has a table")
        if self.blocks_needed(request_id, num_tokens, prefix_block_ids) > self.num_free_blocks:
            return None
        table = self._tables.setdefault(request_id, [])
        for block_id in prefix_block_ids:
            self._take_ref(block_id)
            table.append(block_id)
        if prefix_block_ids:
            self._num_hashed[request_id] = len(prefix_block_ids)
        copies = []
        if self._needs_copy(request_id, num_tokens):
            src = table[-1]
            dst = self._pop_free()
            self._release(src)
            table[-1] = dst
            copies.append((src, dst))
        new_ids = [self._pop_free() for _ in range(-(-num_tokens // self.block_size) - len(table))]
        table.extend(new_ids)
        self._num_slots[request_id] = max(self._num_slots.get(request_id, 0), num_tokens)
        self._num_slots[request_id] = max(self._num_slots[request_id], len(prefix_block_ids) * self.block_size)
        return SlotAllocation(new_block_ids=[b for _, b in copies] + new_ids, copies=copies)

    def cache_blocks(self, request_id: str, block_hashes: Sequence[bytes]) -> None:
        """Record hashes of the request's leading full blocks whose KV is now computed."""
        table = self._tables[request_id]
        start = self._num_hashed.get(request_id, 0)
        end = min(len(block_hashes), len(table))
        for i in range(start, end):
            block_id, h = table[i], block_hashes[i]
            if self._block_hash[block_id] is None and h not in self._hash_to_block:
                self._block_hash[block_id] = h
                self._hash_to_block[h] = block_id
                self.hash_version += 1
            # else: the same content is already cached in another block; keep one copy.
        self._num_hashed[request_id] = max(start, end)

    def fork(self, parent_id: str, child_id: str) -> None:
        """Give ``child_id`` the parent's blocks, shared (ref counted), copy-on-write."""
        if child_id in self._tables:
            raise ValueError(f"{child_id} already has a block table")
        table = list(self._tables[parent_id])
        for block_id in table:
            self._ref_counts[block_id] += 1
        self._tables[child_id] = table
        self._num_slots[child_id] = self._num_slots[parent_id]
        self._num_hashed[child_id] = self._num_hashed.get(parent_id, 0)

    def free(self, request_id: str) -> None:
        """Drop the request's table. Hashed blocks go to the LRU tail first so they are evicted first."""
        table = self._tables.pop(request_id, [])
        self._num_slots.pop(request_id, None)
        self._num_hashed.pop(request_id, None)
        for block_id in reversed(table):
            self._release(block_id)

    def reset_prefix_cache(self) -> None:
        """Evict every cached block that no request uses."""
        while self._evictable:
            block_id, _ = self._evictable.popitem(last=False)
            self._forget_hash(block_id)
            self._free_ids.append(block_id)

    # ---- internals ---------------------------------------------------------------------
    def _needs_copy(self, request_id: str, num_tokens: int) -> bool:
        table = self._tables.get(request_id)
        if not table:
            return False
        covered = self._num_slots.get(request_id, 0)
        partial = covered % self.block_size != 0
        return partial and num_tokens > covered and self._ref_counts[table[-1]] > 1

    def _take_ref(self, block_id: int) -> None:
        if self._ref_counts[block_id] == 0:
            del self._evictable[block_id]
        self._ref_counts[block_id] += 1

    def _release(self, block_id: int) -> None:
        self._ref_counts[block_id] -= 1
        if self._ref_counts[block_id] == 0:
            if self._block_hash[block_id] is not None:
                self._evictable[block_id] = None
            else:
                self._free_ids.append(block_id)

    def _pop_free(self) -> int:
        if self._free_ids:
            block_id = self._free_ids.popleft()
        else:
            block_id, _ = self._evictable.popitem(last=False)
            self._forget_hash(block_id)
        self._ref_counts[block_id] = 1
        return block_id

    def _forget_hash(self, block_id: int) -> None:
        h = self._block_hash[block_id]
        if h is not None:
            del self._hash_to_block[h]
            self._block_hash[block_id] = None
            self.hash_version += 1

    def check_invariants(self) -> None:
        """Raise ``InvariantError`` if the bookkeeping is inconsistent. For tests and debugging."""
        refs = [0] * self.num_blocks
        for request_id, table in self._tables.items():
            for block_id in table:
                refs[block_id] += 1
            expected = -(-self._num_slots.get(request_id, 0) // self.block_size)
            _check(len(table) == expected, f"{request_id}: {len(table)} blocks for {expected}")
        _check(refs == self._ref_counts, "ref counts disagree with block tables")
        free = set(self._free_ids)
        _check(len(free) == len(self._free_ids), "duplicate in free list")
        _check(not free & set(self._evictable), "block both free and evictable")
        for block_id in range(self.num_blocks):
            h, ref = self._block_hash[block_id], self._ref_counts[block_id]
            in_free, in_lru = block_id in free, block_id in self._evictable
            if ref > 0:
                _check(not in_free and not in_lru, f"block {block_id} in use and free")
            else:
                _check(in_free != in_lru, f"block {block_id} lost (ref 0, in no list)")
                _check(in_lru == (h is not None), f"block {block_id}: hash/list mismatch")
            if h is not None:
                _check(self._hash_to_block.get(h) == block_id, f"block {block_id}: hash map mismatch")
        _check(len(self._hash_to_block) == sum(h is not None for h in self._block_hash), "stale hash entries")


class InvariantError(AssertionError):
    """The block manager's bookkeeping is inconsistent (a bug, never a user error)."""


def _check(condition: bool, message: str) -> None:
    if not condition:
        raise InvariantError(message)
