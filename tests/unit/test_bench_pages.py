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

    comparison = {"started": "2026-11-28 10:00:00", "entries": []}
    profile = {"started": "2026-11-28 12:00:00", "limits": {}}
    (tmp_path / "2026-11-28-cpu-goodput.json").write_text(json.dumps(comparison))
    (tmp_path / "2026-11-28-cpu-profile-goodput.json").write_text(json.dumps(profile))
    monkeypatch.setattr(publish, "REPORTS", tmp_path)
    assert publish.latest("goodput").name == "2026-11-28-cpu-profile-goodput.json"  # the newest by name pattern alone
    assert publish.latest("goodput", publish.goodput_comparison).name == "2026-11-28-cpu-goodput.json"
