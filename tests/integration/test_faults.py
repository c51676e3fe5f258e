"""The fault benchmark's short version (one scenario per kind: a worker killed under load, the router killed, etcd
down for 10 s, beside a fault-free baseline), asserting only correctness: nothing acknowledged lost, nobody charged
twice, no batch line lost or doubled, completed greedy streams token-identical to the fault-free run, constrained
output valid, and every failure a clear status (never a cut stream, never a hang past the client's timeout)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import faults  # noqa: E402

CLEAR = {"503", "429", "connection"} | {f"stream-error:{code}" for code in ("replica_lost", "overloaded",
                                                                          "ledger_unavailable")}


def test_the_short_fault_run_loses_nothing_and_fails_only_with_clear_statuses(default_model_dir, tmp_path):
    assert faults.main(["--short", "--out", str(tmp_path), "--model", str(default_model_dir)]) == 0
    report = json.loads(next(tmp_path.glob("*-faults-short.json")).read_text())
    scenarios = report["faults"]["scenarios"]
    assert set(scenarios) == set(faults.SHORT)
    ran = {name: s for name, s in scenarios.items() if "skipped" not in s}  # a disk needs mounting: root only
    assert set(faults.SHORT) - set(ran) <= {"ledger-disk-full"}, scenarios
    for name, s in ran.items():
        assert s["completed"] > 0, (name, s)
        assert s["acknowledged_lost"] == 0 and s["duplicated_charges"] == 0, (name, s["examples"])
        assert s["differ_from_fault_free"] == 0, (name, s["examples"]["differ"])
        assert s["invalid_json"] == 0 and s["constrained_completed"] > 0, name
        assert set(s["failed"]) <= CLEAR, (name, s["failed"], s["examples"]["errors"])  # no "cut", no "timeout"
        assert s["batch"]["missing"] == 0 and s["batch"]["duplicated"] == 0, (name, s["batch"])
    assert scenarios["worker-kill-1"]["resumed"] >= 1  # the kill hit open streams, which resumed
    assert report["faults"]["ledger_duplicates_overall"] == 0
    assert "| worker-kill-1 |" in next(tmp_path.glob("*-faults-short.md")).read_text()
