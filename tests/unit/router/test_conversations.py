"""The router remembers where each conversation went: its next turn is picked there, even when another replica reports
more of the prompt, and leaves when that replica is overloaded; the metrics count both."""

from __future__ import annotations

import asyncio
import dataclasses

import grpc
import pytest
from tokenfleet.services.router.fleet import FleetView, Replica
from tokenfleet.services.router.servicer import Router

from tokenfleet.kvcache.block_hash import hash_blocks
from tokenfleet.kvcache.layout import KVLayout
from tokenfleet.kvcache.salt import chain_salt
from tokenfleet.routing.policies import ReplicaLoad
from tokenfleet.v1 import router_pb2

LAYOUT = KVLayout("smol|bfloat16|16", "bfloat16", 16, 30, 3, 64)
TURN_1 = list(range(100, 100 + 16 * 6))  # 6 blocks
TURN_2 = TURN_1 + list(range(900, 900 + 16 * 2))  # the transcript grew by a tool result


class Context:
    """What a handler reads of its gRPC context here: no metadata; abort raises as grpc's does."""

    def invocation_metadata(self) -> tuple:
        return ()

    async def abort(self, code: grpc.StatusCode, details: str) -> None:
        raise grpc.aio.AbortError(f"{code.name}: {details}")


def make_router(*loads: int, model: str = "smol") -> Router:
    fleet = FleetView(etcd=None, plane=None)  # type: ignore[arg-type]  # never started: its view is set by hand
    for i, running in enumerate(loads):
        fleet.replicas[f"replicas/r{i}"] = Replica(ReplicaLoad(f"r{i}", f"h:{i}", num_running=running), model, "v1",
                                                   layout=LAYOUT)
    return Router(fleet)


def set_load(router: Router, replica_id: str, running: int) -> None:
    """A load report: what the replica runs now (its pending picks are in it)."""
    replica = router.fleet.replicas[f"replicas/{replica_id}"]
    replica.load = dataclasses.replace(replica.load, num_running=running, pending_assignments=0)


def pick(router: Router, prompt: list[int], conversation: str = "", model: str = "smol") -> str:
    request = router_pb2.PickRequest(model=model, prompt_token_ids=prompt, conversation=conversation, colocated=True)
    return asyncio.run(router.Pick(request, Context())).replica_id


def outcomes(router: Router, model: str = "smol") -> dict[str, float]:
    return {s.labels["outcome"]: s.value for m in router.metrics.conversations.collect() for s in m.samples
            if s.name.endswith("_total") and s.labels["model"] == model}


def test_a_conversation_is_picked_where_its_last_turn_went_though_another_replica_reports_more():
    router = make_router(1, 0)
    first = pick(router, TURN_1, "conv-a")
    assert first == "r1"  # a new conversation: least loaded
    set_load(router, "r1", 3)
    # r0 reports the whole new prompt (another tenant's twin transcript, say); r1 reported nothing of it yet
    router.fleet.replicas["replicas/r0"].hashes = set(hash_blocks(TURN_2, 16, chain_salt(LAYOUT.hash_salt, "")))
    assert pick(router, TURN_2, "conv-a") == "r1"
    assert pick(router, TURN_2) == "r0"  # the same prompt outside the conversation goes by what r0 reports
    assert outcomes(router) == {"new": 1.0, "followed": 1.0}


def test_a_conversation_leaves_its_home_when_it_is_overloaded_and_stays_at_the_new_one():
    router = make_router(0, 0, 0)
    home = pick(router, TURN_1, "conv-b")
    others = sorted({"r0", "r1", "r2"} - {home})
    set_load(router, home, 12)
    for other in others:
        set_load(router, other, 2)
    moved = pick(router, TURN_2, "conv-b")
    assert moved in others
    set_load(router, home, 2)  # the old home is idle again: the conversation stays where its transcript is now
    set_load(router, moved, 3)
    assert pick(router, TURN_2 + [7] * 16, "conv-b") == moved
    assert outcomes(router) == {"new": 1.0, "left_overloaded": 1.0, "followed": 1.0}


def test_a_conversation_never_follows_a_replica_of_another_model():
    router = make_router(0, 5)
    router.fleet.replicas["replicas/q0"] = Replica(ReplicaLoad("q0", "h:q0"), "qwen", "v1", layout=LAYOUT)
    assert pick(router, TURN_1, "conv-c", model="qwen") == "q0"
    assert pick(router, TURN_2, "conv-c") == "r0"  # the same conversation id under another model: a new one there
    assert outcomes(router) == {"new": 1.0} and outcomes(router, "qwen") == {"new": 1.0}


def test_an_excluded_home_is_left():
    router = make_router(0, 1)
    assert pick(router, TURN_1, "conv-d") == "r0"
    request = router_pb2.PickRequest(model="smol", prompt_token_ids=TURN_2, conversation="conv-d",
                                     exclude_replica_ids=["r0"], colocated=True)
    assert asyncio.run(router.Pick(request, Context())).replica_id == "r1"
    assert outcomes(router)["left_unavailable"] == 1.0


def test_requests_without_a_conversation_are_not_remembered():
    router = make_router(0)
    pick(router, TURN_1)
    assert len(router.conversations) == 0 and outcomes(router) == {}


@pytest.mark.parametrize("policy", [router_pb2.POLICY_LEAST_LOADED, router_pb2.POLICY_ROUND_ROBIN])
def test_baseline_policies_ignore_the_home(policy):
    router = make_router(0, 0)
    home = pick(router, TURN_1, "conv-e")
    set_load(router, home, 3)
    request = router_pb2.PickRequest(model="smol", prompt_token_ids=TURN_2, conversation="conv-e", policy=policy,
                                     colocated=True)
    asyncio.run(router.Pick(request, Context()))
    assert outcomes(router) == {"new": 1.0, "ignored": 1.0}
