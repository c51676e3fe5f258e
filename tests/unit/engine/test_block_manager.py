from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from tokenfleet.engine.block_manager import NULL_BLOCK, BlockManager, InvariantError
from tokenfleet.kvcache.block_hash import hash_blocks, root_hash
from tokenfleet.kvcache.layout import window_first_block


def test_allocate_takes_blocks_in_free_list_order():
    bm = BlockManager(num_blocks=8, block_size=4)
    a = bm.allocate_slots("a", 5)
    assert a is not None and a.new_block_ids == [0, 1] and a.copies == []
    b = bm.allocate_slots("b", 4)
    assert b is not None and b.new_block_ids == [2]
    assert bm.block_table("a") == [0, 1]
    assert (bm.num_used_blocks, bm.num_free_blocks) == (3, 5)
    bm.check_invariants()


def test_growing_a_table_allocates_only_on_block_boundaries():
    bm = BlockManager(num_blocks=8, block_size=4)
    bm.allocate_slots("a", 3)
    grown = bm.allocate_slots("a", 4)
    assert grown is not None and grown.new_block_ids == []
    grown = bm.allocate_slots("a", 5)
    assert grown is not None and grown.new_block_ids == [1]
    assert bm.block_table("a") == [0, 1]
    bm.check_invariants()


def test_allocation_that_does_not_fit_changes_nothing():
    bm = BlockManager(num_blocks=3, block_size=4)
    bm.allocate_slots("a", 8)
    assert bm.allocate_slots("b", 8) is None
    assert not bm.has_request("b")
    assert bm.num_free_blocks == 1
    bm.check_invariants()


def test_free_returns_uncached_blocks_to_the_free_list_tail():
    bm = BlockManager(num_blocks=4, block_size=4)
    bm.allocate_slots("a", 8)  # blocks 0, 1
    bm.free("a")
    assert list(bm._free_ids) == [2, 3, 1, 0]
    assert bm.num_free_blocks == 4
    bm.check_invariants()


def test_cached_blocks_survive_free_and_are_matched_by_hash():
    bm = BlockManager(num_blocks=8, block_size=4)
    tokens = list(range(10))
    hashes = hash_blocks(tokens, 4, "salt")
    assert len(hashes) == 2
    bm.allocate_slots("a", 10)
    bm.cache_blocks("a", hashes)
    bm.free("a")
    assert bm.num_cached_blocks == 2
    assert bm.match_prefix(hashes) == [0, 1]
    hit = bm.allocate_slots("b", 10, prefix_block_ids=[0, 1])
    assert hit is not None and hit.new_block_ids == [3]  # block 2 was freed last -> tail of free list
    assert bm.block_table("b") == [0, 1, 3]
    assert bm.ref_count(0) == 1
    bm.check_invariants()


def test_shared_prefix_blocks_are_ref_counted():
    bm = BlockManager(num_blocks=8, block_size=4)
    hashes = hash_blocks(list(range(8)), 4, "s")
    bm.allocate_slots("a", 9)
    bm.cache_blocks("a", hashes)
    bm.allocate_slots("b", 9, prefix_block_ids=bm.match_prefix(hashes))
    assert bm.ref_count(0) == 2 and bm.ref_count(1) == 2
    assert bm.num_used_blocks == 4
    bm.free("a")
    assert bm.ref_count(0) == 1 and bm.num_used_blocks == 3
    bm.check_invariants()


def test_eviction_takes_free_blocks_first_then_least_recently_used():
    bm = BlockManager(num_blocks=4, block_size=2)
    for rid, base in (("a", 0), ("b", 100)):
        bm.allocate_slots(rid, 2)
        bm.cache_blocks(rid, hash_blocks([base, base + 1], 2, "s"))
    bm.free("a")  # block 0 cached, older
    bm.free("b")  # block 1 cached, newer
    got = bm.allocate_slots("c", 6)
    assert got is not None and got.new_block_ids == [2, 3, 0]  # free ones, then the LRU cached block
    assert bm.match_prefix(hash_blocks([0, 1], 2, "s")) == []
    assert bm.match_prefix(hash_blocks([100, 101], 2, "s")) == [1]
    bm.check_invariants()


def test_fork_shares_blocks_and_copies_a_shared_partial_block_on_write():
    bm = BlockManager(num_blocks=8, block_size=4)
    bm.allocate_slots("p", 6)  # blocks 0 (full), 1 (2 of 4 tokens)
    bm.fork("p", "c")
    assert bm.block_table("c") == [0, 1] and bm.ref_count(1) == 2
    grown = bm.allocate_slots("c", 7)
    assert grown is not None and grown.copies == [(1, 2)] and grown.new_block_ids == [2]
    assert bm.block_table("c") == [0, 2]
    assert bm.ref_count(1) == 1 and bm.ref_count(0) == 2
    again = bm.allocate_slots("p", 7)  # parent is now the only owner of block 1: no copy
    assert again is not None and again.copies == []
    bm.check_invariants()


def test_duplicate_content_is_cached_once():
    bm = BlockManager(num_blocks=8, block_size=2)
    h = hash_blocks([5, 6], 2, "s")
    bm.allocate_slots("a", 2)
    bm.allocate_slots("b", 2)
    bm.cache_blocks("a", h)
    bm.cache_blocks("b", h)
    assert bm.num_cached_blocks == 1
    bm.free("a")
    bm.free("b")
    assert bm.num_cached_blocks == 1
    bm.check_invariants()


def test_hash_chain_is_stable_and_salted():
    assert root_hash("m") != root_hash("n")
    a = hash_blocks([1, 2, 3, 4, 5, 6, 7, 8], 4, "m")
    b = hash_blocks([1, 2, 3, 4, 9, 9, 9, 9], 4, "m")
    assert a[0] == b[0] and a[1] != b[1]
    assert hash_blocks([1, 2, 3, 4, 5, 6, 7, 8, 9], 4, "m", a[:1]) == a
    # Pinned: routers and other processes must compute exactly this value.
    assert a[0].hex() == "9bbf346c26ca145e71d6aed8626d0b7e"


def test_check_invariants_detects_corruption():
    bm = BlockManager(num_blocks=4, block_size=4)
    bm.allocate_slots("a", 4)
    bm._ref_counts[0] = 2
    with pytest.raises(InvariantError):
        bm.check_invariants()


def test_invalid_sizes_rejected():
    with pytest.raises(ValueError):
        BlockManager(num_blocks=0, block_size=4)


class BlockManagerMachine(RuleBasedStateMachine):
    """Random allocate / grow / cache / fork / free / evict sequences keep every invariant."""

    def __init__(self) -> None:
        super().__init__()
        self.bm = BlockManager(num_blocks=12, block_size=2)
        self.tokens: dict[str, list[int]] = {}
        self.next_id = 0

    @rule(length=st.integers(1, 9), alphabet=st.integers(1, 3), use_prefix=st.booleans())
    def allocate(self, length: int, alphabet: int, use_prefix: bool) -> None:
        tokens = [i % alphabet for i in range(length)]
        rid = f"r{self.next_id}"
        self.next_id += 1
        hashes = hash_blocks(tokens, 2, "h")
        prefix = self.bm.match_prefix(hashes[: (length - 1) // 2]) if use_prefix else []
        if self.bm.allocate_slots(rid, length, prefix) is not None:
            self.tokens[rid] = tokens
            self.bm.cache_blocks(rid, hashes)

    @precondition(lambda self: self.tokens)
    @rule(data=st.data(), extra=st.integers(1, 3))
    def grow(self, data: st.DataObject, extra: int) -> None:
        rid = data.draw(st.sampled_from(sorted(self.tokens)))
        tokens = self.tokens[rid] + [7] * extra
        if self.bm.allocate_slots(rid, len(tokens)) is not None:
            self.tokens[rid] = tokens
            self.bm.cache_blocks(rid, hash_blocks(tokens, 2, "h"))

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def fork(self, data: st.DataObject) -> None:
        rid = data.draw(st.sampled_from(sorted(self.tokens)))
        child = f"r{self.next_id}"
        self.next_id += 1
        self.bm.fork(rid, child)
        self.tokens[child] = list(self.tokens[rid])

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        rid = data.draw(st.sampled_from(sorted(self.tokens)))
        self.bm.free(rid)
        del self.tokens[rid]

    @rule()
    def evict_all(self) -> None:
        self.bm.reset_prefix_cache()

    @invariant()
    def consistent(self) -> None:
        self.bm.check_invariants()
        used = {b for rid in self.tokens for b in self.bm.block_table(rid)}
        assert self.bm.num_used_blocks == len(used)


BlockManagerMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
TestBlockManagerMachine = BlockManagerMachine.TestCase


class WindowedBlockManagerMachine(RuleBasedStateMachine):
    """The same with a full-attention group and two sliding-window groups: every invariant holds, each
    window table keeps every block its window reaches from the last step's start (and only those
    blocks plus the step's own), and prefix hits hold the window's blocks in every group."""

    WINDOW = 3

    def __init__(self) -> None:
        super().__init__()
        self.bm = BlockManager(num_blocks=30, block_size=2, windows=(0, self.WINDOW, self.WINDOW))
        self.tokens: dict[str, list[int]] = {}
        self.starts: dict[str, int] = {}
        self.next_id = 0

    @rule(length=st.integers(1, 9), alphabet=st.integers(1, 3), use_prefix=st.booleans())
    def allocate(self, length: int, alphabet: int, use_prefix: bool) -> None:
        tokens = [i % alphabet for i in range(length)]
        rid = f"r{self.next_id}"
        self.next_id += 1
        hashes = hash_blocks(tokens, 2, "h")
        prefix = self.bm.match_prefix(hashes[: (length - 1) // 2]) if use_prefix else []
        if prefix:
            assert all(len(t) == len(prefix) for t in prefix.tables)
        start = len(prefix) * 2
        if self.bm.allocate_slots(rid, length, prefix, start=start) is not None:
            self.tokens[rid], self.starts[rid] = tokens, start
            self.bm.cache_blocks(rid, hashes)

    @precondition(lambda self: self.tokens)
    @rule(data=st.data(), extra=st.integers(1, 3))
    def grow(self, data: st.DataObject, extra: int) -> None:
        rid = data.draw(st.sampled_from(sorted(self.tokens)))
        start = len(self.tokens[rid])
        tokens = self.tokens[rid] + [7] * extra
        self.starts[rid] = start  # a refused allocation still drops what the window left behind
        if self.bm.allocate_slots(rid, len(tokens), start=start) is not None:
            self.tokens[rid] = tokens
            self.bm.cache_blocks(rid, hash_blocks(tokens, 2, "h"))

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def fork(self, data: st.DataObject) -> None:
        rid = data.draw(st.sampled_from(sorted(self.tokens)))
        child = f"r{self.next_id}"
        self.next_id += 1
        self.bm.fork(rid, child)
        self.tokens[child], self.starts[child] = list(self.tokens[rid]), self.starts[rid]

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        rid = data.draw(st.sampled_from(sorted(self.tokens)))
        self.bm.free(rid)
        del self.tokens[rid], self.starts[rid]

    @rule()
    def evict_all(self) -> None:
        self.bm.reset_prefix_cache()

    @invariant()
    def consistent(self) -> None:
        self.bm.check_invariants()
        used = {b for rid in self.tokens for t in self.bm.block_tables(rid) for b in t if b != NULL_BLOCK}
        assert self.bm.num_used_blocks == len(used)
        for rid in self.tokens:
            full, *windowed = self.bm.block_tables(rid)
            assert NULL_BLOCK not in full
            first = window_first_block(self.starts[rid], self.WINDOW, 2)
            for table in windowed:
                assert NULL_BLOCK not in table[first:]  # the window's blocks are there
                assert set(table[:first]) <= {NULL_BLOCK}  # and nothing before it is held


WindowedBlockManagerMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
TestWindowedBlockManagerMachine = WindowedBlockManagerMachine.TestCase
