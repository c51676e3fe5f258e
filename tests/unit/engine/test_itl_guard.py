"""The ITL guard: beside decoding streams a step gives prompt chunks only the time the guard's factor allows, a
waiting short prompt still starts at once, and a prompt always advances."""

from __future__ import annotations

import pytest

from tests.conftest import make_request, make_scheduler
from tokenfleet.engine.itl_guard import PROBE_WORK, ItlGuard, Objectives, PrefillAllowance, banked_slack, chunk_work
from tokenfleet.engine.scheduler import ScheduledRequest


def test_chunk_work_counts_attention_pairs_so_a_chunk_deep_in_a_context_costs_more():
    assert chunk_work(0, 4, 0.0) == 4
    assert chunk_work(0, 4, 0.5) == 4 + 0.5 * 10  # causal pairs of 4 new tokens: 1 + 2 + 3 + 4
    assert chunk_work(1000, 4, 0.5) > chunk_work(0, 4, 0.5)


def test_the_allowance_gives_the_largest_chunk_that_fits_and_one_token_only_to_the_first_long_prompt():
    allowance = PrefillAllowance(left=10.0, pair_cost=0.0)
    assert allowance.tokens(0, 8) == 8
    assert allowance.tokens(0, 64) == 10
    allowance.spend(0, 10, long=False)  # a short prompt's work: no long prompt has advanced yet
    assert allowance.left == 0 and allowance.tokens(0, 64) == 1  # the first long prompt always advances
    allowance.spend(0, 1, long=True)
    assert allowance.tokens(0, 64) == 0  # the next long prompt waits
    deep = PrefillAllowance(left=10.0, pair_cost=0.01)
    assert deep.tokens(1000, 64) == 1 and deep.tokens(0, 64) == 9  # 9 + 0.01 * 45 <= 10 < 10 + 0.01 * 55


def _entries(*shapes: tuple[int, int]) -> list[ScheduledRequest]:
    return [ScheduledRequest(f"r{i}", start, n, (), True) for i, (start, n) in enumerate(shapes)]


def _decoding_stream(tenant: str = "", **config: object):  # type: ignore[no-untyped-def]
    """A scheduler whose one request, "stream", is decoding."""
    sched = make_scheduler(num_blocks=4096, block_size=4, max_num_batched_tokens=2048, **config)
    stream = make_request(num_prompt_tokens=5, max_tokens=500, request_id="stream")
    stream.tenant = tenant
    sched.add_request(stream)
    _step(sched, None)
    return sched


def _prompt(sched, name: str, tokens: int, tenant: str = "") -> None:  # type: ignore[no-untyped-def]
    request = make_request(num_prompt_tokens=tokens, max_tokens=2, request_id=name)
    request.tenant = tenant
    sched.add_request(request)


def _step(sched, allowance: PrefillAllowance | None) -> list[tuple[str, int]]:  # type: ignore[no-untyped-def]
    """One step under ``allowance``, its tokens sampled: (request id, tokens) of what it scheduled."""
    sched.prefill_allowance = allowance
    out = sched.schedule(0.0)
    sched.update(out, {s.request_id: 1 for s in out.scheduled if s.samples})
    return [(s.request_id, s.num_new_tokens) for s in out.scheduled]


def test_a_long_prompts_single_token_is_prefill_work_not_a_decode():
    """A step of decodes plus one token of a prompt deep in its context must not teach the guard that decoding is
    slow (the allowance would grow with every such step)."""
    guard = ItlGuard(1.5, pair_cost=0.01)
    guard.observe(_entries((10, 1), (12, 1)), seconds=0.1)
    guard.observe([*_entries((10, 1), (12, 1)), ScheduledRequest("long", 6000, 1, (), False)], seconds=0.4)
    assert guard.decode_s == pytest.approx(0.1)  # unchanged
    assert guard.work_s == pytest.approx(0.3 / chunk_work(6000, 1, 0.01))


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


def test_a_tpot_objective_boosts_only_a_long_prompt_whose_ttft_is_at_risk():
    """Decode steps of 0.04 s, 0.001 s a token of prefill, factor 1.5: 20 tokens a step at the factor's pace (0.06 s
    steps). A 0.1 s TPOT objective lets a step grow to 0.08 s: 20 more tokens, for a prompt that would miss its TTFT
    deadline at 20 a step, and for no other."""
    guard = ItlGuard(1.5, pair_cost=0.0, objectives=Objectives(0.5, 0.001, 0.1))
    guard.observe(_entries((10, 1), (12, 1)), seconds=0.04)
    guard.observe(_entries((10, 1), (0, 100)), seconds=0.14)  # 100 tokens beside a decode: 0.1 s, 0.001 s a token
    assert guard.boost_s() == pytest.approx(0.02)
    calm = guard.allowance()
    assert (calm.left, calm.boost) == (pytest.approx(20.0), pytest.approx(20.0))
    # 1,000 tokens left at 20 a step: 50 steps of 0.06 s = 3 s; 5 s left of its deadline: no boost
    assert calm.tokens(0, 1000, remaining=1000, seconds_left=5.0) == 20
    urgent = guard.allowance()  # 2 s left: at risk, so it takes the boost too
    assert urgent.tokens(0, 1000, remaining=1000, seconds_left=2.0) == 40 and urgent.boost == 0.0
    assert ItlGuard(1.5, 0.0).boost_s() == 0.0  # no TPOT objective: nothing to spend
    slow = ItlGuard(1.5, pair_cost=0.0, objectives=Objectives(tpot_s=0.1))
    slow.observe(_entries((10, 1), (12, 1)), seconds=0.09)  # decodes near the objective already
    assert slow.boost_s() == 0.0  # the factor's half a decode step is all there is
    with pytest.raises(ValueError):
        Objectives(tpot_s=float("nan"))


def test_streams_bank_the_slack_their_tpot_objective_leaves_and_a_step_may_spend_the_least_of_it():
    """0.1 s TPOT objective, headroom 0.8: a stream 20 tokens in after 1 s, with no more expected, may wait
    0.8 x 0.1 x 20 - 1 = 0.6 s for its next token; with 10 more expected at 0.04 s each, 0.8 x 3 - 1 - 0.4 = 1.0 s;
    one just started, 0.08 s; one already over its objective, none."""
    assert banked_slack([(9.0, 20, 0)], now=10.0, tpot_s=0.1, decode_s=0.04) == pytest.approx(0.6)
    assert banked_slack([(9.0, 20, 10)], now=10.0, tpot_s=0.1, decode_s=0.04) == pytest.approx(1.0)
    assert banked_slack([(9.0, 20, 0), (10.0, 1, 0)], now=10.0, tpot_s=0.1, decode_s=0.04) == pytest.approx(0.08)
    assert banked_slack([(0.0, 20, 0)], now=10.0, tpot_s=0.1, decode_s=0.04) < 0
    assert banked_slack([], now=10.0, tpot_s=0.1, decode_s=0.04) is None
    assert banked_slack([(9.0, 20, 0)], now=10.0, tpot_s=0.0, decode_s=0.04) is None  # no TPOT objective
    guard = ItlGuard(1.5, pair_cost=0.0, objectives=Objectives(0.5, 0.001, 0.1))
    guard.observe(_entries((10, 1), (12, 1)), seconds=0.04)
    guard.observe(_entries((10, 1), (0, 100)), seconds=0.14)  # 0.001 s a token of prefill
    assert guard.allowance(0.6).left == pytest.approx(560.0)  # 0.6 s less the step's 0.04 s of decodes
    assert guard.allowance(0.6).boost == 0.0  # more than an at-risk prompt's boost already
    assert guard.allowance(0.05).left == pytest.approx(20.0)  # under the factor's pace: the factor's
    assert guard.allowance(-1.0).left == pytest.approx(20.0)
    assert guard.allowance(0.07).boost == pytest.approx(10.0)  # at risk: up to the boosted 40 tokens
    assert guard.expected_more(5, 100) == 1  # nothing finished yet: one more token at least
    for n in (30, 50):
        guard.finished(n)
    assert guard.output_len == pytest.approx(34.0)  # the running estimate
    assert (guard.expected_more(5, 100), guard.expected_more(5, 20), guard.expected_more(40, 100)) == (29, 15, 1)
    smooth = ItlGuard(1.5, pair_cost=0.0)
    smooth.observe(_entries((10, 1), (12, 1)), seconds=0.04)
    smooth.observe(_entries((10, 1), (0, 100)), seconds=0.14)
    assert smooth.allowance(0.6).left == pytest.approx(20.0)  # without a TPOT objective slack is not spent


def test_the_scheduler_judges_a_long_prompts_deadline_from_its_arrival():
    sched = make_scheduler(num_blocks=512, block_size=4, max_num_batched_tokens=2048)
    stream = make_request(num_prompt_tokens=5, max_tokens=50, request_id="stream")
    sched.add_request(stream)
    sched.update(out := sched.schedule(0.0), {s.request_id: 1 for s in out.scheduled if s.samples})
    long = make_request(num_prompt_tokens=1000, max_tokens=2, request_id="long", arrival_time=0.0)  # deadline 1.5 s
    sched.add_request(long)
    objectives = Objectives(0.5, 0.001, 0.1)
    sched.prefill_allowance = PrefillAllowance(40.0, 0.0, boost=40.0, step_s=0.06, per_step=40.0,
                                               objectives=objectives)
    out = sched.schedule(0.0)  # 1,000 tokens at 40 a step: 25 steps, 1.5 s: in time for 1.5 s
    assert [(s.request_id, s.num_new_tokens) for s in out.scheduled] == [("stream", 1), ("long", 40)]
    sched.update(out, {s.request_id: 1 for s in out.scheduled if s.samples})
    sched.prefill_allowance = PrefillAllowance(40.0, 0.0, boost=40.0, step_s=0.06, per_step=40.0,
                                               objectives=objectives)
    out = sched.schedule(0.6)  # 960 left: 24 steps, 1.44 s, with 0.9 s left: boosted
    assert [(s.request_id, s.num_new_tokens) for s in out.scheduled] == [("stream", 1), ("long", 80)]


def test_beside_a_decoding_stream_a_long_prompt_is_cut_to_the_allowance_and_a_short_one_is_computed_whole():
    sched = make_scheduler(num_blocks=512, block_size=4, max_num_batched_tokens=2048)
    stream = make_request(num_prompt_tokens=5, max_tokens=50, request_id="stream")
    sched.add_request(stream)
    sched.update(out := sched.schedule(0.0), {s.request_id: 1 for s in out.scheduled if s.samples})
    long = make_request(num_prompt_tokens=1000, max_tokens=2, request_id="long")
    sched.add_request(long)
    assert sched.decoding
    sched.prefill_allowance = PrefillAllowance(40.0, 0.0)
    out = sched.schedule(0.0)
    assert [(s.request_id, s.num_new_tokens) for s in out.scheduled] == [("stream", 1), ("long", 40)]
    sched.update(out, {s.request_id: 1 for s in out.scheduled if s.samples})
    short = make_request(num_prompt_tokens=12, max_tokens=2, request_id="short")
    sched.add_request(short)
    sched.prefill_allowance = PrefillAllowance(40.0, 0.0)
    out = sched.schedule(0.0)  # a short prompt is computed whole beside it
    assert [(s.request_id, s.num_new_tokens) for s in out.scheduled] == [("stream", 1), ("long", 40), ("short", 12)]
    sched.update(out, {s.request_id: 1 for s in out.scheduled if s.samples})
    sched.prefill_allowance = None  # the guard off: the whole budget
    out = sched.schedule(0.0)
    assert dict((s.request_id, s.num_new_tokens) for s in out.scheduled)["long"] == 1000 - 80


def test_with_nothing_decoding_a_long_prompt_takes_full_chunks_unless_a_short_prompt_waits_next():
    sched = make_scheduler(num_blocks=512, block_size=4, max_num_batched_tokens=256)
    long = make_request(num_prompt_tokens=1000, max_tokens=2, request_id="long")
    long.tenant = "b"
    sched.add_request(long)
    sched.prefill_allowance = PrefillAllowance(40.0, 0.0)
    out = sched.schedule(0.0)  # alone: its allowance is not applied
    assert [(s.request_id, s.num_new_tokens) for s in out.scheduled] == [("long", 256)]
    sched.update(out, {})
    short = make_request(num_prompt_tokens=10, max_tokens=2, request_id="short")
    short.tenant = "a"
    sched.add_request(short)
    sched.prefill_allowance = PrefillAllowance(40.0, 0.0)
    out = sched.schedule(0.0)  # a short prompt waits: the long one is held to the allowance, the short one whole
    assert [(s.request_id, s.num_new_tokens) for s in out.scheduled] == [("long", 40), ("short", 10)]


def test_beside_decoding_streams_several_long_prompts_do_not_each_take_a_token_only_the_first_advances():
    """Four prompts deep into a long context each taking "at least one token" would each cost an attention over the
    whole context, every step: the streams' steps would be several times longer whatever the allowance said."""
    sched = _decoding_stream(max_prefill_chunk=100)
    for i in range(3):
        _prompt(sched, f"long{i}", 3000)
    # the guard off for a step: every long prompt is admitted and starts
    assert {name for name, _ in _step(sched, None)} == {"stream", "long0", "long1", "long2"}
    assert _step(sched, PrefillAllowance(0.0, 0.0)) == [("stream", 1), ("long0", 1)]  # nothing to spare
    # enough for one whole chunk and half of the next
    assert _step(sched, PrefillAllowance(150.0, 0.0)) == [("stream", 1), ("long0", 100), ("long1", 50)]
    assert sched.requests["long2"].num_computed_tokens == 100  # held back, its blocks kept


def test_a_stale_decode_figure_is_refreshed_by_a_decode_only_step_every_refresh_steps():
    """While a long prompt advances beside the streams no step is decode-only; every REFRESH_STEPS steps the guard
    makes one (long prompts wait that step) and takes its time as the new figure."""
    from tokenfleet.engine.itl_guard import REFRESH_STEPS

    guard = ItlGuard(1.5, pair_cost=0.0)
    guard.observe(_entries((8000, 1), (10, 1)), seconds=0.4)  # a neighbour's long-context decode, since finished
    guard.observe(_entries((10, 1), (0, 100)), seconds=0.5)  # the first step beside a prompt
    for _ in range(REFRESH_STEPS - 2):
        guard.observe(_entries((10, 1), (500, 10)), seconds=0.45)
        assert guard.allowance().left > 0
    guard.observe(_entries((10, 1), (500, 10)), seconds=0.45)
    held = guard.allowance()
    assert held.left == 0.0 and held.tokens(600, 64) == 0  # even the first long prompt waits
    guard.observe(_entries((10, 1)), seconds=0.03)  # the decode-only step
    assert guard.decode_s == pytest.approx(0.03) and guard.since_decode == 0
    assert guard.allowance().left > 0


def test_a_step_that_starts_a_short_prompt_does_not_also_advance_a_long_one_past_the_allowance():
    """A short prompt computed whole already makes the streams' step long (the slowest steps, those a p99 sees):
    the first long prompt's one guaranteed token waits for the next step."""
    sched = _decoding_stream()
    _prompt(sched, "long", 3000, tenant="b")
    assert _step(sched, PrefillAllowance(0.0, 0.0)) == [("stream", 1), ("long", 1)]
    _prompt(sched, "short", 40, tenant="a")
    assert _step(sched, PrefillAllowance(0.0, 0.0)) == [("stream", 1), ("short", 40)]
    assert ("long", 1) in _step(sched, PrefillAllowance(0.0, 0.0))  # the long prompt advances again


def test_a_held_long_prompt_first_in_the_waiting_queue_does_not_keep_a_short_one_behind_it_waiting():
    """The fair queue may put a long prompt first (its tenant's counter is the smaller); held back by the guard, it
    must not block the short prompt behind it (else the streams end, nothing decodes, and the long prompts take full
    chunks for many seconds while the short one waits)."""
    sched = _decoding_stream(tenant="a")
    _prompt(sched, "long1", 3000, tenant="b")
    _prompt(sched, "long2", 3000, tenant="b")
    assert _step(sched, PrefillAllowance(0.0, 0.0)) == [("stream", 1), ("long1", 1)]
    _prompt(sched, "short", 40, tenant="a")
    sched.waiting.counters["a"] = sched.waiting.counters.get("b", 0.0) + 1000  # b's long2 comes first in line
    assert sched.waiting.peek().request_id == "long2"
    assert _step(sched, PrefillAllowance(0.0, 0.0)) == [("stream", 1), ("short", 40)]
    assert [r.request_id for r in sched.waiting.requests()] == ["long2"]
