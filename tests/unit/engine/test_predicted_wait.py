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
