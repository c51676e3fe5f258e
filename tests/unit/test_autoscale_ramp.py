"""benchmarks/autoscale_ramp.py's worker-seconds: what the autoscaled fleet is compared on besides TTFT."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import autoscale_ramp  # noqa: E402


def test_worker_seconds_hold_each_sample_until_the_next():
    # (t, load, serving, standby): 1 serving + 1 standby for 2 s, then 2 serving for 1 s (a missing reading holds
    # the last), then 1 serving for 2 s; the last sample only closes the interval before it
    timeline = [(0.0, 1, 1.0, 1.0), (2.0, 8, 2.0, 0.0), (3.0, 8, None, None), (4.0, 0, 1.0, 0.0), (6.0, 0, 1.0, 0.0)]
    serving, with_standby = autoscale_ramp.worker_seconds(timeline)
    assert serving == pytest.approx(1 * 2 + 2 * 1 + 2 * 1 + 1 * 2)
    assert with_standby == pytest.approx(2 * 2 + 2 * 1 + 2 * 1 + 1 * 2)


def test_a_fixed_fleet_counts_its_size_for_the_whole_run():
    assert autoscale_ramp.replicas("", 2) == (2.0, 0.0)
    timeline = [(t, 0, *autoscale_ramp.replicas("", 2)) for t in (0.0, 1.0, 2.5)]
    assert autoscale_ramp.worker_seconds(timeline) == pytest.approx((5.0, 5.0))
