"""Before/after: one benchmark script run alternately on an earlier revision and on the working tree.

The earlier revision is checked out into a temporary git worktree and imported in place of the
installed (editable) tokenfleet; both sides use this virtualenv. Processes the script starts (the
services of a serving benchmark) get the same tree: PYTHONPATH names it, and a link
``tokenfleet/services -> ../services`` in the worktree keeps the editable install's mapping of
``tokenfleet.services`` from reaching into the working tree. Runs alternate (old, new, old,
new, ...) --runs times each; every run's JSON (the script's --json output) is kept, and for each
numeric leaf the median of the per-round ratios new / old (round i: the i-th old run and the i-th new run, which
ran next to each other) is reported, with every run's value.

    .venv/bin/python benchmarks/compare_revisions.py --rev b5d9e93 --runs 3 \\
        -- benchmarks/engine_throughput.py --batches 1,8,32 --skip-hf
    .venv/bin/python benchmarks/compare_revisions.py --rev 45c2d83 --runs 3 --out-flag=--out \
        -- benchmarks/serve.py --skip-vllm --skip-direct --concurrency 32
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

# Runs a script with another checkout's tokenfleet: drop the editable install's finder, put the tree first.
SHIM = """
import runpy, sys
tree, script = sys.argv[1], sys.argv[2]
sys.meta_path[:] = [f for f in sys.meta_path if "editable" not in type(f).__module__.lower()]
for name in [m for m in sys.modules if m == "tokenfleet" or m.startswith("tokenfleet.")]:
    del sys.modules[name]
sys.path.insert(0, tree)
sys.path.insert(0, tree + "/benchmarks")
sys.argv = [script] + sys.argv[3:]
runpy.run_path(script, run_name="__main__")
"""


def leaves(d: object, prefix: str = "") -> dict[str, float]:
    out: dict[str, float] = {}
    if isinstance(d, dict):
        for k, v in d.items():
            out |= leaves(v, f"{prefix}.{k}" if prefix else str(k))
    elif isinstance(d, list):
        for i, v in enumerate(d):
            key = v.get("batch", i) if isinstance(v, dict) else i
            out |= leaves(v, f"{prefix}[{key}]")
    elif isinstance(d, (int, float)) and not isinstance(d, bool):
        out[prefix] = float(d)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rev", required=True, help="the earlier revision (commit, tag, branch)")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "reports" / "compare-revisions.json"))
    parser.add_argument("--out-flag", default="--json", help="the script's option naming its JSON result file")
    parser.add_argument("script", nargs=argparse.REMAINDER, help="-- SCRIPT [ARGS]: must accept --json FILE")
    args = parser.parse_args()
    script = [a for a in args.script if a != "--"]
    if not script:
        parser.error("name the benchmark script after --")
    old_tree = Path(tempfile.mkdtemp(prefix="tokenfleet-rev-")) / "tree"
    subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", str(old_tree), args.rev], check=True,
                   capture_output=True)
    (old_tree / "tokenfleet" / "services").symlink_to("../services")
    runs: dict[str, list[dict]] = {"old": [], "new": []}
    try:
        for i in range(args.runs):
            for side in ("old", "new"):
                out = Path(tempfile.mkdtemp()) / "result.json"
                tree = old_tree if side == "old" else REPO
                cmd = [sys.executable, "-c", SHIM, str(tree), str(tree / script[0]), *script[1:], args.out_flag,
                       str(out)]
                env = dict(os.environ)
                if side == "old":
                    env["PYTHONPATH"] = os.pathsep.join([str(tree), *filter(None, [env.get("PYTHONPATH")])])
                started = time.monotonic()
                subprocess.run(cmd, check=True, cwd=tree, env=env)
                runs[side].append(json.loads(out.read_text()))
                print(f"run {i} {side}: {time.monotonic() - started:.0f} s", flush=True)
    finally:
        subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(old_tree)], capture_output=True)
    old_leaves = [leaves(r) for r in runs["old"]]
    new_leaves = [leaves(r) for r in runs["new"]]
    summary = {}
    for key in sorted(set(old_leaves[0]) & set(new_leaves[0])):
        old = statistics.median(x[key] for x in old_leaves if key in x)
        new = statistics.median(x[key] for x in new_leaves if key in x)
        ratios = [n[key] / o[key] for o, n in zip(old_leaves, new_leaves) if o.get(key) and key in n]
        summary[key] = {"old_median": old, "new_median": new,
                        "new_over_old": statistics.median(ratios) if ratios else None, "round_ratios": ratios,
                        "old_runs": [x.get(key) for x in old_leaves], "new_runs": [x.get(key) for x in new_leaves]}
    result = {"rev": args.rev, "script": script, "runs": runs, "summary": summary,
              "started": time.strftime("%Y-%m-%d %H:%M:%S")}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    for key, s in summary.items():
        if s["new_over_old"] is not None:
            print(f"{key:50s} old {s['old_median']:10.2f}  new {s['new_median']:10.2f}  "
                  f"median of per-round new/old {s['new_over_old']:.2f}")


if __name__ == "__main__":
    main()
