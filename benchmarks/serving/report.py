"""Writing a benchmark's result: the JSON, a markdown report beside it, and the report on stdout."""

from __future__ import annotations

import json
from pathlib import Path


def write_report(out: str | Path, result: dict, markdown: str) -> None:
    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2))
    path.with_suffix(".md").write_text(markdown)
    print(markdown)
    print(f"wrote {path} and {path.with_suffix('.md')}")


def git_head() -> str:
    """The checkout's short commit, for a report's header."""
    import subprocess

    return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                          cwd=Path(__file__).resolve().parents[2]).stdout.strip()
