"""docs/benchmarks.md and the README's headline are what benchmarks/publish.py writes from the newest reports."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_benchmarks_page_and_headline_match_the_latest_reports():
    done = subprocess.run([sys.executable, str(REPO / "benchmarks" / "publish.py"), "--check"],
                          capture_output=True, text=True, cwd=REPO)
    assert done.returncode == 0, done.stderr
    page = (REPO / "docs" / "benchmarks.md").read_text()
    assert "benchmarks/reports/" in page and "Goodput" in page


def test_the_headline_comes_from_a_goodput_comparison_not_from_another_report_named_goodput(tmp_path, monkeypatch):
    # benchmarks/profile_goodput.py's reports end in "-goodput.json" too: the picker must not take one for the headline
    import json

    sys.path.insert(0, str(REPO / "benchmarks"))
    import publish

    machine = "AMD EPYC, 2 cores, AVX-512 BF16 no (native attention: portable C build), torch 2.13.0+cpu"
    comparison = {"started": "2026-11-28 10:00:00", "entries": [], "machine": machine}
    profile = {"started": "2026-11-28 12:00:00", "limits": {}, "machine": machine}
    (tmp_path / "2026-11-28-cpu-goodput.json").write_text(json.dumps(comparison))
    (tmp_path / "2026-11-28-cpu-profile-goodput.json").write_text(json.dumps(profile))
    monkeypatch.setattr(publish, "REPORTS", tmp_path)
    assert publish.latest("goodput").name == "2026-11-28-cpu-profile-goodput.json"  # the newest by name pattern alone
    assert publish.latest("goodput", publish.goodput_comparison).name == "2026-11-28-cpu-goodput.json"


def test_each_kind_of_machine_keeps_its_newest_report(tmp_path, monkeypatch):
    """A newer report from one kind of machine never replaces another kind's figure; a report that does not say
    which kind it ran on stands for none."""
    import json

    sys.path.insert(0, str(REPO / "benchmarks"))
    import publish

    zen3 = "AMD EPYC, 2 cores, AVX-512 BF16 no (native attention: portable C build), torch 2.13.0+cpu"
    zen4 = "AMD EPYC, 2 cores, AVX-512 BF16 yes (native attention: AVX-512 BF16 build), torch 2.13.0+cpu"
    amx = "Intel(R) Xeon(R) Processor, 2 cores, AVX-512 BF16 yes, AMX yes (native attention: AVX-512 BF16 build), torch"
    for day, machine in (("2026-11-28", zen3), ("2026-11-29", zen3), ("2026-11-30", zen4), ("2026-12-02", amx),
                         ("2026-12-03", None)):
        (tmp_path / f"{day}-cpu-serve-peer.json").write_text(json.dumps({"started": day, **(
            {"machine": machine} if machine else {})}))
    monkeypatch.setattr(publish, "REPORTS", tmp_path)
    assert [(kind, p.name[:10]) for kind, p in publish.latest_per_kind("cpu-serve-peer")] == [
        ("AMD EPYC with AVX-512 BF16", "2026-11-30"), ("AMD EPYC without AVX-512 BF16", "2026-11-29"),
        ("Intel Xeon with AVX-512 BF16 and AMX", "2026-12-02")]
    assert publish.latest("cpu-serve-peer").name == "2026-12-02-cpu-serve-peer.json"
    assert publish.on_kind(["## Closed loop", "x"], "Intel Xeon") == ["## Closed loop, on Intel Xeon", "x"]
