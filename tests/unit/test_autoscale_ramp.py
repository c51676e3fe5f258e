"""benchmarks/autoscale_ramp.py's worker-seconds: what the autoscaled fleet is compared on besides TTFT."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import autoscale_ramp  # noqa: E402


def test_worker_seconds_hold_each_sample_until_the_next():
    # (t, load, serving, started): 1 serving of 2 started for 2 s, then 2 of 3 (one starting) for 1 s, a missing
    # serving reading (holds the last) for 1 s, then 1 of 1 for 2 s; the last sample only closes the interval before it
    timeline = [(0.0, 1, 1.0, 2.0), (2.0, 8, 2.0, 3.0), (3.0, 8, None, 3.0), (4.0, 0, 1.0, 1.0), (6.0, 0, 1.0, 1.0)]
    serving, started = autoscale_ramp.worker_seconds(timeline)
    assert serving == pytest.approx(1 * 2 + 2 * 1 + 2 * 1 + 1 * 2)
    assert started == pytest.approx(2 * 2 + 3 * 1 + 3 * 1 + 1 * 2)


def test_a_fixed_fleet_serves_with_its_size_and_started_counts_live_worker_processes(monkeypatch):
    monkeypatch.setattr(autoscale_ramp, "started_workers", lambda pid: 2)
    assert autoscale_ramp.replicas("", 2, 123) == (2.0, 2.0)
    timeline = [(t, 0, *autoscale_ramp.replicas("", 2, 123)) for t in (0.0, 1.0, 2.5)]
    assert autoscale_ramp.worker_seconds(timeline) == pytest.approx((5.0, 5.0))


def test_started_workers_counts_only_engine_worker_processes(tmp_path):
    import subprocess

    import psutil

    # a process tree like up's: one engine worker (by its module name in the command line) and one other service
    script = ("import subprocess, sys, time; "
              "ps = [subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(30)', "
              "'-m', 'tokenfleet.services.decode']), subprocess.Popen([sys.executable, '-c', "
              "'import time; time.sleep(30)', 'tokenfleet.services.router'])]; time.sleep(30)")
    parent = subprocess.Popen([sys.executable, "-c", script])
    try:
        import time

        for _ in range(100):
            if len(psutil.Process(parent.pid).children()) == 2:
                break
            time.sleep(0.05)
        assert autoscale_ramp.started_workers(parent.pid) == 1
    finally:
        for child in psutil.Process(parent.pid).children(recursive=True):
            child.kill()
        parent.kill()
    assert autoscale_ramp.started_workers(parent.pid) == 0  # gone: nothing counted, no error
