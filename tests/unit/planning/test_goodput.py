"""The goodput definition (shared by the simulator and benchmarks/goodput.py) and the benchmark's fixed workload."""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

import pytest

from tokenfleet.planning.metrics import Objectives, goodput_rate

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "benchmarks"))
from serving import mixed_workload as workload  # noqa: E402


def test_goodput_is_the_highest_rate_before_the_first_miss():
    curve = [(0.3, 1.0), (0.375, 0.93), (0.469, 0.8), (0.586, 0.95)]
    assert goodput_rate(curve) == 0.375  # the lucky 0.586 above a miss does not count
    assert goodput_rate(list(reversed(curve))) == 0.375  # order of listing does not matter
    assert goodput_rate([(0.3, 0.89)]) is None
    assert goodput_rate([(0.3, 0.9), (0.4, 0.9)]) == 0.4  # exactly 90 % meets


def test_ttft_objective_grows_with_the_prompt():
    o = workload.OBJECTIVES
    assert o.ttft_limit(0) == pytest.approx(0.5)
    assert o.ttft_limit(3000) == pytest.approx(3.5)
    assert o.met(3.4, 0.09, 3000) and not o.met(3.4, 0.09, 2000)
    assert not o.met(0.1, 0.11, 10)  # TPOT misses
    assert not o.met(None, None, 10)  # never got a token
    assert Objectives(ttft_s=0.7, tpot_s=0.04).met(0.7, 0.04, 100_000)  # flat by default (the simulator's)


def test_workload_is_fixed_by_its_seed_and_shaped_as_specified():
    vocab = 49152
    a = workload.requests(0.5, 2000, vocab, round_index=1, step=2)
    assert a == workload.requests(0.5, 2000, vocab, round_index=1, step=2)  # same requests for every server
    assert a[0].prompt != workload.requests(0.5, 1, vocab, round_index=1, step=3)[0].prompt  # fresh per step
    share = {k: sum(r.kind == k for r in a) / len(a) for k, _ in workload.CLASSES}
    assert share["chat"] == pytest.approx(0.7, abs=0.04)
    assert share["shared_prefix"] == pytest.approx(0.2, abs=0.03)
    assert share["long"] == pytest.approx(0.1, abs=0.03)
    prefixes = workload.prefixes(vocab)
    assert len({tuple(p) for p in prefixes}) == 8 and all(len(p) == 1500 for p in prefixes)
    for r in a:
        assert 32 <= r.max_tokens <= 256
        assert all(200 <= t < vocab for t in r.prompt[:50])
        if r.kind == "chat":
            assert 64 <= len(r.prompt) <= 512
        elif r.kind == "long":
            assert 2000 <= len(r.prompt) <= 3000
        else:
            assert r.prompt[:1500] == prefixes[r.prefix] and 64 <= len(r.prompt) - 1500 <= 256
    gaps = [b.offset_s - a_.offset_s for a_, b in zip(a, a[1:])]
    assert statistics.mean(gaps) == pytest.approx(2.0, rel=0.1)  # Poisson at 0.5/s
    assert statistics.stdev(gaps) == pytest.approx(2.0, rel=0.15)  # exponential gaps: sd = mean
    assert {len(r.prompt) for r in workload.warmup(vocab)}.isdisjoint({0})
    assert not any(r.prompt[:1500] in prefixes for r in workload.warmup(vocab))  # warm-up caches none of the 8


def test_ladder_steps_geometrically():
    assert workload.ladder(0.3, 1.25, 4) == [0.3, 0.375, 0.469, 0.586]


def test_vllm_configuration_specs_name_their_settings():
    from serving.vllm_configs import parse

    c = parse("bind=0-1,mnbt=1024,seqs=64")
    assert c.env["VLLM_CPU_OMP_THREADS_BIND"] == "0-1" and "LD_PRELOAD" not in c.env
    assert c.args[-4:] == ("--max-num-batched-tokens", "1024", "--max-num-seqs", "64")
    assert c.args[:2] == ("--dtype", "bfloat16") and parse("dtype=float32").args[:2] == ("--dtype", "float32")
    assert "VLLM_CPU_OMP_THREADS_BIND" not in parse("bind=default").env
    assert parse("bind=reserved0").env["VLLM_CPU_NUM_OF_RESERVED_CPU"] == "0"
    for bad in ("bind=0-3", "mnbt=0", "seqs=x", "bind=0-1,bind=default", "turbo", "dtype=fp8"):
        with pytest.raises(ValueError):
            parse(bad)


def test_a_flight_meets_only_when_it_finished_cleanly_within_both_objectives():
    from goodput import Flight

    req = workload.Request(0.0, "chat", [300] * 100, 11)  # TTFT limit 0.6 s
    ok = Flight(req, scheduled=0.0, sent=0.01, first=0.5, last=1.5, tokens=11, done=True, complete=True)
    assert ok.met() and ok.tpot == pytest.approx(0.1)
    assert not Flight(req, scheduled=0.0, sent=0.3, first=0.7, last=1.7, tokens=11, done=True, complete=True).met()
    cut = Flight(req, scheduled=0.0, sent=0.0, first=0.2, last=0.3, tokens=0, done=True, cancelled=True)
    assert not cut.met() and cut.certain_miss(0.4)  # a cancelled stream never counts as met
    assert not Flight(req, scheduled=0.0, first=0.2, last=1.0, tokens=11, done=True, error="HTTP 500").met()
    waiting = Flight(req, scheduled=0.0, sent=0.0)
    assert not waiting.certain_miss(0.59) and waiting.certain_miss(0.61)  # no first token past the TTFT limit
    streaming = Flight(req, scheduled=0.0, sent=0.0, first=0.2, last=0.9)
    assert not streaming.certain_miss(5.0)  # all 11 tokens may yet come at once: TPOT >= 0.07 only
    assert Flight(req, scheduled=0.0, sent=0.0, first=0.2, last=1.3).certain_miss(1.3)  # >= 0.11 s per token


def _entry(system, r, goodput, censored=False, lowest=0.05):
    return {"system": system, "round": r, "runs": [{"rate": lowest}], "goodput": {"machine": goodput},
            "censored_by": {"machine": censored}}


def test_a_peer_below_the_lowest_rate_gives_a_bound_not_an_infinite_ratio():
    from serving.goodput_report import ratios

    systems = ["tokenfleet", "vllm:x"]
    entries = [_entry("tokenfleet", 0, 0.075), _entry("vllm:x", 0, None),  # > 0.075 / 0.05
               _entry("tokenfleet", 1, None), _entry("vllm:x", 1, None),  # neither: no ratio
               _entry("tokenfleet", 2, 0.075), _entry("vllm:x", 2, 0.075)]
    got = ratios(entries, systems, 3, "machine")["vllm:x"]
    assert got["cells"] == ["> 1.50", "1.00"] and got["skipped_rounds"] == [1]
    assert got["median"] == 1.0 and got["median_text"] == ">= 1.00"  # the lower median: a bound proves no more
    entries[1] = _entry("vllm:x", 0, 0.1)
    entries[0] = _entry("tokenfleet", 0, None)  # tokenfleet under the lowest rate: at most 0.05 / 0.1, counted as 0
    got = ratios(entries, systems, 3, "machine")["vllm:x"]
    assert got["cells"] == ["< 0.50", "1.00"] and got["median"] == 0.0 and got["median_text"] == ">= 0.00"
    exact = ratios([_entry("tokenfleet", 0, 0.1), _entry("vllm:x", 0, 0.05)], systems, 1, "machine")["vllm:x"]
    assert exact["cells"] == ["2.00"] and exact["median_text"] == "2.00"
