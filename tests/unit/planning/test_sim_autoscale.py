"""The simulator with the autoscaler: a compressed day costs fewer GPU-hours than the fixed cell, the replica count
follows the traffic, and retired replicas drain (every measured request still gets its first token)."""

from __future__ import annotations

import pytest

from tokenfleet.cli import build_parser


@pytest.mark.nightly  # a simulated day (~12 s); the replica-level autoscale cases below stay in the suite
def test_autoscale_day_saves_gpu_hours_and_follows_the_traffic(tmp_path):
    from tokenfleet.cli.simulate import _cmd_autoscale_day

    out = tmp_path / "day.md"
    args = build_parser().parse_args(["simulate", "autoscale-day", "--replicas", "3", "--rate", "10", "--day-seconds", "60",
                                 "--min-replicas", "1", "--scale-start-seconds", "5", "--sensitivity", "0.8",
                                 "--out", str(out), "--jobs", "1"])
    assert _cmd_autoscale_day(args) == 0
    assert args.target_concurrency > 0  # measured: one replica under the peak's share of the load
    text = out.read_text()
    assert f"{args.target_concurrency:.0f} requests each (measured" in text
    days = [line.split("|") for line in text.splitlines() if line.startswith("| 0.")]
    assert [d[1].strip() for d in days] == ["0.35", "0.8"]  # the day itself, then the sensitivity trough
    ratios = [float(d[5].strip().rstrip("x")) for d in days]
    assert ratios[0] < 1 and ratios[0] < ratios[1]  # a deeper trough leaves more to save
    rows = {line.split("|")[1].strip(): line for line in text.splitlines() if line.startswith("| fixed")
            or line.startswith("| autoscaled")}
    fixed_hours = float(rows["fixed"].split("|")[2])
    scaled_hours = float(rows["autoscaled"].split("|")[2])
    assert scaled_hours < fixed_hours
    replicas = [int(line.split("|")[2]) for line in text.splitlines() if line.startswith("| ") and
                line.split("|")[1].strip().isdigit()]
    assert min(replicas) == 1 and max(replicas) >= 2  # it grew with the day's traffic


def test_a_drained_replica_leaves_and_its_work_still_counts():
    from tokenfleet.cluster.autoscale import ScalePolicy
    from tokenfleet.planning.scenario import scenario_from_args

    args = build_parser().parse_args(["simulate", "run", "--replicas", "3", "--rate", "2", "--duration", "30", "--warmup", "0"])
    scenario = scenario_from_args(args)
    from dataclasses import replace

    policy = ScalePolicy(target_concurrency=64, min_replicas=1, max_replicas=3, down_stable=5, down_cooldown=5)
    result = replace(scenario, autoscale=policy, scale_start_seconds=5).run()
    assert result["started"] == result["requests"] > 0  # nobody was lost to a retired replica
    assert result["mean_replicas"] < 3 and result["gpu_hours"] > 0


def test_a_replica_reports_the_wait_its_queued_prompts_predict():
    from tokenfleet.engine.request import Request
    from tokenfleet.engine.sampling_params import SamplingParams
    from tokenfleet.planning.fleet import FleetConfig, SimReplica

    replica = SimReplica("d000", ("decode", "prefill"), FleetConfig(), "sim")
    assert replica.load(1000.0).prefill_wait_s == 0.0
    for i in range(3):
        replica.scheduler.add_request(Request(f"r{i}", list(range(1, 1001)), SamplingParams(max_tokens=4)))
    # 3 prompts of 1,000 tokens, none computed (the last token of each is the first decode step's): 2,997 tokens
    assert replica.load(1000.0).prefill_wait_s == 2.997
    assert replica.load().prefill_wait_s == 0.0  # no rate given: no prediction
