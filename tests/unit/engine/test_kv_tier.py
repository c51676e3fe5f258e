"""The second KV tier on its own: records round-trip through memory and disk, the byte budget and tenant
quotas evict oldest first, damaged or foreign records are detected (never returned), sealed records need
the key, another namespace's files are deleted at open, and a reopened disk tier keeps its entries."""

from __future__ import annotations

import os
import stat
import threading
from collections import Counter

import pytest

from tokenfleet.engine.kv_store import DiskStore, MemoryStore, open_store, read_key
from tokenfleet.engine.kv_tier import PendingBlock, SecondTier

NS = "ns-a"


def h(i: int) -> bytes:
    return i.to_bytes(2, "big") * 16


def payload(i: int, size: int = 1000) -> bytes:
    return bytes((i + j) % 251 for j in range(size))


@pytest.fixture(params=["memory", "disk"])
def make_tier(request, tmp_path):
    tiers = []

    def make(budget=100_000, quota=0, key=None, namespace=NS, max_pending=256, retained=frozenset()):
        store = MemoryStore() if request.param == "memory" else DiskStore(tmp_path / "tier", namespace)
        tier = SecondTier(store, budget, namespace, quota, key, max_pending, retained)
        tiers.append(tier)
        return tier

    yield make
    for tier in tiers:
        tier.close()


def test_offered_blocks_come_back_as_the_longest_leading_run(make_tier):
    tier = make_tier()
    for i in range(5):
        tier.offer(h(i), "t", payload(i))
    tier.flush()
    assert tier.held_run([h(0), h(1), h(9), h(2)]) == 2  # from the index: no reads, no hits counted
    assert tier.fetch_chain([h(0), h(1), h(2)]) == [payload(0), payload(1), payload(2)]
    assert tier.fetch_chain([h(3), h(9), h(4)]) == [payload(3)]  # stops at the first one it lacks
    assert tier.fetch_chain([h(9)]) == []
    stats = tier.snapshot()
    assert (stats.hits, stats.misses, stats.stored, stats.entries) == (4, 1, 5, 5)


def test_a_pending_copy_is_waited_for_by_the_writer_or_by_a_restore(make_tier):
    """CUDA offers blocks whose bytes are still being copied to host (``PendingBlock``): the writer thread
    waits for them off the engine thread; a restore that comes first waits itself; either way the record
    holds the right bytes."""
    tier = make_tier()
    release, copies = threading.Event(), Counter()

    def copy(i: int) -> bytes:
        release.wait(10)
        copies[i] += 1
        return payload(i)

    tier.offer(h(1), "t", PendingBlock(1000, lambda: copy(1)))
    tier.offer(h(2), "t", PendingBlock(1000, lambda: copy(2)))
    assert tier.snapshot().bytes_used == 2 * tier._record_size("t", payload(1))  # sized before the copy ends
    release.set()
    assert tier.fetch_chain([h(1)]) == [payload(1)]  # from memory, waiting if the writer has not yet
    tier.flush()
    assert tier.fetch_chain([h(1), h(2)]) == [payload(1), payload(2)]
    assert copies == {1: 1, 2: 1}  # each copy waited for once, by whoever needed it first


def test_the_budget_evicts_least_recently_used_first(make_tier):
    tier = make_tier(budget=3 * 1100)  # three records (payload + header)
    for i in range(3):
        tier.offer(h(i), "t", payload(i))
    assert tier.fetch_chain([h(0)])  # 0 is now the most recent
    tier.offer(h(3), "t", payload(3))
    tier.flush()
    assert h(1) not in tier and all(x in tier for x in (h(0), h(2), h(3)))
    assert tier.snapshot().bytes_used <= 3 * 1100 and tier.snapshot().evicted == 1


def test_a_tenant_over_its_quota_evicts_its_own_blocks_not_others(make_tier):
    tier = make_tier(quota=2 * 1100)
    tier.offer(h(0), "other", payload(0))
    for i in range(1, 5):
        tier.offer(h(i), "greedy", payload(i))
    tier.flush()
    assert h(0) in tier and [x in tier for x in map(h, range(1, 5))] == [False, False, True, True]
    assert tier.snapshot().per_tenant_bytes["greedy"] <= 2 * 1100


def test_retained_entries_are_evicted_after_every_unretained_one_until_released(make_tier):
    retained = {h(0), h(1)}  # the block manager's Retention: a live view, read at each eviction
    tier = make_tier(budget=3 * 1100, retained=retained)
    for i in range(3):
        tier.offer(h(i), "t", payload(i))
    tier.offer(h(3), "t", payload(3))  # the oldest, 0 and 1, are retained: 2 goes
    assert [x in tier for x in map(h, range(4))] == [True, True, False, True]
    tier.offer(h(4), "t", payload(4))  # 3 is the only unretained entry left
    assert [x in tier for x in map(h, range(5))] == [True, True, False, False, True]
    tier.offer(h(5), "t", payload(5))  # 4 goes; then only retained ones are older than the new entry
    tier.offer(h(6), "t", payload(6))
    assert [x in tier for x in map(h, range(7))] == [True, True, False, False, False, False, True]
    retained.discard(h(0))  # released: its priority drops at once
    tier.offer(h(7), "t", payload(7))
    assert [x in tier for x in (h(0), h(1), h(6), h(7))] == [False, True, True, True]
    retained.clear()
    tier.offer(h(8), "t", payload(8))  # nothing retained: plain LRU again (1 is the oldest)
    assert h(1) not in tier and tier.snapshot().evicted == 6


def test_a_tenant_over_its_quota_evicts_its_unretained_blocks_first(make_tier):
    tier = make_tier(quota=2 * 1100, retained={h(1)})
    for i in range(1, 4):
        tier.offer(h(i), "t", payload(i))
    assert [x in tier for x in map(h, range(1, 4))] == [True, False, True]


def test_a_block_larger_than_the_budget_is_dropped(make_tier):
    tier = make_tier(budget=500)
    tier.offer(h(0), "t", payload(0))
    assert h(0) not in tier and tier.snapshot().dropped == 1


def test_damaged_records_are_detected_deleted_and_end_the_run(tmp_path):
    tier = SecondTier(DiskStore(tmp_path, NS), 100_000, NS)
    for i in range(3):
        tier.offer(h(i), "t", payload(i))
    tier.flush()
    path = tmp_path / NS / h(1).hex()
    data = bytearray(path.read_bytes())
    data[-7] ^= 0x40
    path.write_bytes(bytes(data))
    assert tier.fetch_chain([h(0), h(1), h(2)]) == [payload(0)]
    assert tier.snapshot().corrupt == 1 and h(1) not in tier
    tier.flush()
    assert not path.exists()
    (tmp_path / NS / h(2).hex()).write_bytes(b"TFKV")  # truncated
    assert tier.fetch_chain([h(2)]) == [] and tier.snapshot().corrupt == 2
    tier.close()


def test_records_of_another_namespace_do_not_verify(tmp_path):
    a = SecondTier(DiskStore(tmp_path / "a", NS), 100_000, NS)
    a.offer(h(0), "t", payload(0))
    a.flush()
    record = (tmp_path / "a" / NS / h(0).hex()).read_bytes()
    b = SecondTier(MemoryStore(), 100_000, "ns-b")
    b.store.write(h(0).hex(), record)
    b._index[h(0)] = type(next(iter(a._index.values())))(len(record), "t")  # as if it had been offered here
    b._tenant_bytes["t"] = len(record)
    assert b.fetch_chain([h(0)]) == [] and b.snapshot().corrupt == 1
    a.close()
    b.close()


def test_sealed_records_need_the_key_and_detect_tampering(tmp_path):
    key = os.urandom(32)
    tier = SecondTier(DiskStore(tmp_path, NS), 100_000, NS, cipher_key=key)
    tier.offer(h(0), "t", payload(0))
    tier.offer(h(1), "t", payload(1))
    tier.flush()
    raw = (tmp_path / NS / h(0).hex()).read_bytes()
    assert payload(0)[:64] not in raw  # not stored in the clear
    assert tier.fetch_chain([h(0)]) == [payload(0)]
    tier.close()
    reopened = SecondTier(DiskStore(tmp_path, NS), 100_000, NS, cipher_key=os.urandom(32))
    assert h(0) in reopened and reopened.fetch_chain([h(0)]) == []  # another key: not readable, dropped
    reopened.close()


def test_files_are_private_and_other_namespaces_are_removed_at_open(tmp_path):
    old = SecondTier(DiskStore(tmp_path, "old-model"), 100_000, "old-model")
    old.offer(h(0), "t", payload(0))
    old.close()
    assert (tmp_path / "old-model").exists()
    tier = SecondTier(DiskStore(tmp_path, NS), 100_000, NS)
    assert not (tmp_path / "old-model").exists()  # a new model version or layout: the old blocks are invalid
    tier.offer(h(1), "t", payload(1))
    tier.flush()
    assert stat.S_IMODE((tmp_path / NS).stat().st_mode) == 0o700
    assert stat.S_IMODE((tmp_path / NS / h(1).hex()).stat().st_mode) == 0o600
    tier.close()


def test_a_reopened_disk_tier_keeps_its_blocks_within_budget(tmp_path):
    tier = SecondTier(DiskStore(tmp_path, NS), 100_000, NS)
    for i in range(4):
        tier.offer(h(i), f"t{i % 2}", payload(i))
    tier.close()
    (tmp_path / NS / ".half-written.tmp").write_bytes(b"x")
    again = SecondTier(DiskStore(tmp_path, NS), 100_000, NS)
    assert again.fetch_chain([h(0), h(1), h(2), h(3)]) == [payload(i) for i in range(4)]
    assert set(again.snapshot().per_tenant_bytes) == {"t0", "t1"}
    assert not (tmp_path / NS / ".half-written.tmp").exists()
    again.close()
    smaller = SecondTier(DiskStore(tmp_path, NS), 2 * 1100, NS)
    assert smaller.snapshot().entries == 2 and smaller.snapshot().bytes_used <= 2 * 1100
    smaller.close()


def test_store_specs_and_key_files(tmp_path):
    assert isinstance(open_store("memory", NS), MemoryStore)
    assert isinstance(open_store(f"disk:{tmp_path}", NS), DiskStore)
    with pytest.raises(ValueError, match="memory"):
        open_store("s3://bucket", NS)
    key = tmp_path / "key"
    key.write_text(os.urandom(32).hex())
    key.chmod(0o644)
    with pytest.raises(ValueError, match="chmod 600"):
        read_key(str(key))
    key.chmod(0o600)
    assert len(read_key(str(key))) == 32 and read_key("") is None
