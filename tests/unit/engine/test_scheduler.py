from __future__ import annotations

import pytest

from tests.conftest import make_request, make_scheduler
from tokenfleet.engine.request import FinishReason, Priority, RequestStatus
from tokenfleet.engine.scheduler import QueueFullError, SchedulerOutput


def run_step(sched, token: int = 1) -> SchedulerOutput:
    out = sched.schedule(0.0)
    sched.update(out, {s.request_id: token for s in out.scheduled if s.samples})
    sched.block_manager.check_invariants()
    return out


def summary(out: SchedulerOutput) -> list[tuple[str, int, int, bool]]:
    return [(s.request_id, s.start, s.num_new_tokens, s.samples) for s in out.scheduled]


def test_prefill_then_decode_exact_counts_and_blocks():
    sched = make_scheduler(num_blocks=16, block_size=4)
    r = make_request(num_prompt_tokens=10, max_tokens=3, request_id="a")
    sched.add_request(r)
    out = run_step(sched)
    assert summary(out) == [("a", 0, 10, True)]
    assert out.scheduled[0].block_ids == (0, 1, 2)
    assert r.num_computed_tokens == 10 and r.output_token_ids == [1]
    out = run_step(sched)
    assert summary(out) == [("a", 10, 1, True)]
    assert r.num_computed_tokens == 11
    out = run_step(sched)
    assert summary(out) == [("a", 11, 1, True)]
    assert r.is_finished and r.finish_reason is FinishReason.LENGTH
    assert sched.block_manager.num_used_blocks == 0
    assert not sched.has_unfinished()


def test_chunked_prefill_respects_token_budget_and_decodes_go_first():
    sched = make_scheduler(num_blocks=32, block_size=4, max_num_batched_tokens=8)
    a = make_request(num_prompt_tokens=3, max_tokens=5, request_id="a")
    sched.add_request(a)
    run_step(sched)  # a prefilled, 1 output token
    b = make_request(num_prompt_tokens=12, max_tokens=2, request_id="b")
    sched.add_request(b)
    out = run_step(sched)
    assert summary(out) == [("a", 3, 1, True), ("b", 0, 7, False)]
    assert b.output_token_ids == [] and b.num_computed_tokens == 7
    out = run_step(sched)
    assert summary(out) == [("a", 4, 1, True), ("b", 7, 5, True)]
    assert b.output_token_ids == [1]


def test_max_prefill_chunk_caps_each_request():
    sched = make_scheduler(num_blocks=32, block_size=4, max_num_batched_tokens=100, max_prefill_chunk=4)
    sched.add_request(make_request(num_prompt_tokens=9, request_id="a"))
    assert [s.num_new_tokens for s in run_step(sched).scheduled] == [4]
    assert [s.num_new_tokens for s in run_step(sched).scheduled] == [4]
    last = run_step(sched).scheduled[0]
    assert (last.start, last.num_new_tokens, last.samples) == (8, 1, True)


def test_admission_requires_free_blocks_and_keeps_fcfs():
    sched = make_scheduler(num_blocks=4, block_size=4)
    sched.add_request(make_request(num_prompt_tokens=12, max_tokens=1, request_id="a"))
    sched.add_request(make_request(num_prompt_tokens=8, max_tokens=1, request_id="b"))
    sched.add_request(make_request(num_prompt_tokens=2, max_tokens=1, request_id="c"))
    out = run_step(sched)
    # a takes 3 blocks; b needs 2 of the 1 left, so b waits and c (behind b) waits too: FCFS.
    assert summary(out) == [("a", 0, 12, True)]
    assert [r.request_id for _, r in sched.waiting] == ["b", "c"]
    out = run_step(sched)
    assert summary(out) == [("b", 0, 8, True), ("c", 0, 2, True)]


def test_priority_classes_before_fcfs():
    sched = make_scheduler(num_blocks=16, block_size=4, max_num_batched_tokens=4)
    sched.add_request(make_request(num_prompt_tokens=4, priority=Priority.BATCH, request_id="batch"))
    sched.add_request(make_request(num_prompt_tokens=4, priority=Priority.INTERACTIVE, request_id="chat"))
    assert summary(run_step(sched)) == [("chat", 0, 4, True)]
    assert summary(run_step(sched)) == [("chat", 4, 1, True), ("batch", 0, 3, False)]


def test_preemption_frees_the_lowest_priority_latest_request_and_recomputes_it():
    sched = make_scheduler(num_blocks=4, block_size=4)
    a = make_request(num_prompt_tokens=7, max_tokens=10, request_id="a")
    b = make_request(num_prompt_tokens=7, max_tokens=10, request_id="b")
    sched.add_request(a)
    sched.add_request(b)
    run_step(sched)  # both prefilled (7 tokens, 2 blocks each)
    assert sched.block_manager.num_free_blocks == 0
    assert run_step(sched).preempted_ids == ()  # position 7 still fits in block 2
    out = run_step(sched)  # a needs a 3rd block for position 8 -> b (latest) is preempted
    assert out.preempted_ids == ("b",)
    assert summary(out) == [("a", 8, 1, True)]
    assert b.status is RequestStatus.PREEMPTED and b.num_computed_tokens == 0
    assert b.output_token_ids == [1, 1] and b.num_preemptions == 1
    assert sched.num_preemptions == 1
    # Once a finishes, b is readmitted and recomputes prompt + its earlier output.
    while not a.is_finished:
        run_step(sched)
    out = run_step(sched)
    assert summary(out) == [("b", 0, 9, True)]


def test_preempting_itself_when_it_is_the_only_victim():
    sched = make_scheduler(num_blocks=2, block_size=4)
    a = make_request(num_prompt_tokens=8, max_tokens=4, request_id="a")
    sched.add_request(a)
    run_step(sched)
    out = run_step(sched)  # needs block 3 of 2: preempts itself
    assert out.preempted_ids == ("a",) and out.scheduled == ()
    assert a.status is RequestStatus.PREEMPTED


def test_prefix_cache_hit_skips_cached_blocks_and_reports_tokens():
    sched = make_scheduler(num_blocks=16, block_size=4)
    shared = list(range(1, 13))
    first = make_request(prompt_token_ids=shared + [50], max_tokens=1, request_id="first")
    sched.add_request(first)
    run_step(sched)
    second = make_request(prompt_token_ids=shared + [60, 61], max_tokens=1, request_id="second")
    sched.add_request(second)
    out = run_step(sched)
    assert summary(out) == [("second", 12, 2, True)]
    assert second.num_cached_tokens == 12


def test_full_prompt_hit_still_computes_the_last_token():
    sched = make_scheduler(num_blocks=16, block_size=4)
    prompt = list(range(1, 9))
    sched.add_request(make_request(prompt_token_ids=prompt, max_tokens=1, request_id="x"))
    run_step(sched)
    again = make_request(prompt_token_ids=prompt, max_tokens=1, request_id="y")
    sched.add_request(again)
    out = run_step(sched)
    assert summary(out) == [("y", 4, 4, True)]
    assert again.num_cached_tokens == 4


def test_stop_conditions():
    sched = make_scheduler()
    eos = make_request(num_prompt_tokens=3, max_tokens=5, eos_token_ids=(9,), request_id="eos")
    sched.add_request(eos)
    run_step(sched, token=9)
    assert eos.finish_reason is FinishReason.STOP
    ignore = make_request(num_prompt_tokens=3, max_tokens=2, eos_token_ids=(9,), ignore_eos=True, request_id="ign")
    sched.add_request(ignore)
    run_step(sched, token=9)
    assert not ignore.is_finished
    stop_id = make_request(num_prompt_tokens=3, max_tokens=5, stop_token_ids=(4,), min_tokens=2, request_id="sid")
    sched.add_request(stop_id)
    run_step(sched, token=4)
    assert not stop_id.is_finished  # min_tokens not reached
    run_step(sched, token=4)
    assert stop_id.finish_reason is FinishReason.STOP


def test_model_length_limit_finishes_with_length():
    sched = make_scheduler(max_model_len=6)
    r = make_request(num_prompt_tokens=4, max_tokens=100, request_id="r")
    sched.add_request(r)
    run_step(sched)
    run_step(sched)
    assert r.finish_reason is FinishReason.LENGTH and r.num_tokens == 6


def test_waiting_queue_is_bounded():
    sched = make_scheduler(max_num_waiting=2)
    sched.add_request(make_request())
    sched.add_request(make_request())
    with pytest.raises(QueueFullError, match="full"):
        sched.add_request(make_request())


def test_prompt_larger_than_the_cache_is_rejected():
    sched = make_scheduler(num_blocks=2, block_size=4)
    with pytest.raises(ValueError, match="KV blocks"):
        sched.add_request(make_request(num_prompt_tokens=9))


def test_finish_request_frees_waiting_and_running():
    sched = make_scheduler(num_blocks=16, block_size=4)
    running = make_request(num_prompt_tokens=5, max_tokens=5, request_id="run")
    sched.add_request(running)
    run_step(sched)
    waiting = make_request(num_prompt_tokens=5, request_id="wait")
    sched.add_request(waiting)
    sched.finish_request("run", FinishReason.ABORT)
    sched.finish_request("wait", FinishReason.ABORT)
    assert sched.finish_request("wait", FinishReason.ABORT) is None
    assert running.finish_reason is FinishReason.ABORT and waiting.is_finished
    assert sched.block_manager.num_used_blocks == 0 and not sched.has_unfinished()
    sched.block_manager.check_invariants()


def test_running_cap():
    sched = make_scheduler(max_num_running=2)
    for _ in range(3):
        sched.add_request(make_request(num_prompt_tokens=2))
    out = run_step(sched)
    assert len(out.scheduled) == 2 and sched.num_waiting == 1
