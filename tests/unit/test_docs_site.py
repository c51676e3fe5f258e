"""The documentation site (mkdocs.yml): it builds with --strict and no warning, a broken link fails the build, the
generated CLI reference lists every command with the services' real flags, and the README and the guide's pages
stay short and free of work history."""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tokenfleet.cli import build_parser

REPO = Path(__file__).resolve().parents[2]
ISSUE_REFERENCE = re.compile(r"\bissues?\s*#?\d+|\(#\d+\)", re.IGNORECASE)
# one flag that only each service's own parser has (the CLI's placeholder for it has none)
SERVICE_FLAGS = {"gateway": "--stall-timeout", "router": "--min-match-blocks", "registry": "--etcd-root",
                 "decode": "--itl-guard", "prefill": "--itl-guard"}


def build_site(config_dir: Path, out: Path) -> tuple[int, list[str]]:
    """mkdocs build --strict of config_dir/mkdocs.yml into out: its exit status and its WARNING lines."""
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}  # Material's end-of-life banner, not a build warning
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file",
                           str(config_dir / "mkdocs.yml"), "--site-dir", str(out)],
                          capture_output=True, text=True, env=env, cwd=config_dir, timeout=120)
    return done.returncode, [line for line in (done.stdout + done.stderr).splitlines() if line.startswith("WARNING")]


def command_paths(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()) -> Iterator[tuple[str, ...]]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield (*path, name)
                yield from command_paths(sub, (*path, name))


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("site")
    status, warnings = build_site(REPO, out)
    assert (status, warnings) == (0, [])
    return out


def test_the_site_builds_strict_without_a_warning(site: Path):
    assert (site / "index.html").is_file() and (site / "cli" / "index.html").is_file()


def test_a_broken_page_or_anchor_link_fails_the_build(tmp_path: Path):
    shutil.copytree(REPO / "docs", tmp_path / "docs")
    shutil.copy(REPO / "mkdocs.yml", tmp_path / "mkdocs.yml")
    with (tmp_path / "docs" / "concepts.md").open("a") as page:
        page.write("\n[gone](no-such-page.md) and [moved](routing.md#no-such-section)\n")
    status, warnings = build_site(tmp_path, tmp_path / "site")
    assert status != 0
    assert any("no-such-page.md" in w for w in warnings) and any("#no-such-section" in w for w in warnings)


def test_the_cli_reference_lists_every_command_and_the_services_own_flags(site: Path):
    page = (site / "cli" / "index.html").read_text()
    paths = list(command_paths(build_parser()))
    assert ("models", "import") in paths  # the walk reaches nested commands
    missing = [" ".join(path) for path in paths if f">tokenfleet {' '.join(path)}<" not in page]
    assert missing == []
    for service, flag in SERVICE_FLAGS.items():
        section = page.split(f'id="tokenfleet-{service}"')[1].split("<h2")[0]
        assert flag in section, service


def test_the_readme_stays_short():
    assert len((REPO / "README.md").read_text().splitlines()) <= 250


@pytest.mark.parametrize("page", [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))], ids=lambda p: p.name)
def test_user_facing_pages_name_features_not_issue_numbers(page: Path):
    assert ISSUE_REFERENCE.findall(page.read_text()) == []
