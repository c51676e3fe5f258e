"""Canary rollouts' decision and loop (cluster.rollout) over a scripted fleet: steps advance when the canary
matches the baseline, a named regression rolls back at once, operators pause, override and abort, and the
per-version counters are read from gateway /metrics text."""

from __future__ import annotations

import pytest

from tokenfleet.cluster.rollout import Rollout, RolloutConfig, VersionStats, judge, merge_stats, parse_version_stats

CONFIG = RolloutConfig(steps=(0.1, 0.5, 1.0), step_seconds=10, poll_seconds=1, min_requests=5)


class Fleet:
    """A scripted fleet: per poll, each version gets requests in proportion to the canary's weight."""

    def __init__(self, canary_error_rate: float = 0.0, canary_ttft: float = 0.1):
        self.weight = 0.0
        self.now = 0.0
        self.totals = {"m@v1": VersionStats(), "m@v2": VersionStats()}
        self.canary_error_rate, self.canary_ttft = canary_error_rate, canary_ttft
        self.controls: dict[float, str] = {}  # at time t, the operator sends this
        self.records: list[dict] = []
        self.alias = ("m@v1", "", 0.0)

    def clock(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds
        for ref, share, errors, ttft in (("m@v1", 1 - self.weight, 0.0, 0.1),
                                         ("m@v2", self.weight, self.canary_error_rate, self.canary_ttft)):
            n = 20 * share  # 20 requests/s
            s = self.totals[ref]
            s.requests += n
            s.errors += n * errors
            s.ttft_sum += n * ttft
            s.ttft_count += n

    def set_weight(self, weight: float) -> None:
        self.weight = weight
        self.alias = ("m@v1", "m@v2", weight)

    def promote(self) -> None:
        self.weight, self.alias = 1.0, ("m@v2", "", 0.0)

    def roll_back(self) -> None:
        self.weight, self.alias = 0.0, ("m@v1", "", 0.0)

    def stats(self) -> dict[str, VersionStats]:
        return {k: VersionStats(**vars(v)) for k, v in self.totals.items()}

    def control(self) -> str:
        due = [t for t in self.controls if t <= self.now]
        return self.controls.pop(min(due)) if due else ""

    def record(self, state: dict) -> None:
        self.records.append(state)

    def evaluate(self) -> float | None:
        return None


def rollout(fleet: Fleet, config: RolloutConfig = CONFIG) -> Rollout:
    return Rollout("prod", "m@v1", "m@v2", config, fleet, clock=fleet.clock, sleep=fleet.sleep)


def test_a_healthy_canary_is_promoted_step_by_step():
    fleet = Fleet()
    r = rollout(fleet)
    assert r.run() == "done" and fleet.alias == ("m@v2", "", 0.0)
    weights = [e["weight"] for e in r.history if e["event"] == "weight"]
    assert weights == [0.1, 0.5, 1.0] and fleet.now == pytest.approx(30)
    assert fleet.records[-1]["state"] == "done" and fleet.records[-1]["history"][-1]["event"] == "promoted"


def test_a_failing_canary_is_rolled_back_as_soon_as_it_can_be_named():
    fleet = Fleet(canary_error_rate=0.5)
    r = rollout(fleet)
    assert r.run() == "rolled_back" and fleet.alias == ("m@v1", "", 0.0)
    assert "error rate 50.0%" in r.history[-1]["detail"]
    assert fleet.now <= 3  # 2 canary requests a second at 10 %: five of them within 3 s, not the 10 s step


def test_a_slow_canary_is_rolled_back_with_its_latency_named():
    fleet = Fleet(canary_ttft=0.5)
    assert rollout(fleet).run() == "rolled_back"
    assert "TTFT 500 ms vs 100 ms" in fleet.records[-1]["history"][-1]["detail"]


def test_operators_pause_override_and_abort():
    fleet = Fleet()
    fleet.controls = {2.0: "pause", 30.0: "resume"}
    r = rollout(fleet)
    assert r.run() == "done"
    assert fleet.now == pytest.approx(58)  # 28 s paused did not count towards the steps
    assert [e["event"] for e in r.history][:3] == ["weight", "paused", "running"]
    fleet = Fleet()
    fleet.controls = {3.0: "weight=0.3", 6.0: "abort"}
    r = rollout(fleet)
    assert r.run() == "rolled_back" and r.history[-1]["detail"] == "aborted by the operator"
    assert any(e["event"] == "weight" and e["weight"] == 0.3 for e in r.history)


def test_judge_needs_enough_canary_requests():
    base = VersionStats(requests=100, errors=0)
    assert judge(base, VersionStats(requests=4, errors=4), CONFIG) is None  # too few to name
    assert judge(base, VersionStats(requests=5, errors=1), CONFIG) is not None  # 20 % vs 0 %
    assert judge(base, VersionStats(requests=50, errors=2), CONFIG) is None  # 4 %: within max_error_increase


def test_bad_steps_are_refused():
    for steps in ((), (0.5, 0.1), (0.0, 1.0), (1.5,)):
        with pytest.raises(ValueError):
            RolloutConfig(steps=steps)


def test_version_counters_from_gateway_metrics_text():
    text = """# TYPE tokenfleet_gateway_version_requests counter
tokenfleet_gateway_version_requests_total{ref="m@v1",status="ok"} 10.0
tokenfleet_gateway_version_requests_total{ref="m@v2",status="ok"} 3.0
tokenfleet_gateway_version_requests_total{ref="m@v2",status="failed"} 2.0
tokenfleet_gateway_version_requests_total{ref="m@v2",status="cancelled"} 1.0
# TYPE tokenfleet_gateway_version_ttft_seconds histogram
tokenfleet_gateway_version_ttft_seconds_sum{ref="m@v2"} 0.6
tokenfleet_gateway_version_ttft_seconds_count{ref="m@v2"} 3.0
"""
    one = parse_version_stats(text)
    assert (one["m@v2"].requests, one["m@v2"].errors, one["m@v2"].ttft) == (6.0, 2.0, pytest.approx(0.2))
    both = merge_stats([one, one])
    assert both["m@v1"].requests == 20 and both["m@v2"].errors == 4


def test_unreadable_metrics_or_a_failure_put_the_alias_back():
    fleet = Fleet()
    broken = Fleet.stats

    def flaky(self):  # the gateways stop answering once the canary is up
        if self.weight > 0:
            raise OSError("connection refused")
        return broken(self)

    fleet.stats = flaky.__get__(fleet)
    r = rollout(fleet)
    assert r.run() == "rolled_back" and fleet.alias == ("m@v1", "", 0.0)
    assert "no metrics for 5 polls" in r.history[-1]["detail"]

    fleet = Fleet()
    calls = []

    def failing_set_weight(weight):
        calls.append(weight)
        if len(calls) == 2:
            raise RuntimeError("registry unavailable")
        Fleet.set_weight(fleet, weight)

    fleet.set_weight = failing_set_weight
    with pytest.raises(RuntimeError):
        rollout(fleet).run()
    assert fleet.alias == ("m@v1", "", 0.0) and fleet.records[-1]["state"] == "rolled_back"


def test_a_bad_weight_control_is_ignored():
    fleet = Fleet()
    fleet.controls = {2.0: "weight=lots", 3.0: "weight=1.5"}
    r = rollout(fleet)
    assert r.run() == "done"
    assert [e["event"] for e in r.history].count("ignored") == 2
