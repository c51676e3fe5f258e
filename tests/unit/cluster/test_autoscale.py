"""The autoscaling policy: trend, queue and KV triggers, bounds, steps, cooldowns, hysteresis, pause, override."""

from __future__ import annotations

import pytest

from tokenfleet.cluster.autoscale import Autoscaler, Sample, ScalePolicy, _slope, capacity_from_plan

POLICY = ScalePolicy(target_concurrency=4, min_replicas=1, max_replicas=4, max_step=1, window=30, lead_seconds=20,
                     up_cooldown=10, down_cooldown=30, down_stable=20, down_margin=0.75)


def series(demands, replicas=1, start=0.0, step=1.0, waiting=0):
    return [Sample(start + i * step, replicas, d, waiting) for i, d in enumerate(demands)]


def test_a_rising_trend_scales_up_before_the_replica_is_full():
    scaler = Autoscaler(default=POLICY)
    rising = series([0, 0.5, 1, 1.5, 2, 2.5, 3])  # 0.5 requests/s more each second; 3 running fit one replica
    d = scaler.decide("m/decode", rising, now=6)
    assert d.desired == 2 and "projected" in d.reasons[0]
    flat = series([3] * 7)
    assert Autoscaler(default=POLICY).decide("m/decode", flat, now=6).desired == 1


def test_a_queue_or_full_kv_adds_a_replica_and_steps_are_bounded():
    scaler = Autoscaler(default=POLICY)
    queued = series([2] * 7, waiting=1)  # 3 requests fit one replica by count, but one has waited for 6 s
    d = scaler.decide("p", queued, now=6)
    assert d.desired == 2 and any("queued" in r for r in d.reasons)
    blip = series([2] * 7) + [Sample(7, 1, 1, 1)]  # one request waiting for a step (same demand): no queue
    assert Autoscaler(default=POLICY).decide("p", blip, now=7).desired == 1
    full = [Sample(0, 2, 3, 0, kv_usage=0.95)]
    assert Autoscaler(default=POLICY).decide("p", full, now=0).desired == 3
    huge = series([40] * 3)  # needs 10, capped at 4, one step at a time
    d = Autoscaler(default=POLICY).decide("p", huge, now=2)
    assert d.desired == 2 and any("per step" in r for r in d.reasons)


def test_a_ttft_objective_adds_a_replica_on_predicted_or_measured_lateness():
    policy = ScalePolicy(target_concurrency=8, ttft_objective=0.5)
    # 3 requests fit one replica by count, but the prompt tokens queued on it take 1.2 s to start: late already
    predicted = [Sample(0, 1, 2, 1, prefill_wait=1.2)]
    d = Autoscaler(default=policy).decide("p", predicted, now=0)
    assert d.desired == 2 and any("TTFT 1.20 s" in r for r in d.reasons)
    # a recent TTFT over the objective counts only while requests wait (it is stale once the replica idles)
    assert Autoscaler(default=policy).decide("p", [Sample(0, 1, 2, 1, ttft_recent=0.9)], now=0).desired == 2
    assert Autoscaler(default=policy).decide("p", [Sample(0, 1, 2, 0, ttft_recent=0.9)], now=0).desired == 1
    assert Autoscaler(default=policy).decide("p", [Sample(0, 1, 2, 1, prefill_wait=0.4)], now=0).desired == 1
    off = ScalePolicy(target_concurrency=8)  # no objective: no TTFT trigger
    assert Autoscaler(default=off).decide("p", predicted, now=0).desired == 1
    # a replica still starting counts: no second one for the same lateness
    assert Autoscaler(default=policy).decide("p", [Sample(0, 1, 2, 1, starting=1, prefill_wait=1.2)], now=0).desired == 2


def test_without_the_queue_trigger_only_the_ttft_objective_judges_a_queue():
    policy = ScalePolicy(target_concurrency=4, ttft_objective=0.5, scale_on_queue=False)
    short = [Sample(t, 1, 2, 1, prefill_wait=0.2) for t in range(7)]  # always one waiting, each briefly
    assert Autoscaler(default=policy).decide("p", short, now=6).desired == 1
    assert Autoscaler(default=POLICY).decide("p", short, now=6).desired == 2  # the queue trigger would add one
    late = short[:-1] + [Sample(6, 1, 2, 1, prefill_wait=0.7)]
    assert Autoscaler(default=policy).decide("p", late, now=6).desired == 2


def test_cooldown_after_a_scale_up():
    scaler = Autoscaler(default=POLICY)
    assert scaler.decide("p", series([12] * 3), now=2).desired == 2
    assert scaler.decide("p", series([12] * 3, replicas=2, start=3), now=5).desired == 2  # within 10 s
    assert scaler.decide("p", series([12] * 3, replicas=2, start=10), now=12).desired == 3


def test_scale_down_waits_for_stable_low_demand_and_its_cooldown():
    scaler = Autoscaler(default=POLICY)
    low = lambda t: [Sample(t, 3, 1, 0)]  # noqa: E731 - 1 request on 3 replicas
    assert scaler.decide("p", low(100), now=100).desired == 3  # low since 100
    assert scaler.decide("p", low(110), now=110).desired == 3  # 10 s of 20
    assert scaler.decide("p", low(121), now=121).desired == 2
    assert scaler.decide("p", [Sample(125, 2, 1, 0)], now=125).desired == 2  # cooldown, and stable again first
    assert scaler.decide("p", [Sample(146, 2, 1, 0)], now=146).desired == 2
    assert scaler.decide("p", [Sample(152, 2, 1, 0)], now=152).desired == 1
    # demand that would not fit one replica fewer with room to spare keeps the count (hysteresis)
    d = Autoscaler(default=POLICY).decide("p", [Sample(0, 2, 4, 0)], now=0)
    assert d.desired == 2 and any("would not fit" in r for r in d.reasons)


def test_bounds_pause_and_override():
    scaler = Autoscaler(default=ScalePolicy(min_replicas=2, max_replicas=3))
    assert scaler.decide("p", [Sample(0, 1, 0, 0)], now=0).desired == 2  # below the minimum
    scaler.pause("p")
    assert scaler.decide("p", [Sample(1, 2, 50, 9)], now=1).desired == 2
    scaler.pause("p", False)
    scaler.override("p", 9)  # clipped to the bounds, no cooldown
    assert scaler.decide("p", [Sample(2, 2, 0, 0)], now=2).desired == 3
    scaler.override("p", None)


def test_helpers():
    assert _slope([(0, 1), (1, 3), (2, 5)]) == pytest.approx(2.0)
    assert _slope([(0, 1)]) == 0.0
    assert capacity_from_plan(0.7, 0.1, 32) == pytest.approx(7.0)
    assert capacity_from_plan(10, 0.01, 8) == 8
    with pytest.raises(ValueError):
        ScalePolicy(min_replicas=3, max_replicas=2)
    with pytest.raises(ValueError, match="cooldowns"):
        ScalePolicy(down_stable=-1.0)


def test_prefill_and_decode_pools_get_their_own_policies():
    from tokenfleet.cli.autoscale import pool_policies

    default = ScalePolicy(target_concurrency=16, max_replicas=4)
    policies = pool_policies(["m/prefill:ttft_objective=0.5,target_concurrency=8", "m/decode:max_replicas=16",
                              "m/decode:target_concurrency=64"], default)
    assert policies["m/prefill"] == ScalePolicy(target_concurrency=8, max_replicas=4, ttft_objective=0.5)
    assert policies["m/decode"] == ScalePolicy(target_concurrency=64, max_replicas=16)
    scaler = Autoscaler(policies, default=default)
    late = [Sample(0, 1, 2, 1, prefill_wait=0.8)]  # 3 requests: few by count, but newcomers wait 0.8 s
    assert scaler.decide("m/prefill", late, now=0).desired == 2  # the prefill pool answers to its TTFT objective
    assert scaler.decide("m/decode", late, now=0).desired == 1  # the decode pool to its concurrency
    assert pool_policies(["m/p:scale_on_queue=false"], default)["m/p"].scale_on_queue is False
    for bad in ("m/prefill", "m/prefill:nope=1", "m/prefill:max_replicas=x", "prefill:max_replicas=2",
                "m/p:scale_on_queue=maybe"):
        with pytest.raises(ValueError):
            pool_policies([bad], default)
