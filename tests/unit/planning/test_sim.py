"""The fleet simulator: cost shapes and models, traffic, the event loop with the real scheduler and
placement (exact timings with a constant cost), disaggregation, policies, overload and metrics."""

from __future__ import annotations

import heapq
import itertools
import json
import math
import subprocess
import sys
from collections import Counter
from dataclasses import replace

import pytest

from tokenfleet.engine.block_manager import BlockManager
from tokenfleet.engine.request import Request
from tokenfleet.engine.sampling_params import SamplingParams
from tokenfleet.engine.scheduler import Scheduler, SchedulerConfig
from tokenfleet.planning.calc import GPUS, MODELS, Layout, prefill_seconds
from tokenfleet.planning.costs import Profile, Roofline, StepShape, fit_profile
from tokenfleet.planning.metrics import summarize
from tokenfleet.planning.predict import predict_serve
from tokenfleet.planning.sim import LEAST_LOADED, PREFIX_AWARE, ROUND_ROBIN, FleetConfig, Simulator
from tokenfleet.planning.workload import Arrivals, ChatTraffic, ClosedLoop, Conversations, peak_rate


class Flat:
    """Every step costs the same: timings become exact arithmetic."""

    def __init__(self, seconds: float):
        self.seconds = seconds

    def step_seconds(self, shape: StepShape) -> float:
        return self.seconds


def small_fleet(**changes) -> FleetConfig:
    options = dict(replicas=1, gpus_per_replica=1, num_blocks=4096, block_size=16, hop_seconds=0.0,
                   scheduler=SchedulerConfig(max_num_batched_tokens=512, max_num_running=64, max_num_waiting=10_000,
                                             max_model_len=1 << 20))
    return FleetConfig(**{**options, **changes})


def chat(rate: float, seed: int = 1, **conv) -> ChatTraffic:
    options = dict(tenants=4, system_tokens=64, user_tokens=24, output_tokens=16, turns=4.0, think_seconds=2.0)
    return ChatTraffic(Arrivals(rate=rate), Conversations(**{**options, **conv}), seed=seed)


# ---- costs --------------------------------------------------------------------------------------------------
def test_step_shape_is_read_from_the_real_schedulers_output():
    scheduler = Scheduler(SchedulerConfig(max_num_batched_tokens=64), BlockManager(64, 16), "salt")
    params = SamplingParams(max_tokens=4)
    scheduler.add_request(Request("a", list(range(10)), params, max_tokens=4))
    scheduler.add_request(Request("b", list(range(100, 170)), params, max_tokens=4))  # 70 tokens: chunked to 54
    shape = StepShape.of(scheduler.schedule(0.0))
    assert (shape.tokens, shape.rows, shape.samples) == (64, 2, 1)  # only "a" reaches its end and samples
    assert shape.pairs == 10 * 11 // 2 + 54 * 55 // 2 and shape.kv == 64


def test_the_roofline_of_one_prompt_matches_plans_prefill_time():
    model, layout = MODELS["llama3-70b"], Layout(GPUS["h100"], tp=1, weight_dtype="fp8", kv_dtype="fp8")
    roofline = Roofline(model, layout, step_overhead_s=0.0)
    n = 3000
    assert roofline.step_seconds(StepShape(n, 1, 1, n * (n + 1) // 2, n)) == pytest.approx(
        prefill_seconds(model, layout, n), rel=1e-3)
    decode = roofline.step_seconds(StepShape(64, 64, 64, 64 * 4096, 64 * 4096))
    assert decode == pytest.approx((70.55e9 + 64 * 4096 * 163_840) / (3.35e12 * 0.7), rel=0.01)  # memory-bound


def test_a_profile_is_fitted_saved_and_loaded(tmp_path):
    truth = Profile(0.02, 0.001, 0.0005, 1e-7, 2e-6)
    shapes = [StepShape(t, r, r, p, k) for t, r, p, k in
              [(1, 1, 100, 100), (32, 1, 528, 32), (512, 1, 131_328, 512), (8, 8, 8000, 8000), (64, 64, 9000, 70_000),
               (256, 3, 40_000, 900), (16, 16, 4000, 4000), (2000, 1, 2_001_000, 2000)]]
    fitted = fit_profile(shapes, [truth.step_seconds(s) for s in shapes], {"block_size": 16},
                         extra=[0.0] * len(shapes))
    for key in ("base", "per_token", "per_sample", "per_pair", "per_kv"):
        assert getattr(fitted, key) == pytest.approx(getattr(truth, key), rel=1e-4, abs=1e-12)
    assert fitted.rpc_seconds == pytest.approx(0.0, abs=1e-9) and fitted.fit["median_rel_error"] < 1e-6
    fitted.save(tmp_path / "p.json")
    assert Profile.load(tmp_path / "p.json").step_seconds(shapes[3]) == pytest.approx(truth.step_seconds(shapes[3]))
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(ValueError, match="not a cost profile"):
        Profile.load(tmp_path / "bad.json")


def test_a_negative_coefficient_is_dropped_not_kept():
    shapes = [StepShape(t, 1, 0, 0, 0) for t in (1, 2, 3, 4)]
    fitted = fit_profile(shapes, [0.010, 0.009, 0.008, 0.007], {})  # cheaper with more tokens: noise
    assert fitted.per_token == 0.0 and fitted.base == pytest.approx(0.0085)


# ---- traffic ------------------------------------------------------------------------------------------------
def test_the_headline_peak_and_mean_prompt():
    assert peak_rate(10e6, 15, 2.88) == pytest.approx(5000)
    assert Conversations().mean_prompt_tokens() == pytest.approx(3000, rel=0.01)  # the 3k-token turns


@pytest.mark.parametrize("pattern,cv", [("poisson", 1.0), ("bursty", 3.0)])
def test_arrival_processes_have_their_rate_and_burstiness(pattern, cv):
    import random

    arrivals, rng, t, gaps = Arrivals(pattern, rate=50.0, burst_cv=3.0), random.Random(3), 0.0, []
    for _ in range(20_000):
        nxt = arrivals.next_after(t, rng)
        gaps.append(nxt - t)
        t = nxt
    mean = sum(gaps) / len(gaps)
    std = (sum((g - mean) ** 2 for g in gaps) / len(gaps)) ** 0.5
    assert mean == pytest.approx(1 / 50, rel=0.05) and std / mean == pytest.approx(cv, rel=0.1)


def test_diurnal_arrivals_follow_the_day():
    d = Arrivals("diurnal", rate=100.0, day_seconds=100.0, trough_ratio=0.3)
    assert d.rate_at(0.0) == pytest.approx(30.0) and d.rate_at(50.0) == pytest.approx(100.0)


class Recorder:
    """A stand-in simulation for traffic alone: requests take 1 s, arrivals are counted."""

    def __init__(self, source):
        self.now, self.source, self.sent, self.preloaded = 0.0, source, [], []
        self._events, self._seq = [], itertools.count()

    def at(self, time, action, arg=None):
        heapq.heappush(self._events, (time, next(self._seq), action, arg))

    def submit(self, arrival):
        self.sent.append((self.now, arrival))
        self.at(self.now + 1.0, lambda a: self.source.finished(self, a, a.max_tokens), arrival)

    def preload(self, tokens, tenant=""):
        self.preloaded.append(tokens)

    def run(self, end):
        self.source.start(self)
        while self._events and self._events[0][0] <= end:
            self.now, _, action, arg = heapq.heappop(self._events)
            action(arg)
        return self


def test_conversations_resend_their_transcript_and_the_rate_is_steady_from_the_start():
    traffic = ChatTraffic(Arrivals(rate=40.0), Conversations(turns=4.0, think_seconds=5.0, output_tokens=50),
                          seed=2, expected_turn_seconds=1.0)
    rec = Recorder(traffic).run(60.0)
    per_bin = Counter(int(t // 10) for t, _ in rec.sent)
    assert all(per_bin[b] == pytest.approx(400, rel=0.15) for b in range(6))  # seeded: no ramp-up
    assert rec.preloaded and all(len(p) >= 1000 for p in rec.preloaded)  # seeded transcripts are cached
    by_conv: dict[int, list] = {}
    for _, a in rec.sent:
        by_conv.setdefault(id(a.conversation), []).append(a)
    follow = [turns for turns in by_conv.values() if len(turns) >= 2]
    assert follow
    for turns in follow:
        for prev, nxt in zip(turns, turns[1:], strict=False):
            reply = [prev.token(i) for i in range(prev.max_tokens)]
            assert nxt.prompt[: len(prev.prompt) + len(reply)] == prev.prompt + reply  # a shared, growing prefix
            assert len(nxt.prompt) > len(prev.prompt) + len(reply)


# ---- the event loop -----------------------------------------------------------------------------------------
def test_a_closed_loop_on_one_replica_has_exact_timings():
    sim = Simulator(small_fleet(hop_seconds=0.001), Flat(0.010), ClosedLoop(1, 3, 100, 5), warmup_seconds=0.0,
                    duration_seconds=1e9, drain_seconds=0.0).run()
    tracks = sorted(sim.tracks.values(), key=lambda t: t.sent)
    assert [t.done for t in tracks] == [True] * 3 and [t.num_output for t in tracks] == [5] * 3
    for t in tracks:
        assert t.first - t.sent == pytest.approx(0.001 + 0.010 + 0.001)  # hop in, one prefill step, hop out
        assert (t.last - t.first) / 4 == pytest.approx(0.010)  # one decode step per token
    assert tracks[1].sent == pytest.approx(tracks[0].last)  # the client sends again when its reply ends


def test_prediction_of_serve_uses_the_profiles_engine_settings():
    profile = Profile(0.02, 0.001, 0.0, 0.0, 0.0, rpc_seconds=0.004,
                      engine={"block_size": 16, "num_blocks": 1000, "max_num_batched_tokens": 2048,
                              "max_num_running": 128})
    one = predict_serve(profile, 1, 4, 256, 8)
    assert one["ttft_p50_ms"] == pytest.approx(4 + 20 + 256)  # round trip + base + 256 tokens
    assert one["tpot_p50_ms"] == pytest.approx(21)  # base + one token
    eight = predict_serve(profile, 8, 16, 256, 8)  # waves of 8: one step prefills all (the 2048-token budget)
    assert eight["ttft_p50_ms"] == pytest.approx(4 + 20 + 8 * 256) and eight["tpot_p50_ms"] == pytest.approx(28)


def test_prefix_aware_placement_reuses_more_than_round_robin():
    results = {}
    for policy in (PREFIX_AWARE, ROUND_ROBIN):
        fleet = small_fleet(replicas=4, policy=policy)
        sim = Simulator(fleet, Flat(0.005), chat(40.0), warmup_seconds=3.0, duration_seconds=6.0,
                        drain_seconds=5.0).run()
        results[policy] = summarize(sim)
        for replica in sim.replicas.values():
            replica.scheduler.block_manager.check_invariants()
    assert results[PREFIX_AWARE]["prefix_hit_rate"] > results[ROUND_ROBIN]["prefix_hit_rate"] + 0.15
    assert all(r["finished"] == r["requests"] > 100 for r in results.values())


def test_disaggregated_cells_prefill_remotely_and_ship_only_what_decode_lacks():
    fleet = small_fleet(replicas=2, prefill_replicas=1, kv_bytes_per_token=100.0, link_bytes_per_s=1e6,
                        disagg=replace(small_fleet().disagg, min_uncached_tokens=32))
    sim = Simulator(fleet, Flat(0.005), chat(20.0, user_tokens=64), warmup_seconds=2.0, duration_seconds=5.0,
                    drain_seconds=5.0).run()
    result = summarize(sim)
    assert sim.num_remote > 20 and result["finished"] == result["requests"]
    prompt_tokens = sum(len(t.arrival.prompt) for t in sim.tracks.values() if t.prefill_replica)
    assert 0 < sim.transfer_bytes < prompt_tokens * 100.0  # decode replicas held part of the prompts already
    prefill = sim.replicas["p000"].scheduler
    assert not prefill.held and not prefill.requests  # every held block was released after its transfer
    for replica in sim.replicas.values():
        replica.scheduler.block_manager.check_invariants()
    remote = [t for t in sim.tracks.values() if t.prefill_replica and t.num_output > 1]
    assert remote and all(t.first is not None and t.last > t.first for t in remote)


def test_a_second_tier_restores_what_a_small_pool_evicted():
    """Pools far smaller than the conversations' working set: with a tier the next turn's transcript is
    restored instead of recomputed (the scheduler's own restore path), so the hit rate rises."""
    results, sims = {}, {}
    for tier in (0, 4096):
        fleet = small_fleet(replicas=2, num_blocks=160, tier_blocks=tier)
        sims[tier] = Simulator(fleet, Flat(0.005), chat(30.0, think_seconds=3.0), warmup_seconds=3.0,
                               duration_seconds=8.0, drain_seconds=5.0).run()
        results[tier] = summarize(sims[tier])
        for replica in sims[tier].replicas.values():
            replica.scheduler.block_manager.check_invariants()
    assert results[0]["tier_restored_blocks"] == 0 < results[4096]["tier_restored_blocks"]
    assert results[4096]["prefix_hit_rate"] > results[0]["prefix_hit_rate"] + 0.1
    assert all(len(r.tier.blocks) <= 4096 for r in sims[4096].replicas.values() if r.tier is not None)


def test_peer_fetch_lets_a_prefill_pool_pull_the_transcript_from_the_decode_replica():
    """P/D: the prefill replica lacks the replies the decode replica generated; with peer fetch it pulls
    them (and earlier turns) over the link instead of recomputing them."""
    results = {}
    for peer in (False, True):
        fleet = small_fleet(replicas=2, prefill_replicas=1, kv_bytes_per_token=100.0, link_bytes_per_s=1e8,
                            disagg=replace(small_fleet().disagg, min_uncached_tokens=32), peer_fetch=peer)
        sim = Simulator(fleet, Flat(0.005), chat(20.0, user_tokens=64), warmup_seconds=2.0, duration_seconds=5.0,
                        drain_seconds=5.0).run()
        results[peer] = summarize(sim)
        assert results[peer]["finished"] == results[peer]["requests"]
        for replica in sim.replicas.values():
            replica.scheduler.block_manager.check_invariants()
    assert results[False]["peer_blocks"] == 0 < results[True]["peer_blocks"]
    assert results[True]["prefix_hit_rate"] > results[False]["prefix_hit_rate"]


def test_an_overloaded_cell_stops_early_and_fails_its_objectives():
    sim = Simulator(small_fleet(), Flat(0.05), chat(400.0), warmup_seconds=1.0, duration_seconds=30.0,
                    drain_seconds=30.0).run()
    result = summarize(sim)
    assert sim.overloaded and sim.now < 31.0 and not result["meets_slo"] and result["slo_attainment"] < 0.5


def test_a_lightly_loaded_cell_meets_its_objectives():
    sim = Simulator(small_fleet(replicas=2, policy=LEAST_LOADED), Flat(0.01), chat(5.0), warmup_seconds=1.0,
                    duration_seconds=4.0, drain_seconds=5.0).run()
    result = summarize(sim)
    assert result["meets_slo"] and result["slo_attainment"] == 1.0 and result["ttft_p99_s"] <= 0.03
    assert result["itl_p50_s"] == pytest.approx(0.01) and result["usd_per_m_output_tokens"] > 0


# ---- the commands -------------------------------------------------------------------------------------------
def test_simulate_run_and_sweep_from_the_command_line(tmp_path):
    small = ["--rate", "20", "--replicas", "2", "--warmup", "1", "--duration", "2", "--drain", "2",
             "--system-tokens", "100", "--user-tokens", "20", "--output-tokens", "20"]
    done = subprocess.run([sys.executable, "-m", "tokenfleet.cli", "simulate", "run", "--json", *small],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert result["gpus"] == 16 and result["requests"] > 10 and result["meets_slo"] is True
    assert 0 < result["mfu"] < result["utilization"] <= 1.01  # busy stepping, far from peak FLOPs at this load
    done = subprocess.run([sys.executable, "-m", "tokenfleet.cli", "simulate", "sweep", *small,
                           "--rates-per-node", "5", "10", "--policies", "prefix-aware", "round-robin",
                           "--prefill-splits", "0", "1", "--cell-sizes", "2", "3", "--jobs", "1", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    import csv

    rows = list(csv.DictReader(open(tmp_path / "sweep.csv")))
    assert len(rows) == 2 * 2 * 2 * 2 and (tmp_path / "sweep.png").stat().st_size > 10_000
    assert {(r["nodes"], r["prefill_replicas"]) for r in rows} == {("2", "0"), ("2", "1"), ("3", "0"), ("3", "1")}
    assert {r["rate"] for r in rows if r["nodes"] == "3"} == {"15.0", "30.0"}  # per-node rate x cell size


def test_sizing_regenerates_its_report(tmp_path):
    from tokenfleet.planning.sizing import regenerate

    out = tmp_path / "sizing.md"
    result = regenerate(out, jobs=2, quick=True)
    text = out.read_text()
    assert "## Nodes needed at peak" in text and "## Sensitivity to the prefix hit rate" in text
    for s in result["summary"]:
        if s["nodes"]:
            assert s["nodes"] == math.ceil(peak_rate(10e6, 15, 2.88) / s["rate_per_node"]) and f"**{s['nodes']}**" in text
    for name in ("cells.png", "nodes.png", "prefix-sensitivity.png", "cells.csv"):
        assert (tmp_path / "sizing" / name).stat().st_size > 0


@pytest.mark.nightly  # test_sizing_regenerates_its_report keeps the report check in the suite
def test_sizing_tiers_regenerates_its_report(tmp_path):
    from tokenfleet.planning.sizing import regenerate_tiers

    out = tmp_path / "sizing-tiers.md"
    result = regenerate_tiers(out, jobs=2, quick=True)
    text = out.read_text()
    assert "+ tier" in text and "+ peer fetch" in text and (tmp_path / "sizing-tiers" / "cells.csv").stat().st_size > 0
    rows = {r["label"]: r for r in result["rows"]}
    assert rows["P/D 1:1"]["peer_blocks"] == 0 and rows["colocated, headline"]["tier_restored_blocks"] == 0
    assert all(s["nodes"] is None or f"**{s['nodes']}**" in text for s in result["summary"])
