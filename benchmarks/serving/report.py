"""Writing a benchmark's result: the JSON, a markdown report beside it, and the report on stdout."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path


def report_path(out: str | Path) -> Path:
    """Where a report asked for at ``out`` goes: there, unless an earlier report has that dated name; then the time
    of day after the date (benchmarks/publish.py orders reports by when they started, not by name). A script that
    writes files beside its report (a plot) names them after this path before writing any."""
    path = Path(out)
    if path.exists() and re.match(r"\d{4}-\d{2}-\d{2}-", path.name):
        path = path.with_name(f"{path.name[:10]}-{time.strftime('%H%M%S')}{path.name[10:]}")
        print(f"{out} exists: writing {path} instead")
    return path


def write_report(out: str | Path, result: dict, markdown: str) -> Path:
    """Write ``result`` (JSON) and ``markdown`` beside it, never over an earlier report (``report_path``)."""
    path = report_path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2))
    path.with_suffix(".md").write_text(markdown)
    print(markdown)
    print(f"wrote {path} and {path.with_suffix('.md')}")
    return path


def machine_line() -> str:
    """The machine a figure was measured on: CPU model, usable cores, whether it has AVX-512 BF16 (which decides
    the native attention build and oneDNN's bf16 GEMMs), torch."""
    import os

    import torch

    try:
        from tokenfleet.cli.doctor import cpu_info
    except ImportError:  # a revision from before the CLI package (compare_revisions --same-harness runs this on it)
        from tokenfleet.cli_doctor import cpu_info  # type: ignore[no-redef]

    name, flags = cpu_info()
    bf16 = all(f in flags for f in ("avx512f", "avx512bw", "avx512_bf16"))
    amx = "amx_bf16" in flags
    return (f"{name}, {len(os.sched_getaffinity(0))} cores, AVX-512 BF16 {'yes' if bf16 else 'no'}, AMX "
            f"{'yes' if amx else 'no'} (native attention: {'AVX-512 BF16' if bf16 else 'portable C'} build), torch "
            f"{torch.__version__}")


def machine_kind(line: str) -> str:
    """The kind of machine a report's ``machine_line`` names, for keeping figures of different kinds apart: a CPU
    without AVX-512 BF16 (bf16 emulated: fp32 is the fast dtype), one with it, one with AMX too, or a GPU. Reports
    from before the AMX field count as without AMX; "" where the line does not say (older reports)."""
    cpu = line.split(",")[0].strip()
    if not cpu or cpu[0].isdigit() or "AVX-512 BF16" not in line:
        return ""  # an older report's line ("2 cpus, load ..."): the kind was not recorded
    vendor = "Intel Xeon" if "Xeon" in cpu else "AMD EPYC" if "EPYC" in cpu else cpu
    if "GPU" in line or "NVIDIA" in line:
        return f"GPU ({cpu})"
    if "AMX yes" in line:
        return f"{vendor} with AVX-512 BF16 and AMX"
    if "AVX-512 BF16 yes" in line:
        return f"{vendor} with AVX-512 BF16"
    return f"{vendor} without AVX-512 BF16"


def git_head() -> str:
    """The checkout's short commit, for a report's header."""
    import subprocess

    return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                          cwd=Path(__file__).resolve().parents[2]).stdout.strip()
