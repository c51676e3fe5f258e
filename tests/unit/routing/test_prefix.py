"""Prefix-aware placement with bounded load (pure policy)."""

from __future__ import annotations

import dataclasses

import pytest

from tokenfleet.kvcache.block_hash import hash_blocks
from tokenfleet.routing.policies import FleetSnapshot, NoReplicaError, ReplicaLoad
from tokenfleet.routing.prefix import PrefixPolicyConfig, matched_prefix, prefix_aware, reuse_value

SALT = "smol|bfloat16|16"


def chain(tokens: list[int]) -> list[bytes]:
    return hash_blocks(tokens, 16, SALT)


SYSTEM = list(range(100, 100 + 16 * 8))  # 8 full blocks shared by one tenant's requests
PROMPT = chain(SYSTEM + list(range(900, 932)))  # 10 blocks


def fleet(*loads: int) -> FleetSnapshot:
    return FleetSnapshot(tuple(ReplicaLoad(f"r{i}", f"h:{i}", num_running=n) for i, n in enumerate(loads)))


def test_matched_prefix_stops_at_the_first_missing_block():
    assert matched_prefix(PROMPT, set(PROMPT[:5])) == 5
    assert matched_prefix(PROMPT, set(PROMPT[1:])) == 0  # a suffix without the start is no prefix
    assert matched_prefix(PROMPT, set(PROMPT[:3]) | set(PROMPT[4:])) == 3


def test_the_replica_with_the_longest_cached_prefix_wins_over_a_less_loaded_one():
    cached = {"r0": set(PROMPT[:4]), "r1": set(PROMPT[:8]), "r2": set()}
    placement = prefix_aware(fleet(1, 2, 0), PROMPT, cached)
    assert placement.replica.replica_id == "r1" and placement.matched_blocks == 8 and not placement.spilled


def test_blocks_in_a_second_tier_count_for_less_than_pool_blocks():
    """r1 holds 8 blocks, 6 of them only on its disk tier; r0 holds 6 in its pool. Tier worth 0.5, no peer
    fetch: r1 = 8 - 0.5 x 6 = 5 < r0 = 6. Tier worth 0.9: r1 = 7.4 wins, unless peer fetch (0.8) lets r0
    pull r1's other 2 blocks: r0 = 6 + 0.8 x 2 = 7.6."""
    cached = {"r0": set(PROMPT[:6]), "r1": set(PROMPT[:8])}
    tiered = {"r1": set(PROMPT[2:8])}
    tier_half = PrefixPolicyConfig(tier_block_value=0.5, peer_block_value=0.0)
    assert prefix_aware(fleet(1, 1), PROMPT, cached, tier_half, tiered=tiered).replica.replica_id == "r0"
    assert prefix_aware(fleet(1, 1), PROMPT, cached, tier_half).replica.replica_id == "r1"  # all counted as pool
    no_peer = PrefixPolicyConfig(tier_block_value=0.9, peer_block_value=0.0)
    assert prefix_aware(fleet(1, 1), PROMPT, cached, no_peer, tiered=tiered).replica.replica_id == "r1"
    peer = PrefixPolicyConfig(tier_block_value=0.9, peer_block_value=0.8)
    assert prefix_aware(fleet(1, 1), PROMPT, cached, peer, tiered=tiered).replica.replica_id == "r0"
    assert reuse_value(PROMPT, 6, set(), 8, peer) == pytest.approx(6 + 0.8 * 2)
    assert reuse_value(PROMPT, 8, tiered["r1"], 8, peer) == pytest.approx(8 - 0.1 * 6)


def test_block_values_are_checked():
    with pytest.raises(ValueError, match="within"):
        PrefixPolicyConfig(tier_block_value=1.5)
    with pytest.raises(ValueError, match="peer_min_blocks"):
        PrefixPolicyConfig(peer_min_blocks=0)


def test_matches_below_the_minimum_are_ignored():
    cached = {"r0": set(PROMPT[:3])}
    config = PrefixPolicyConfig(min_match_blocks=4)
    placement = prefix_aware(fleet(2, 0, 1), PROMPT, cached, config)
    assert placement.replica.replica_id == "r1" and not placement.spilled  # least loaded, no affinity
    assert prefix_aware(fleet(2, 0, 1), PROMPT, cached, PrefixPolicyConfig(min_match_blocks=3)).replica.replica_id == "r0"


def test_an_overloaded_affine_replica_spills_to_the_least_loaded():
    cached = {"r0": set(PROMPT)}
    assert prefix_aware(fleet(5, 4, 4), PROMPT, cached).replica.replica_id == "r0"  # 5 <= 1.25 x mean 4.33
    placement = prefix_aware(fleet(8, 4, 3), PROMPT, cached)  # 8 > 1.25 x mean 5
    assert placement.replica.replica_id == "r2" and placement.spilled and placement.matched_blocks == 0
    idle = prefix_aware(fleet(3, 0, 0), PROMPT, cached)  # under the floor: affinity holds on a quiet fleet
    assert idle.replica.replica_id == "r0" and not idle.spilled


def test_a_burst_of_one_prefix_is_not_herded_and_spills_make_new_homes():
    snapshot = fleet(0, 0, 0)
    cached: dict[str, set[bytes]] = {"r0": set(PROMPT)}
    counts = {"r0": 0, "r1": 0, "r2": 0}
    for _ in range(30):  # picks faster than load reports: pending assignments are the only signal
        placement = prefix_aware(snapshot, PROMPT, cached)
        rid = placement.replica.replica_id
        counts[rid] += 1
        if placement.spilled:
            cached.setdefault(rid, set()).update(PROMPT)  # the router records a second home
        snapshot = FleetSnapshot(tuple(dataclasses.replace(r, pending_assignments=r.pending_assignments + 1)
                                       if r.replica_id == rid else r for r in snapshot.replicas))
    assert max(counts.values()) <= 1.25 * 10 + 1 and min(counts.values()) >= 8
    assert set(cached) == {"r0", "r1", "r2"}  # the prefix now has homes everywhere the burst went


def test_draining_replicas_and_empty_fleets():
    cached = {"r0": set(PROMPT)}
    draining = FleetSnapshot((ReplicaLoad("r0", "h:0", state="draining"), ReplicaLoad("r1", "h:1")))
    assert prefix_aware(draining, PROMPT, cached).replica.replica_id == "r1"
    with pytest.raises(NoReplicaError):
        prefix_aware(FleetSnapshot(()), PROMPT, cached)
    with pytest.raises(ValueError):
        PrefixPolicyConfig(min_match_blocks=0)
