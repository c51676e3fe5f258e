"""Every Triton kernel variant the engine launches compiles for Hopper (sm_90a) without spilling registers.

CI has no GPU and the CPU tests run the kernels in Triton's interpreter, which compiles nothing; a kernel that
does not compile for the real target would cost a rare GPU session its minutes. Triton ships ptxas and cuobjdump,
so scripts/triton_sm90.py compiles each variant to a Hopper cubin here and reads its registers and local memory
(in a fresh process: the test session's kernels are defined for the interpreter)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

triton = pytest.importorskip("triton")
BIN = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
ROOT = Path(__file__).resolve().parents[3]


def _runs(tool: Path) -> bool:
    try:
        return subprocess.run([str(tool), "--version"], capture_output=True, timeout=30).returncode == 0
    except OSError:
        return False


@pytest.mark.skipif(not (_runs(BIN / "ptxas") and _runs(BIN / "cuobjdump")),
                    reason="Triton's bundled ptxas or cuobjdump does not run on this machine")
@pytest.mark.nightly  # a compile of every kernel variant for a GPU; the GPU tests and the interpreter tests run the kernels
def test_every_kernel_variant_compiles_for_sm90_without_spills(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = tmp_path / "sm90.json"
    run = subprocess.run([sys.executable, str(ROOT / "scripts" / "triton_sm90.py"), "--json", str(out)], env=env,
                         capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    table = json.loads(out.read_text())
    assert not table["failed"] and len(table["rows"]) >= 30
    spilled = [r["name"] for r in table["rows"] if r["local"] or r["stack"]]
    assert not spilled, spilled
    assert all(0 < r["registers"] <= 255 for r in table["rows"])
