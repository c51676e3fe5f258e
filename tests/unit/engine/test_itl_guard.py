"""The ITL guard: beside decoding streams a step gives prompt chunks only the time the guard's factor allows, a
waiting short prompt still starts at once, and a prompt always advances."""

from __future__ import annotations

import pytest

from tests.conftest import make_request, make_scheduler
from tokenfleet.engine.itl_guard import PROBE_WORK, ItlGuard, PrefillAllowance, chunk_work
from tokenfleet.engine.scheduler import ScheduledRequest


def test_chunk_work_counts_attention_pairs_so_a_chunk_deep_in_a_context_costs_more():
    assert chunk_work(0, 4, 0.0) == 4
    assert chunk_work(0, 4, 0.5) == 4 + 0.5 * 10  # causal pairs of 4 new tokens: 1 + 2 + 3 + 4
    assert chunk_work(1000, 4, 0.5) > chunk_work(0, 4, 0.5)


def test_the_allowance_gives_the_largest_chunk_that_fits_and_at_least_one_token():
    allowance = PrefillAllowance(left=10.0, pair_cost=0.0)
    assert allowance.tokens(0, 8) == 8
    assert allowance.tokens(0, 64) == 10
    allowance.spend(0, 10)
    assert allowance.left == 0 and allowance.tokens(0, 64) == 1  # a prompt always advances
    deep = PrefillAllowance(left=10.0, pair_cost=0.01)
    assert deep.tokens(1000, 64) == 1 and deep.tokens(0, 64) == 9  # 9 + 0.01 * 45 <= 10 < 10 + 0.01 * 55


def _entries(*shapes: tuple[int, int]) -> list[ScheduledRequest]:
    return [ScheduledRequest(f"r{i}", start, n, (), True) for i, (start, n) in enumerate(shapes)]


def test_the_guard_learns_a_decode_step_and_prefill_speed_then_allows_factor_minus_one_decode_steps():
    guard = ItlGuard(1.5, pair_cost=0.0)
    assert guard.allowance().left == 0.0  # no decode-only step timed yet
    guard.observe(_entries((10, 1), (12, 1)), seconds=0.1)  # decode-only
    assert guard.decode_s == pytest.approx(0.1)
    assert guard.allowance().left == PROBE_WORK  # prefill speed unknown: a probe
    guard.observe(_entries((10, 1), (0, 200)), seconds=0.3)  # 200 tokens beside a decode: 0.2 s of prefill
    assert guard.work_s == pytest.approx(0.001)
    assert guard.allowance().left == pytest.approx(0.5 * 0.1 / 0.001)  # 50 tokens' work
    with pytest.raises(ValueError):
        ItlGuard(1.0, 0.0)


def test_beside_a_decoding_stream_a_long_prompt_is_cut_to_the_allowance_and_a_short_one_is_computed_whole():
    sched = make_scheduler(num_blocks=512, block_size=4, max_num_batched_tokens=2048)
    stream = make_request(num_prompt_tokens=5, max_tokens=50, request_id="stream")
    sched.add_request(stream)
    sched.update(out := sched.schedule(), {s.request_id: 1 for s in out.scheduled if s.samples})
    long = make_request(num_prompt_tokens=1000, max_tokens=2, request_id="long")
    sched.add_request(long)
    assert sched.decoding
    sched.prefill_allowance = PrefillAllowance(40.0, 0.0)
    out = sched.schedule()
    assert [(s.request_id, s.num_new_tokens) for s in out.scheduled] == [("stream", 1), ("long", 40)]
    sched.update(out, {s.request_id: 1 for s in out.scheduled if s.samples})
    short = make_request(num_prompt_tokens=12, max_tokens=2, request_id="short")
    sched.add_request(short)
    sched.prefill_allowance = PrefillAllowance(40.0, 0.0)
    out = sched.schedule()  # a short prompt is computed whole beside it
    assert [(s.request_id, s.num_new_tokens) for s in out.scheduled] == [("stream", 1), ("long", 40), ("short", 12)]
    sched.update(out, {s.request_id: 1 for s in out.scheduled if s.samples})
    sched.prefill_allowance = None  # the guard off: the whole budget
    out = sched.schedule()
    assert dict((s.request_id, s.num_new_tokens) for s in out.scheduled)["long"] == 1000 - 80


def test_with_nothing_decoding_a_long_prompt_takes_full_chunks_unless_a_short_prompt_waits_next():
    sched = make_scheduler(num_blocks=512, block_size=4, max_num_batched_tokens=256)
    long = make_request(num_prompt_tokens=1000, max_tokens=2, request_id="long")
    long.tenant = "b"
    sched.add_request(long)
    sched.prefill_allowance = PrefillAllowance(40.0, 0.0)
    out = sched.schedule()  # alone: its allowance is not applied
    assert [(s.request_id, s.num_new_tokens) for s in out.scheduled] == [("long", 256)]
    sched.update(out, {})
    short = make_request(num_prompt_tokens=10, max_tokens=2, request_id="short")
    short.tenant = "a"
    sched.add_request(short)
    sched.prefill_allowance = PrefillAllowance(40.0, 0.0)
    out = sched.schedule()  # a short prompt waits: the long one is held to the allowance, the short one whole
    assert [(s.request_id, s.num_new_tokens) for s in out.scheduled] == [("long", 40), ("short", 10)]
