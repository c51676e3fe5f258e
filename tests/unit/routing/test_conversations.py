"""Conversation affinity (pure): a conversation stays on the replica that served its last turn while it is serving and
within the load bound, whatever the others report; the router's memory of homes is bounded and expires."""

from __future__ import annotations

import dataclasses

import pytest

from tests.unit.routing.test_prefix import PROMPT, SYSTEM, chain
from tokenfleet.routing.conversations import ConversationConfig, ConversationHomes
from tokenfleet.routing.placement import (
    FOLLOWED,
    LEAST_LOADED,
    LEFT_OVERLOADED,
    LEFT_UNAVAILABLE,
    ConversationHome,
    DisaggConfig,
    PlacementQuery,
    place,
    route,
)
from tokenfleet.routing.policies import FleetSnapshot, ReplicaLoad
from tokenfleet.routing.prefix import PrefixPolicyConfig

NUM_TOKENS = 16 * len(PROMPT)
LAST_TURN = PROMPT[:8]  # the previous turn's prompt: the new one extends it by two blocks
HOME = ConversationHome.of("r0", LAST_TURN)


def replica(i: int, running: int = 0, state: str = "serving", roles: tuple[str, ...] = ("decode", "prefill")
            ) -> ReplicaLoad:
    return ReplicaLoad(f"r{i}", f"h:{i}", roles=roles, state=state, num_running=running)


def query(*replicas: ReplicaLoad, cached: dict | None = None, home: ConversationHome | None = HOME,
          **kwargs) -> PlacementQuery:  # type: ignore[no-untyped-def]
    return PlacementQuery(FleetSnapshot(tuple(replicas)), PROMPT, cached or {}, (), NUM_TOKENS, 16,
                          conversation=home, **kwargs)


def test_the_home_holds_the_last_turns_prompt_only_while_the_new_prompt_extends_it():
    assert HOME.held_blocks(PROMPT) == 8
    assert HOME.held_blocks(PROMPT[:7]) == 0  # shorter than the last turn: not a continuation
    edited = chain(SYSTEM[:16 * 7] + [1] * 16 + list(range(900, 932)))  # the transcript's 8th block rewritten
    assert HOME.held_blocks(edited) == 0
    assert ConversationHome.of("r0", []).held_blocks(PROMPT) == 0  # a router without a layout hashes nothing


def test_a_conversation_stays_home_though_another_replica_reports_more_of_it_and_is_less_loaded():
    # r1 reports the whole prompt and is idle; the home reports nothing yet (its blocks evicted to its second tier,
    # or its next load report not in), and runs 3 requests: within the bound (spill floor 4)
    placement = place(query(replica(0, 3), replica(1, 0), cached={"r1": set(PROMPT)}))
    assert placement.decode.replica_id == "r0" and placement.conversation == FOLLOWED
    assert placement.matched_blocks == 8  # the last turn's prompt, known from the conversation, not from reports
    assert route(query(replica(0, 3), replica(1, 0)), None).cached_prompt_tokens == 8 * 16


def test_without_the_conversation_the_same_fleet_goes_elsewhere():
    placement = place(query(replica(0, 3), replica(1, 0), cached={"r1": set(PROMPT)}, home=None))
    assert placement.decode.replica_id == "r1" and placement.conversation == ""


def test_the_home_is_left_when_it_is_overloaded():
    # the home holds 8 of the prompt's 10 blocks: its slack is 0.25 x (1 + 8 / 2) = 1.25, a bound of 2.25 x the mean;
    # mean load (20 + 2 + 3) / 3 = 8.3; 20 > 2.25 x 8.3 and >= the floor: over the bound
    placement = place(query(replica(0, 20), replica(1, 2), replica(2, 3)))
    assert placement.decode.replica_id == "r1" and placement.conversation == LEFT_OVERLOADED
    # 12 against a mean of 5.7 is over the plain prefix bound (1.25x) but worth staying for: 8 blocks held, 2 new
    placement = place(query(replica(0, 12), replica(1, 2), replica(2, 3)))
    assert placement.decode.replica_id == "r0" and placement.conversation == FOLLOWED
    # a busy but balanced fleet keeps it home (within (1 + slack) x the mean)
    placement = place(query(replica(0, 12), replica(1, 11), replica(2, 11)))
    assert placement.decode.replica_id == "r0" and placement.conversation == FOLLOWED


def test_the_spill_floor_and_slack_come_from_the_prefix_policys_config():
    tight = PrefixPolicyConfig(spill_floor=1, load_slack=0.0)
    placement = place(query(replica(0, 2), replica(1, 1), prefix_config=tight))
    assert placement.decode.replica_id == "r1" and placement.conversation == LEFT_OVERLOADED
    assert place(query(replica(0, 2), replica(1, 1))).conversation == FOLLOWED  # default floor 4


@pytest.mark.parametrize("fleet", [
    (replica(0, state="draining"), replica(1)),  # draining
    (replica(1), replica(2)),  # excluded by the caller (the snapshot is without it) or gone
    (replica(0, roles=("prefill",)), replica(1)),  # no longer a decode replica
])
def test_a_home_that_is_not_a_serving_decode_replica_is_left(fleet):
    placement = place(query(*fleet))
    assert placement.decode.replica_id == "r1" and placement.conversation == LEFT_UNAVAILABLE


def test_the_home_leaves_to_the_replica_reporting_the_transcript_when_it_must_leave():
    placement = place(query(replica(0, 20), replica(1, 3), replica(2, 2), cached={"r1": set(PROMPT)}))
    assert placement.decode.replica_id == "r1" and placement.matched_blocks == len(PROMPT)


def test_a_rewritten_transcript_gets_the_plain_bound():
    # the home holds nothing of this prompt (the last turn's block 8 differs): leaving costs nothing extra
    rewritten = ConversationHome("r0", 8, b"another transcript")
    placement = place(query(replica(0, 12), replica(1, 2), replica(2, 3), home=rewritten))
    assert placement.decode.replica_id == "r1" and placement.conversation == LEFT_OVERLOADED


def test_baseline_policies_ignore_conversations():
    placement = place(query(replica(0, 3), replica(1, 0), policy=LEAST_LOADED))
    assert placement.decode.replica_id == "r1" and placement.conversation == ""


def test_a_decode_only_home_prefills_the_held_transcript_locally():
    # the two new blocks (32 tokens) are under the disaggregation threshold once the home's 8 blocks count
    fleet = (replica(0, roles=("decode",)), replica(1, roles=("prefill",)))
    disagg = DisaggConfig(min_uncached_tokens=64)
    assert place(query(*fleet, disagg=disagg)).prefill is None
    assert place(query(*fleet, disagg=disagg, home=ConversationHome("r0"))).prefill is not None  # nothing known held


def test_homes_are_kept_per_model_and_version():
    homes = ConversationHomes()
    homes.remember("llama", "v1", "c1", HOME, now=0.0)
    assert homes.home("llama", "v1", "c1", now=1.0) == HOME
    assert homes.home("llama", "v2", "c1", now=1.0) is None  # a new version starts the conversation afresh
    assert homes.home("qwen", "v1", "c1", now=1.0) is None
    assert homes.home("llama", "v1", "c2", now=1.0) is None


def test_a_home_expires_after_its_ttl_and_a_new_turn_renews_it():
    homes = ConversationHomes(ConversationConfig(ttl_s=60.0))
    homes.remember("m", "v", "c", HOME, now=0.0)
    assert homes.home("m", "v", "c", now=60.0) == HOME
    moved = dataclasses.replace(HOME, replica_id="r1")
    homes.remember("m", "v", "c", moved, now=50.0)
    assert homes.home("m", "v", "c", now=100.0) == moved
    assert homes.home("m", "v", "c", now=110.1) is None and len(homes) == 0  # expired entries are dropped


def test_the_least_recently_recorded_conversation_goes_first_when_the_map_is_full():
    homes = ConversationHomes(ConversationConfig(max_entries=2))
    for i, name in enumerate(["a", "b", "a", "c"]):
        homes.remember("m", "v", name, HOME, now=float(i))
    assert len(homes) == 2
    assert homes.home("m", "v", "b", now=4.0) is None  # "a" was recorded again after it
    assert homes.home("m", "v", "a", now=4.0) == HOME and homes.home("m", "v", "c", now=4.0) == HOME


def test_the_config_is_validated():
    with pytest.raises(ValueError, match="ttl_s"):
        ConversationConfig(ttl_s=0)
    with pytest.raises(ValueError, match="max_entries"):
        ConversationConfig(max_entries=0)
