"""Retention in the block manager (engine.retention): retained blocks are evicted only after the plain LRU, a
full pool still serves every request by evicting them, and release, expiry, quotas and re-retention move
exactly the blocks they should. A day-long retention holds the pool only for the pool's window, then the second
tier alone (its eviction order and prefetch) until its tier horizon. Block ids and LRU orders are asserted
exactly; invariants after each step."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from tokenfleet.engine.block_manager import BlockManager
from tokenfleet.engine.kv_store import MemoryStore
from tokenfleet.engine.kv_tier import SecondTier
from tokenfleet.engine.prefetch import Prefetcher
from tokenfleet.engine.retention import Retention
from tokenfleet.kvcache.block_hash import hash_blocks


def finish(bm: BlockManager, request_id: str, tokens: list[int], salt: str = "s") -> list[bytes]:
    """Run a request through the pool: allocate, cache its full blocks, free. Returns its block hashes."""
    hashes = hash_blocks(tokens, bm.block_size, salt)
    prefix = bm.match_prefix(hashes[: (len(tokens) - 1) // bm.block_size])
    assert bm.allocate_slots(request_id, len(tokens), prefix) is not None
    bm.cache_blocks(request_id, hashes)
    bm.free(request_id)
    return hashes


def blocks_of(bm: BlockManager, hashes: list[bytes]) -> list[int | None]:
    return [bm.cached_block(h) for h in hashes]


def test_retained_blocks_are_evicted_only_after_the_plain_lru():
    bm = BlockManager(num_blocks=4, block_size=2)
    kept = finish(bm, "a", [1, 2, 3, 4])  # blocks 0, 1
    bm.retain("conv", "t", kept, now=0.0, seconds=10)
    plain = finish(bm, "b", [5, 6, 7, 8])  # blocks 2, 3: plain LRU
    assert (bm.num_free_blocks, bm.num_plain_free_blocks, bm.num_retained_idle_blocks) == (4, 2, 2)
    got = bm.allocate_slots("c", 4)  # takes the plain cached blocks, tail first
    assert got is not None and got.new_block_ids == [3, 2]
    assert blocks_of(bm, kept) == [0, 1] and blocks_of(bm, plain) == [None, None]
    bm.check_invariants()


def test_a_full_pool_of_retained_blocks_never_refuses_a_request():
    bm = BlockManager(num_blocks=4, block_size=2)
    bm.track_evictions = True
    kept = finish(bm, "a", list(range(8)))  # every block retained
    bm.retain("conv", "t", kept, now=0.0, seconds=10)
    assert bm.num_free_blocks == 4 and bm.num_plain_free_blocks == 0
    got = bm.allocate_slots("b", 6, start=0)  # a new prompt of 3 blocks: three retained blocks go, tail first
    assert got is not None and got.new_block_ids == [3, 2, 1]
    assert [block for block, _, _ in bm.take_evicted()] == [3, 2, 1]  # reported: a second tier demotes them
    assert bm.num_retained_evicted == 3
    assert bm.blocks_needed("b", 8) == 1 and bm.allocate_slots("b", 8) is not None  # and it grows into the last
    assert blocks_of(bm, kept) == [None] * 4
    bm.check_invariants()


def test_a_retained_block_taken_by_a_request_returns_to_the_retained_lru_when_freed():
    bm = BlockManager(num_blocks=6, block_size=2)
    kept = finish(bm, "a", [1, 2, 3, 4, 5])
    bm.retain("conv", "t", kept, now=0.0, seconds=10)
    hit = bm.match_prefix(kept)
    assert list(hit) == [0, 1]
    bm.allocate_slots("b", 6, hit)  # the next turn: a prefix hit on the retained blocks
    assert bm.num_retained_idle_blocks == 0 and bm.ref_count(0) == 1
    bm.check_invariants()
    bm.free("b")
    assert list(bm._retained) == [1, 0]  # back, still retained (tail block evicted first)
    bm.expire(now=10.0)
    assert bm.num_retained_idle_blocks == 0 and list(bm._evictable)[:2] == [1, 0]
    bm.check_invariants()


def test_release_returns_the_blocks_to_the_oldest_end_of_the_plain_lru():
    bm = BlockManager(num_blocks=6, block_size=2)
    plain = finish(bm, "p", [9, 9, 9])  # block 0, plain
    kept = finish(bm, "a", [1, 2, 3, 4])  # blocks 1, 2
    bm.retain("conv", "t", kept, now=0.0, seconds=10)
    assert bm.release("conv") == 2
    assert bm.release("conv") == 0  # already released
    first, second = blocks_of(bm, kept)
    assert list(bm._evictable) == [second, first, bm.cached_block(plain[0])]
    assert bm.num_retained_idle_blocks == 0
    bm.check_invariants()


def test_expiry_ends_only_the_retentions_whose_deadline_passed():
    bm = BlockManager(num_blocks=8, block_size=2)
    early = finish(bm, "a", [1, 2])
    late = finish(bm, "b", [3, 4])
    bm.retain("early", "t", early, now=0.0, seconds=5)
    bm.retain("late", "t", late, now=0.0, seconds=50)
    assert bm.expire(now=4.9) == 0
    assert bm.expire(now=5.0) == 1
    assert bm.cached_block(early[0]) in bm._evictable and bm.cached_block(late[0]) in bm._retained
    assert bm.expire(now=100.0) == 1 and bm.num_retained_idle_blocks == 0
    bm.check_invariants()


def test_retention_is_clamped_to_the_maximum():
    bm = BlockManager(num_blocks=4, block_size=2, retention=Retention(max_seconds=30, tier_max_seconds=0))
    kept = finish(bm, "a", [1, 2])
    bm.retain("conv", "t", kept, now=100.0, seconds=3600)  # no second tier (0): the pool's window is all
    pin = bm.retention.get("conv")
    assert pin is not None and (pin.until, pin.tier_until) == (130.0, 130.0)
    assert bm.expire(now=130.0) == 1 and len(bm.retention) == 0 and not bm.retention.tier_pinned


def test_the_tier_horizon_is_clamped_to_its_maximum_and_never_precedes_the_pool_horizon():
    retention = Retention(max_seconds=30, tier_max_seconds=3600)
    retention.pin("day", "t", [b"a"], now=100.0, seconds=86400)
    retention.pin("short", "t", [b"b"], now=100.0, seconds=10)
    day, short = retention.get("day"), retention.get("short")
    assert day is not None and (day.until, day.tier_until) == (130.0, 3700.0)
    assert short is not None and (short.until, short.tier_until) == (110.0, 110.0)
    narrow = Retention(max_seconds=30, tier_max_seconds=5)
    narrow.pin("c", "t", [b"a"], now=0.0, seconds=60)
    pin = narrow.get("c")
    assert pin is not None and (pin.until, pin.tier_until) == (30.0, 30.0)
    assert narrow.problem() is None and retention.problem() is None


def test_re_retaining_a_conversation_replaces_its_earlier_pin():
    bm = BlockManager(num_blocks=8, block_size=2)
    turn1 = finish(bm, "a", [1, 2, 3, 4])
    bm.retain("conv", "t", turn1, now=0.0, seconds=10)
    turn2 = finish(bm, "b", [1, 2, 3, 4, 5, 6])  # the transcript grew: its first blocks are turn 1's
    assert turn2[:2] == turn1
    bm.retain("conv", "t", turn2, now=1.0, seconds=10)
    assert len(bm.retention) == 1 and bm.retention.owner_blocks() == {"t": 3}
    assert bm.num_retained_idle_blocks == 3
    assert bm.release("conv") == 3 and bm.num_retained_idle_blocks == 0
    bm.check_invariants()


def test_a_tenant_over_its_quota_loses_its_oldest_retention_first():
    bm = BlockManager(num_blocks=12, block_size=2, retention=Retention(tenant_quota_blocks=3))
    old = finish(bm, "a", [1, 2, 3, 4])
    other = finish(bm, "b", [5, 6, 7, 8])
    new = finish(bm, "c", [9, 10])
    bm.retain("old", "t1", old, now=0.0, seconds=10)
    bm.retain("other", "t2", other, now=0.5, seconds=10)  # another tenant: untouched
    bm.retain("new", "t1", new, now=1.0, seconds=10)  # t1 would hold 3 blocks: fits
    assert bm.retention.owner_blocks() == {"t1": 3, "t2": 2}
    bigger = finish(bm, "d", [11, 12, 13, 14])
    bm.retain("bigger", "t1", bigger, now=2.0, seconds=10)  # 5 > 3: the oldest ("old") goes; 3 left fit
    assert bm.retention.get("old") is None and bm.retention.get("new") is not None
    assert bm.retention.get("bigger") is not None and bm.retention.get("other") is not None
    assert bm.cached_block(old[0]) in bm._evictable and bm.cached_block(new[0]) in bm._retained
    huge = finish(bm, "e", list(range(20, 30)))  # 5 blocks alone: keeps its leading 3
    bm.retain("huge", "t2", huge, now=3.0, seconds=10)
    pin = bm.retention.get("huge")
    assert pin is not None and pin.hashes == tuple(huge[:3]) and bm.retention.get("other") is None
    bm.check_invariants()


def test_shared_blocks_stay_retained_while_any_conversation_retains_them():
    bm = BlockManager(num_blocks=8, block_size=2)
    a = finish(bm, "a", [1, 2, 3, 4])
    b = finish(bm, "b", [1, 2, 5, 6])  # same first block (a shared system prompt)
    bm.retain("ca", "t", a, now=0.0, seconds=10)
    bm.retain("cb", "t", b, now=0.0, seconds=10)
    bm.release("ca")
    assert bm.cached_block(a[0]) in bm._retained and bm.cached_block(a[1]) in bm._evictable
    bm.check_invariants()


def test_adopted_blocks_never_evict_retained_ones_and_count_their_hits():
    bm = BlockManager(num_blocks=3, block_size=2)
    kept = finish(bm, "a", [1, 2, 3, 4])  # blocks 0, 1 retained
    bm.retain("conv", "t", kept, now=0.0, seconds=10)
    outside = hash_blocks([7, 8, 9, 10], 2, "s")
    bm.retain("demoted", "t", outside, now=0.0, seconds=10)
    assert bm.adopt([(h, "t") for h in outside]) == [(2, outside[0])]  # one plain block left: the second is not taken
    assert blocks_of(bm, kept) == [0, 1] and bm.cached_block(outside[0]) == 2
    assert bm._retained[2] is None  # adopted into the retained LRU: its hash is pinned
    bm.check_invariants()
    bm.allocate_slots("next", 3, bm.match_prefix(outside[:1]))
    assert bm.num_prefetch_hits == 1
    bm.check_invariants()


def test_a_zero_retention_pins_nothing_and_drops_an_earlier_pin():
    bm = BlockManager(num_blocks=4, block_size=2)
    kept = finish(bm, "a", [1, 2])
    bm.retain("conv", "t", kept, now=0.0, seconds=10)
    bm.retain("conv", "t", kept, now=1.0, seconds=0)
    assert len(bm.retention) == 0 and bm.num_retained_idle_blocks == 0
    bm.check_invariants()


def test_negative_limits_are_refused():
    with pytest.raises(ValueError):
        Retention(max_seconds=-1)
    with pytest.raises(ValueError):
        Retention(tier_max_seconds=-1)


# ---- a day-long retention: the pool's window, then the tier alone -------------------------

DAY = 86400.0


def test_past_its_pool_horizon_a_day_long_retention_leaves_its_blocks_plain_lru_in_the_pool():
    bm = BlockManager(num_blocks=4, block_size=2, retention=Retention(max_seconds=30))
    bm.track_evictions = True
    day = finish(bm, "a", [1, 2, 3, 4])  # blocks 0, 1
    bm.retain("day", "t", day, now=0.0, seconds=DAY)
    newer = finish(bm, "b", [5, 6])  # block 2: plain, used after the conversation; block 3 stays free
    assert list(bm._retained) == [1, 0] and list(bm._evictable) == [2]
    assert bm.expire(now=29.9) == 0 and bm.retention.in_pool("day")
    assert bm.expire(now=30.0) == 0  # the pool horizon: nothing ends, the pin is tier-only now
    assert not bm.retention.in_pool("day") and len(bm.retention) == 1 and bm.retention.num_pool_pins == 0
    assert all(h not in bm.retention and h in bm.retention.tier_pinned for h in day)
    assert list(bm._evictable) == [1, 0, 2] and bm.num_retained_idle_blocks == 0  # the oldest end, tail first
    bm.check_invariants()
    got = bm.allocate_slots("c", 4, start=0)  # 2 new blocks: the free one, then the plain LRU's oldest
    assert got is not None and got.new_block_ids == [3, 1]  # the conversation's tail goes before newer blocks
    assert [(block, block_hash) for block, block_hash, _ in bm.take_evicted()] == [(1, day[1])]  # to the tier
    assert bm.cached_block(newer[0]) == 2
    hit = bm.match_prefix(day[:1])
    assert list(hit) == [0]
    assert bm.allocate_slots("next", 3, hit) is not None  # a prefix hit on it is a plain hit...
    bm.free("next")
    assert 0 in bm._evictable and not bm._retained  # ...and the block goes back to the plain LRU
    bm.check_invariants()


def test_past_its_tier_horizon_a_day_long_retention_ends():
    bm = BlockManager(num_blocks=6, block_size=2, retention=Retention(max_seconds=30))
    day = finish(bm, "a", [1, 2, 3, 4])
    bm.retain("day", "t", day, now=0.0, seconds=DAY)
    assert bm.expire(now=30.0) == 0
    assert bm.expire(now=DAY - 1) == 0 and set(bm.retention.tier_pinned) == set(day)
    assert bm.expire(now=DAY) == 1
    assert len(bm.retention) == 0 and not bm.retention.tier_pinned and bm.retention.owner_blocks() == {}
    assert bm.retention.num_hashes == 0
    bm.check_invariants()


def test_release_drops_both_horizons():
    bm = BlockManager(num_blocks=8, block_size=2, retention=Retention(max_seconds=30))
    live = finish(bm, "a", [1, 2, 3, 4])
    idle = finish(bm, "b", [5, 6])
    bm.retain("live", "t", live, now=0.0, seconds=DAY)
    bm.retain("idle", "t", idle, now=0.0, seconds=DAY)
    bm.expire(now=30.0)
    bm.retain("live", "t", live, now=40.0, seconds=DAY)  # its next turn: the pool's priority again
    assert bm.retention.in_pool("live") and not bm.retention.in_pool("idle")
    assert bm.release("live") == 2 and bm.release("idle") == 1  # pool-live and tier-only alike
    assert len(bm.retention) == 0 and not bm.retention.tier_pinned and bm.num_retained_idle_blocks == 0
    assert bm.expire(now=DAY + 40) == 0  # their deadlines are stale: nothing left to end
    bm.check_invariants()


def make_tier(retention: Retention, entries: int) -> SecondTier:
    """A memory tier of ``entries`` 1000-byte blocks that ranks by ``retention``'s tier pins."""
    return SecondTier(MemoryStore(), entries * 1100, "ns", retained=retention.tier_pinned)


def test_the_tier_ranks_a_tier_only_retention_above_unretained_entries_until_its_tier_horizon():
    retention = Retention(max_seconds=30)
    bm = BlockManager(num_blocks=4, block_size=2, retention=retention)
    tier = make_tier(retention, entries=3)
    try:
        day = finish(bm, "a", [1, 2])
        bm.retain("day", "t", day, now=0.0, seconds=DAY)
        bm.expire(now=30.0)
        assert day[0] not in retention  # plain in the pool...
        tier.offer(day[0], "t", bytes(1000))  # ...demoted to the tier, its oldest entry
        plain = hash_blocks(list(range(10, 20)), 2, "s")
        for h in plain[:3]:
            tier.offer(h, "t", bytes(1000))
        assert [h in tier for h in (day[0], *plain[:3])] == [True, False, True, True]  # the unretained one went
        bm.expire(now=DAY)
        tier.offer(plain[3], "t", bytes(1000))  # nothing retained now: plain LRU, the day-long entry goes
        assert [h in tier for h in (day[0], plain[1], plain[2], plain[3])] == [False, True, True, True]
    finally:
        tier.close()


class Blocks:
    """A runner that moves whole blocks: records what a prefetch installs."""

    def __init__(self) -> None:
        self.imported: list[int] = []

    def export_blocks(self, block_ids, wait=True):
        return [bytes(1000) for _ in block_ids]

    def block_bytes(self) -> int:
        return 1000

    def import_blocks(self, pairs) -> None:
        self.imported += [block for block, _ in pairs]


def test_prefetch_brings_back_only_conversations_still_within_their_pool_window():
    retention = Retention(max_seconds=30)
    bm = BlockManager(num_blocks=16, block_size=2, retention=retention)
    tier = make_tier(retention, entries=16)
    try:
        day = hash_blocks([1, 2, 3, 4], 2, "s")  # demoted earlier: in the tier, not the pool
        live = hash_blocks([5, 6, 7, 8], 2, "s")
        for h in day + live:
            tier.offer(h, "t", bytes(1000))
        tier.flush()
        bm.retain("day", "t", day, now=0.0, seconds=DAY)
        bm.retain("live", "t", live, now=20.0, seconds=DAY)
        bm.expire(now=40.0)  # "day" idle past the pool's window, "live" back 20 s later
        blocks = Blocks()
        prefetcher = Prefetcher(bm, tier, blocks)
        assert prefetcher.run(num_waiting=0, num_running=0, offload=lambda: None) == 2
        assert [bm.cached_block(h) is not None for h in day + live] == [False, False, True, True]
        assert len(blocks.imported) == 2 and bm.num_retained_idle_blocks == 2
        bm.expire(now=50.0)  # "live" past its pool window too: nothing left to bring back
        assert retention.num_pool_pins == 0 and len(retention) == 2
        assert prefetcher.run(num_waiting=0, num_running=0, offload=lambda: None) == 0
        assert all(bm.cached_block(h) is None for h in day)
        bm.check_invariants()
    finally:
        tier.close()


def test_the_tenant_quota_counts_tier_only_retentions_and_releases_them_first():
    bm = BlockManager(num_blocks=12, block_size=2, retention=Retention(max_seconds=30, tenant_quota_blocks=3))
    day = finish(bm, "a", [1, 2, 3, 4])
    bm.retain("day", "t", day, now=0.0, seconds=DAY)
    bm.expire(now=30.0)
    assert bm.retention.owner_blocks() == {"t": 2}  # tier-only, still counted
    new = finish(bm, "b", [5, 6, 7, 8])
    bm.retain("new", "t", new, now=31.0, seconds=DAY)  # 4 > 3: the oldest, tier-only, goes
    assert bm.retention.get("day") is None and bm.retention.in_pool("new")
    assert bm.retention.owner_blocks() == {"t": 2} and set(bm.retention.tier_pinned) == set(new)
    bm.check_invariants()


class RetentionMachine(RuleBasedStateMachine):
    """Random requests, retentions, releases, expiries and evictions keep every invariant, and the pool always
    serves a request that fits its capacity, however much is retained."""

    def __init__(self) -> None:
        super().__init__()
        self.bm = BlockManager(num_blocks=10, block_size=2,
                               retention=Retention(max_seconds=10, tier_max_seconds=25, tenant_quota_blocks=6))
        self.bm.track_evictions = True
        self.running: dict[str, list[int]] = {}
        self.next_id = 0
        self.now = 0.0

    @rule(length=st.integers(1, 9), alphabet=st.integers(1, 3))
    def start(self, length: int, alphabet: int) -> None:
        tokens = [(i * alphabet) % 5 for i in range(length)]
        rid = f"r{self.next_id}"
        self.next_id += 1
        hashes = hash_blocks(tokens, 2, "h")
        prefix = self.bm.match_prefix(hashes[: (length - 1) // 2])
        if self.bm.blocks_needed(rid, length, prefix) <= self.bm.num_free_blocks:
            assert self.bm.allocate_slots(rid, length, prefix) is not None  # retention never refuses
            self.running[rid] = tokens
            self.bm.cache_blocks(rid, hashes)

    @precondition(lambda self: self.running)
    @rule(data=st.data(), conversation=st.integers(0, 3), tenant=st.integers(0, 1), seconds=st.floats(0, 30))
    def finish(self, data: st.DataObject, conversation: int, tenant: int, seconds: float) -> None:
        rid = data.draw(st.sampled_from(sorted(self.running)))
        tokens = self.running.pop(rid)
        self.bm.free(rid)
        self.bm.retain(f"c{conversation}", f"t{tenant}", hash_blocks(tokens, 2, "h"), self.now, seconds)

    @rule(conversation=st.integers(0, 3))
    def release(self, conversation: int) -> None:
        self.bm.release(f"c{conversation}")

    @rule(dt=st.floats(0, 15))
    def tick(self, dt: float) -> None:
        self.now += dt
        self.bm.expire(self.now)
        assert all(p.until > self.now for p in self.bm.retention.pool_pins_newest_first())
        assert all(p.tier_until > self.now for p in self.bm.retention.newest_first())

    @rule(data=st.data())
    def adopt(self, data: st.DataObject) -> None:
        pins = list(self.bm.retention.newest_first())
        if pins:
            pin = data.draw(st.sampled_from(pins))
            retained = self.bm.num_retained_idle_blocks
            self.bm.adopt([(h, pin.owner) for h in pin.hashes])
            assert self.bm.num_retained_idle_blocks >= retained  # nothing retained was taken

    @rule()
    def evict_all(self) -> None:
        self.bm.reset_prefix_cache()

    @invariant()
    def consistent(self) -> None:
        self.bm.check_invariants()
        self.bm.take_evicted()


RetentionMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
TestRetentionMachine = RetentionMachine.TestCase
