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
