"""The scheduler and block manager stay pure: importable without torch (the fleet simulator reuses them)."""

from __future__ import annotations

import subprocess
import sys


def test_scheduler_imports_no_torch():
    code = (
        "import sys; import tokenfleet.engine.scheduler, tokenfleet.engine.block_manager, tokenfleet.engine.output;"
        "bad = [m for m in ('torch', 'grpc', 'etcd3') if m in sys.modules]; print(bad); sys.exit(1 if bad else 0)"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
