from __future__ import annotations

import dataclasses

import pytest

from tokenfleet.routing.policies import FleetSnapshot, NoReplicaError, ReplicaLoad, RoundRobin, least_loaded


def fleet(*replicas: ReplicaLoad) -> FleetSnapshot:
    return FleetSnapshot(tuple(replicas))


A = ReplicaLoad("a", "127.0.0.1:1", num_running=3, num_blocks_used=10, num_blocks_free=90)
B = ReplicaLoad("b", "127.0.0.1:2", num_running=1, num_waiting=1, num_blocks_used=50, num_blocks_free=50)
C = ReplicaLoad("c", "127.0.0.1:3", num_running=5)


def test_least_loaded_picks_fewest_requests_then_lowest_kv_use():
    assert least_loaded(fleet(A, B, C)).replica_id == "b"
    tied = dataclasses.replace(A, num_running=2)
    assert least_loaded(fleet(tied, B)).replica_id == "a"  # 2 each; a uses less KV


def test_pending_assignments_spread_a_burst_between_reports():
    snapshot = fleet(dataclasses.replace(A, num_running=0), dataclasses.replace(B, num_running=0, num_waiting=0))
    picks = []
    for _ in range(4):
        chosen = least_loaded(snapshot)
        picks.append(chosen.replica_id)
        snapshot = fleet(*(
            dataclasses.replace(r, pending_assignments=r.pending_assignments + 1) if r is chosen else r
            for r in snapshot.replicas
        ))
    assert sorted(picks) == ["a", "a", "b", "b"]


def test_draining_and_wrong_role_replicas_are_never_picked():
    draining = dataclasses.replace(B, state="draining")
    prefill_only = dataclasses.replace(C, roles=("prefill",), num_running=0)
    assert least_loaded(fleet(A, draining, prefill_only)).replica_id == "a"
    assert least_loaded(fleet(A, prefill_only), role="prefill").replica_id == "c"


def test_round_robin_cycles_in_id_order():
    policy = RoundRobin()
    assert [policy.pick(fleet(C, A, B)).replica_id for _ in range(4)] == ["a", "b", "c", "a"]


@pytest.mark.parametrize("policy", [least_loaded, RoundRobin().pick])
def test_empty_fleet_raises(policy):
    with pytest.raises(NoReplicaError, match="no serving replica"):
        policy(fleet(dataclasses.replace(A, state="draining")))


def test_excluded_replicas_are_not_picked_again():
    a, b = ReplicaLoad("a", "h:1"), ReplicaLoad("b", "h:2", num_running=5)
    snapshot = fleet(a, b)
    assert least_loaded(snapshot).replica_id == "a"
    assert least_loaded(snapshot.without(["a"])).replica_id == "b"
    assert snapshot.without([]) is snapshot
    with pytest.raises(NoReplicaError):
        least_loaded(snapshot.without(["a", "b"]))


def test_replicas_holding_a_requests_adapter_are_preferred_else_any():
    from tokenfleet.routing.policies import FleetSnapshot, ReplicaLoad

    warm = ReplicaLoad("r1", "a:1", adapters=frozenset({"bot@v1"}))
    cold = ReplicaLoad("r2", "a:2")
    draining_warm = ReplicaLoad("r3", "a:3", state="draining", adapters=frozenset({"bot@v2"}))
    snapshot = FleetSnapshot((warm, cold, draining_warm))
    assert [r.replica_id for r in snapshot.preferring_adapter("bot@v1").replicas] == ["r1"]
    assert snapshot.preferring_adapter("bot@v2") is snapshot  # only a draining replica has it: anyone loads it
    assert snapshot.preferring_adapter("") is snapshot
