"""The early-rejection estimate: queued prompt tokens over the recent prefill rate."""

from __future__ import annotations

import pytest

from tokenfleet.engine.stats import EngineStats


def test_predicted_wait_uses_the_recent_prefill_rate():
    stats = EngineStats()
    assert stats.predicted_wait(1000) == 0.0  # no rate yet: never reject blind
    stats.record_prefill_rate(1000, 0.5)  # 2,000 tokens/s
    stats.num_queued_prompt_tokens = 3000
    assert stats.predicted_wait(1000) == pytest.approx(2.0)
    stats.record_prefill_rate(1000, 1.0)  # slower now: the EMA moves toward 1,000 tokens/s
    assert 1000 < stats.prefill_tokens_per_s < 2000
    assert stats.predicted_wait(1000) > 2.0


def test_a_stale_rate_refuses_nothing_that_has_no_queue_ahead_of_it():
    stats = EngineStats()
    stats.record_prefill_rate(128, 10.0, now=100.0)  # a warm-up step that compiled kernels: ~13 tokens/s
    assert stats.predicted_wait(512, now=105.0) > 30  # fresh: trusted, even with nothing queued
    # Only prefills refresh the rate: refusing every prompt would keep this one forever. An idle replica serves
    # the next prompt once the rate is stale...
    assert stats.predicted_wait(512, now=111.0) == 0.0
    # ...but a queue, which drains by itself (and refreshes the rate as it does), is still judged by it
    stats.num_queued_prompt_tokens = 512
    assert stats.predicted_wait(512, now=111.0) > 60
    stats.record_prefill_rate(512, 0.01, now=112.0)  # the prompt served: the rate recovers at once
    assert stats.predicted_wait(512, now=112.0) < 1.0


def test_forgetting_the_rate_makes_it_unknown():
    stats = EngineStats()
    stats.record_prefill_rate(128, 10.0)
    stats.forget_prefill_rate()
    assert stats.prefill_tokens_per_s == 0.0 and stats.predicted_wait(100_000) == 0.0
    stats.record_prefill_rate(1000, 0.5)  # the next sample starts the average afresh
    assert stats.prefill_tokens_per_s == pytest.approx(2000)


def test_small_prefill_steps_do_not_move_the_rate():
    """A step's fixed cost dominates a few prompt tokens: 4 tokens in 60 ms is no prefill rate of 66 tokens/s."""
    stats = EngineStats()
    stats.record_prefill_rate(4, 0.06)
    assert stats.prefill_tokens_per_s == 0.0 and stats.predicted_wait(2452) == 0.0
    stats.record_prefill_rate(1300, 1.0)
    for _ in range(20):
        stats.record_prefill_rate(4, 0.06)  # chat turns with short prompts between the long ones
    assert stats.prefill_tokens_per_s == pytest.approx(1300)
    stats.num_queued_prompt_tokens = 600
    assert stats.predicted_wait(2452) == pytest.approx(3052 / 1300)
