"""The whole placement decision (pure): affinity homes, when a home is recorded, and conditional
disaggregation."""

from __future__ import annotations

from tests.unit.routing.test_prefix import PROMPT, SYSTEM, chain
from tokenfleet.routing.placement import (
    LEAST_LOADED,
    ROUND_ROBIN,
    DisaggConfig,
    PlacementQuery,
    anchor_of,
    live_homes,
    place,
    route,
    with_affinity,
)
from tokenfleet.routing.policies import FleetSnapshot, ReplicaLoad, RoundRobin
from tokenfleet.routing.prefix import PrefixPolicyConfig

CONFIG = PrefixPolicyConfig(min_match_blocks=4)
NUM_TOKENS = 16 * 10


def replica(i: int, running: int = 0, roles: tuple[str, ...] = ("decode", "prefill")) -> ReplicaLoad:
    return ReplicaLoad(f"r{i}", f"h:{i}", roles=roles, num_running=running)


def snapshot(*replicas: ReplicaLoad) -> FleetSnapshot:
    return FleetSnapshot(tuple(replicas))


def test_a_home_in_the_affinity_map_attracts_the_prefix_before_the_replica_reports_it():
    fleet = snapshot(replica(0, 1), replica(1, 2), replica(2, 0))
    placement = place(PlacementQuery(fleet, PROMPT, {}, homes=("r1",), num_prompt_tokens=NUM_TOKENS, block_size=16))
    assert placement.decode.replica_id == "r1" and placement.matched_blocks == 4
    assert placement.anchor == PROMPT[3] and not placement.record_home  # the assignment did not change


def test_a_new_prefix_is_recorded_where_it_lands():
    fleet = snapshot(replica(0, 3), replica(1, 0))
    placement = place(PlacementQuery(fleet, PROMPT, {}, homes=(), num_prompt_tokens=NUM_TOKENS, block_size=16))
    assert placement.decode.replica_id == "r1" and placement.record_home and placement.anchor == anchor_of(PROMPT, CONFIG)


def test_a_spill_past_the_bound_records_a_second_home():
    fleet = snapshot(replica(0, 12), replica(1, 2), replica(2, 3))
    placement = place(PlacementQuery(fleet, PROMPT, {"r0": set(PROMPT)}, homes=("r0",), num_prompt_tokens=NUM_TOKENS,
                      block_size=16))
    assert placement.decode.replica_id == "r1" and placement.record_home
    assert live_homes(("r0",), {"r0", "r1", "r2"}, "r1") == ("r0", "r1")
    assert live_homes(("dead", "r0"), {"r0", "r1"}, "r1") == ("r0", "r1")  # dead homes are dropped


def test_short_prompts_have_no_anchor_and_record_nothing():
    short = chain(SYSTEM[:16 * 3])
    placement = place(PlacementQuery(snapshot(replica(0), replica(1)), short, {}, homes=(), num_prompt_tokens=48, block_size=16))
    assert placement.anchor is None and not placement.record_home


def test_baseline_policies_ignore_prefixes():
    fleet = snapshot(replica(0, 0), replica(1, 5))
    cached = {"r1": set(PROMPT)}
    assert place(PlacementQuery(fleet, PROMPT, cached, (), NUM_TOKENS, 16, LEAST_LOADED)).decode.replica_id == "r0"
    robin = RoundRobin()
    picks = [place(PlacementQuery(fleet, PROMPT, cached, (), NUM_TOKENS, 16, ROUND_ROBIN, robin)).decode.replica_id
             for _ in range(4)]
    assert picks == ["r0", "r1", "r0", "r1"]


def test_a_decode_only_replica_gets_a_prefill_replica_for_long_uncached_prompts():
    decode = replica(0, roles=("decode",))
    fleet = snapshot(decode, replica(1, 3, roles=("prefill",)), replica(2, 1, roles=("prefill",)))
    disagg = DisaggConfig(min_uncached_tokens=64)
    placement = place(PlacementQuery(fleet, PROMPT, {}, (), NUM_TOKENS, 16, disagg=disagg))
    assert placement.decode.replica_id == "r0" and placement.prefill is not None
    assert placement.prefill.replica_id == "r2"  # least loaded prefill replica
    # the prefill replica that holds the prefix is preferred
    placement = place(PlacementQuery(fleet, PROMPT, {"r1": set(PROMPT)}, (), NUM_TOKENS, 16, disagg=disagg))
    assert placement.prefill is not None and placement.prefill.replica_id == "r1"


def test_short_cached_or_colocated_requests_prefill_on_the_decode_replica():
    decode = replica(0, roles=("decode",))
    fleet = snapshot(decode, replica(1, roles=("prefill",)))
    disagg = DisaggConfig(min_uncached_tokens=64)
    short = chain(SYSTEM[:48])
    assert place(PlacementQuery(fleet, short, {}, (), 48, 16, disagg=disagg)).prefill is None  # too short
    mostly_cached = place(PlacementQuery(fleet, PROMPT, {"r0": set(PROMPT[:8])}, (), NUM_TOKENS, 16, disagg=disagg))
    assert mostly_cached.matched_blocks == 8 and mostly_cached.prefill is None  # 32 uncached tokens < 64
    assert place(PlacementQuery(fleet, PROMPT, {}, (), NUM_TOKENS, 16, disagg=disagg, colocated=True)).prefill is None
    both = snapshot(replica(0), replica(1, roles=("prefill",)))
    assert place(PlacementQuery(both, PROMPT, {}, (), NUM_TOKENS, 16, disagg=disagg)).prefill is None  # it prefills itself
    alone = snapshot(decode)
    assert place(PlacementQuery(alone, PROMPT, {}, (), NUM_TOKENS, 16, disagg=disagg)).prefill is None  # no prefill pool: local



def test_new_prefixes_spread_over_replicas_by_their_homes_within_the_load_bound():
    fleet = snapshot(replica(0, 1), replica(1, 1), replica(2, 2))
    counts = {"r0": 3, "r1": 1, "r2": 0}
    assert place(PlacementQuery(fleet, PROMPT, {}, (), NUM_TOKENS, 16, homes_count=counts)).decode.replica_id == "r2"
    hot = snapshot(replica(0, 1), replica(1, 1), replica(2, 9))  # r2 is over the bound: not given new prefixes
    assert place(PlacementQuery(hot, PROMPT, {}, (), NUM_TOKENS, 16, homes_count=counts)).decode.replica_id == "r1"
    short = chain(SYSTEM[:32])  # too short for a home: plain least-loaded
    assert place(PlacementQuery(fleet, short, {}, (), 32, 16, homes_count=counts)).decode.replica_id == "r0"


def test_affinity_adds_the_anchors_head_without_copying_what_a_home_reported():
    """Found by the fleet simulator: every pick copied each home's whole reported hash set (~10^5
    hashes per replica) to add a few blocks; a view answers the same membership questions."""
    config = PrefixPolicyConfig(min_match_blocks=2)
    hashes = [bytes([i]) * 16 for i in range(5)]  # a prompt's chain
    reported = frozenset(hashes[1:3]) | {b"other"}
    known = with_affinity({"a": reported, "b": {b"x"}}, hashes, ["a"], config)
    assert known["b"] == {b"x"}  # not a home: untouched
    assert all(h in known["a"] for h in hashes[:3]) and b"other" in known["a"] and hashes[3] not in known["a"]
    assert set(known["a"]) == set(hashes[:3]) | {b"other"} and len(known["a"]) == 4


def test_prefix_peer_names_the_replica_holding_more_of_the_prefix():
    from tokenfleet.routing.placement import prefix_peer
    from tokenfleet.routing.policies import FleetSnapshot, ReplicaLoad

    chain = [bytes([i]) * 8 for i in range(10)]
    snapshot = FleetSnapshot((ReplicaLoad("a", "a:1"), ReplicaLoad("b", "b:1", state="draining"), ReplicaLoad("c", "c:1")))
    cached = {"a": set(chain[:2]), "b": set(chain[:9]), "c": set(chain[:5])}
    peer = prefix_peer(snapshot, chain, cached, "a", 2, min_blocks=4)
    assert peer is not None and peer[0].replica_id == "b" and peer[1] == 9  # a draining replica still sends blocks
    assert prefix_peer(snapshot, chain, cached, "b", 9, min_blocks=4) is None  # the chosen one holds the most
    assert prefix_peer(snapshot, chain, cached, "c", 5, min_blocks=5) is None  # 4 more is under the threshold


def test_route_names_the_peer_holding_more_of_the_prefix_for_the_replica_that_computes_it():
    """The router's answer besides the placement: the prompt tokens the chosen replica holds, and a peer reporting at
    least ``peer_min_blocks`` more leading blocks (none when peer fetch is off)."""
    fleet = snapshot(replica(0, 12), replica(1, 0))
    cached = {"r0": set(PROMPT[:8]), "r1": set(PROMPT[:2])}
    query = PlacementQuery(fleet, PROMPT, cached, (), NUM_TOKENS, 16, policy=LEAST_LOADED)
    routed = route(query, peer_min_blocks=4)
    assert routed.placement.decode.replica_id == "r1" and routed.cached_prompt_tokens == 2 * 16
    assert routed.peer is not None and routed.peer[0].replica_id == "r0" and routed.peer[1] == 8
    assert route(query, peer_min_blocks=None).peer is None
    assert route(query, peer_min_blocks=7).peer is None  # 6 more blocks: below the bar
