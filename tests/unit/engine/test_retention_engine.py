"""Retention inside the engine (default model, fp32): a request that ends with ``retention_s`` keeps its prompt and
output blocks through a flood that evicts every plain cached block, so the conversation's next turn is a pool hit;
an aborted request retains nothing; release and expiry end it. With a second tier, a retained conversation the pool
demoted comes back by prefetch between steps and the next turn hits the pool, not the tier; one retained for a day
and idle past the pool window stays in the tier, ranked above unretained entries, until its tier horizon."""

from __future__ import annotations

import time

from tests.model.helpers import greedy, make_core, run_to_completion
from tests.unit.engine.test_kv_tier_engine import chat
from tokenfleet.engine.request_spec import RequestSpec

BS = 16


def flood(core, tag: str, rounds: int, n: int = 3) -> None:
    """``rounds`` of ``n`` distinct prompts of 10 blocks each, run together: each round needs 30 blocks, so a
    second round evicts the least recently used cached blocks of a 40-block pool (the plain ones first)."""
    for r in range(rounds):
        prompts = [[(i * 131 + j * 17 + r * 7919) % 20_000 + 500 for j in range(160)] for i in range(n)]
        run_to_completion(core, {0: [(f"{tag}-{r}-{i}", p, greedy(2)) for i, p in enumerate(prompts)]})


def turn(core, request_id: str, prompt: list[int], conversation: str = "conv", retention_s: float = 60.0):
    """Run one request alone to its end; returns (output tokens, its final output)."""
    core.add_request(RequestSpec(prompt, greedy(8), request_id=request_id, tenant="t", conversation=conversation,
                                 retention_s=retention_s))
    outputs = []
    while core.has_unfinished():
        outputs += core.step()
    return [t for o in outputs for t in o.new_token_ids], outputs[-1]


def test_a_retained_conversation_survives_a_flood_and_its_next_turn_hits_the_pool(default_model_dir):
    core = make_core(default_model_dir, num_blocks=40)
    bm = core.scheduler.block_manager
    prompt = chat(core, "How do I adjust the rear derailleur?")
    tokens, first = turn(core, "turn1", prompt)
    transcript = prompt + tokens
    retained = (len(transcript) - 1) // BS  # every full block computed: the last sampled token is not
    assert bm.retention.num_hashes == retained and bm.num_retained_idle_blocks == retained
    assert first.retained_bytes == retained * core._block_bytes()  # reported to the gateway (the tenant's usage)
    flood(core, "f", rounds=2)  # every plain cached block goes, the retained ones stay
    assert bm.num_retained_idle_blocks == retained
    _, last = turn(core, "turn2", transcript + chat(core, "And the front one?")[1:])
    assert last.num_cached_tokens == retained * BS
    bm.check_invariants()


def test_without_retention_the_flood_evicts_the_conversation(default_model_dir):
    core = make_core(default_model_dir, num_blocks=40)
    prompt = chat(core, "How do I adjust the rear derailleur?")
    tokens, first = turn(core, "turn1", prompt, retention_s=0.0)
    assert first.retained_bytes == 0
    flood(core, "f", rounds=2)
    _, last = turn(core, "turn2", prompt + tokens + chat(core, "And the front one?")[1:], retention_s=0.0)
    assert last.num_cached_tokens < (len(prompt) // BS) * BS
    assert core.scheduler.block_manager.num_retained_idle_blocks == 0


def test_abort_retains_nothing_and_release_and_expiry_end_a_retention(default_model_dir):
    core = make_core(default_model_dir, num_blocks=64)
    bm = core.scheduler.block_manager
    prompt = chat(core, "Is a carbon frame worth it?")
    core.add_request(RequestSpec(prompt, greedy(8), request_id="gone", conversation="c0", retention_s=60))
    core.step()
    core.abort("gone")
    assert len(bm.retention) == 0
    turn(core, "a", prompt, conversation="c1")
    retained = bm.retention.num_hashes
    assert retained >= len(prompt) // BS and bm.num_retained_idle_blocks == retained
    assert core.release("c1") == retained
    assert core.release("c1") == 0 and bm.num_retained_idle_blocks == 0
    turn(core, "b", prompt, conversation="c2", retention_s=86400)  # a day, asked of a worker without a tier
    pin = bm.retention.get("c2")
    assert pin is not None and pin.tier_until == pin.until  # the pool's window only
    core.tend(pin.until)
    stats = core.snapshot()
    assert (stats.num_retention_releases, stats.num_retention_expiries, stats.num_retained_blocks) == (1, 1, 0)
    bm.check_invariants()


def test_a_demoted_conversation_is_prefetched_between_steps_and_its_next_turn_hits_the_pool(default_model_dir):
    core = make_core(default_model_dir, num_blocks=40, kv_tier="memory", kv_tier_bytes=64 << 20)
    bm = core.scheduler.block_manager
    prompt = chat(core, "Which tyre pressure for gravel?")
    tokens, _ = turn(core, "turn1", prompt)
    transcript = prompt + tokens
    pinned = bm.retention.get("conv")
    assert pinned is not None
    flood(core, "f", rounds=1, n=4)  # more than the pool: the retained blocks are demoted to the tier as well
    stats = core.snapshot()
    assert stats.num_retained_demoted > 0
    assert any(bm.cached_block(h) is None for h in pinned.hashes)
    assert all(h in core.tier for h in pinned.hashes if bm.cached_block(h) is None)
    idle_calls(core, time.monotonic())
    assert all(bm.cached_block(h) is not None for h in pinned.hashes)
    prefetched = core.snapshot().num_prefetched_blocks
    assert prefetched > 0
    hits_before = core.snapshot().tier_hit_blocks
    _, last = turn(core, "turn2", transcript + chat(core, "And for the road?")[1:])
    after = core.snapshot()
    assert last.num_cached_tokens == len(pinned.hashes) * BS
    assert after.tier_hit_blocks == hits_before  # a pool hit: nothing restored at admission
    assert after.num_prefetch_hits == prefetched
    bm.check_invariants()


def test_prefetch_waits_while_requests_wait(default_model_dir):
    core = make_core(default_model_dir, num_blocks=40, kv_tier="memory", kv_tier_bytes=64 << 20)
    prompt = chat(core, "Which tyre pressure for gravel?")
    turn(core, "turn1", prompt)
    flood(core, "f", rounds=1, n=4)
    core.add_request(RequestSpec(chat(core, "Hello"), greedy(2), request_id="queued"))
    assert core.scheduler.num_waiting == 1
    assert core.tend(time.monotonic()) is False and core.snapshot().num_prefetched_blocks == 0


def test_a_day_long_conversation_past_the_pool_window_stays_ranked_in_the_tier_and_is_not_prefetched(
        default_model_dir):
    core = make_core(default_model_dir, num_blocks=40, kv_tier="memory", kv_tier_bytes=64 << 20,
                     kv_retention_max_s=30)
    assert core.tier is not None
    bm = core.scheduler.block_manager
    turn(core, "turn1", chat(core, "Which tyre pressure for gravel?"), retention_s=86400)
    pin = bm.retention.get("conv")
    assert pin is not None and pin.tier_until - pin.until == 86400 - 30
    flood(core, "f", rounds=1, n=4)  # demoted to the tier, as in the prefetch test above
    demoted = [h for h in pin.hashes if bm.cached_block(h) is None]
    assert demoted and all(h in core.tier for h in demoted)
    idle_calls(core, pin.until)  # the pool window has passed: nothing comes back
    assert core.snapshot().num_prefetched_blocks == 0 and all(bm.cached_block(h) is None for h in demoted)
    assert all(h in core.tier.retained for h in pin.hashes)  # the tier still evicts them last
    assert core.snapshot().num_retained_blocks == len(pin.hashes) and bm.num_retained_idle_blocks == 0
    core.tend(pin.tier_until)
    assert not any(h in core.tier.retained for h in pin.hashes) and core.snapshot().num_retention_expiries == 1
    bm.check_invariants()


def idle_calls(core, now: float, limit: int = 1000) -> None:  # type: ignore[no-untyped-def]
    """The engine loop's idle calls until prefetch has nothing left to do (failing, not hanging, if it never
    stops)."""
    for _ in range(limit):
        if not core.tend(now):
            return
    raise AssertionError(f"tend() still had work after {limit} idle calls")
