"""Before/after: one benchmark script run alternately on an earlier revision and on the working tree.

The earlier revision is checked out into a temporary git worktree and imported in place of the
installed (editable) tokenfleet; both sides use this virtualenv. Processes the script starts (the
services of a serving benchmark) get the same tree: PYTHONPATH names it, and a link
``tokenfleet/services -> ../services`` in the worktree keeps the editable install's mapping of
``tokenfleet.services`` from reaching into the working tree. Runs alternate (old, new, old,
new, ...) --runs times each; every run's JSON (the script's --json output) is kept, and for each
numeric leaf the median of the per-round ratios new / old (round i: the i-th old run and the i-th new run, which
ran next to each other) is reported, with every run's value. Every list of strings the script writes under a ``texts``
key (serve.py: each run's greedy completions) is compared across the revisions, round by round: ``outputs`` says how many are
identical. ``--same-harness`` runs this tree's script and benchmark helpers on both sides (the same load generator
and checks; only tokenfleet differs).

    .venv/bin/python benchmarks/compare_revisions.py --rev b5d9e93 --runs 3 \\
        -- benchmarks/engine_throughput.py --batches 1,8,32 --skip-hf
    .venv/bin/python benchmarks/compare_revisions.py --rev 0b8236e --runs 3 --out-flag=--out --same-harness \
        --out benchmarks/reports/compare-serve.json -- benchmarks/serve.py --skip-vllm --skip-direct --concurrency 1 32
"""

from __future__ import annotations

import argparse
import json
import os
import re
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
tree, harness, script = sys.argv[1], sys.argv[2], sys.argv[3]
sys.meta_path[:] = [f for f in sys.meta_path if "editable" not in type(f).__module__.lower()]
for name in [m for m in sys.modules if m == "tokenfleet" or m.startswith("tokenfleet.")]:
    del sys.modules[name]
sys.path.insert(0, tree)
sys.path.insert(0, harness + "/benchmarks")
sys.argv = [script] + sys.argv[4:]
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


def texts(d: object, prefix: str = "") -> dict[str, list[str]]:
    """Every list of strings a result keeps under a key named ``texts`` (serve.py's greedy completions), by path."""
    out: dict[str, list[str]] = {}
    if isinstance(d, dict):
        for k, v in d.items():
            out |= texts(v, f"{prefix}.{k}" if prefix else str(k))
    elif isinstance(d, list):
        if d and all(isinstance(v, str) for v in d):
            if prefix.rpartition(".")[2] == "texts":
                out[prefix] = list(d)
        else:
            for i, v in enumerate(d):
                out |= texts(v, f"{prefix}[{i}]")
    return out


def agreement(old_runs: list[dict], new_runs: list[dict]) -> dict[str, object]:
    """The outputs of the two revisions side by side, round by round: how many of the strings at each path are
    identical (greedy completions of the same seeded prompts: a refactor that changed answers shows here)."""
    same = total = 0
    differ: list[dict[str, object]] = []
    for round_index, (old, new) in enumerate(zip(old_runs, new_runs)):
        old_texts, new_texts = texts(old), texts(new)
        for path in sorted(set(old_texts) & set(new_texts)):
            for i, (a, b) in enumerate(zip(old_texts[path], new_texts[path])):
                total += 1
                same += a == b
                if a != b and len(differ) < 5:
                    differ.append({"round": round_index, "path": path, "index": i, "old": a[:200], "new": b[:200]})
    return {"identical": same, "compared": total, "rate": same / total if total else None, "first_differences": differ}


def markdown(result: dict, keys: str) -> str:
    """The report beside the JSON: each chosen figure's runs and the median of its per-round ratios, and the outputs'
    agreement."""
    lines = [f"# Before/after: `{' '.join(result['script'])}`", "",
             f"Earlier revision `{result['rev']}` (old) against the working tree (new), {result['started']}; runs "
             "alternate old, new, old, new, ...; the ratio is the median of the per-round ratios new / old.", "",
             "| figure | old runs | new runs | median of per-round new/old |", "|---|---|---|---|"]
    for key, s in result["summary"].items():
        if re.search(keys, key) and s["new_over_old"] is not None:
            runs = [", ".join(f"{v:.2f}" for v in s[side] if v is not None) for side in ("old_runs", "new_runs")]
            lines.append(f"| `{key}` | {runs[0]} | {runs[1]} | {s['new_over_old']:.3f} |")
    out = result["outputs"]
    if out["compared"]:
        lines += ["", f"Outputs: {out['identical']} of {out['compared']} identical across the revisions "
                  f"({100 * out['rate']:.1f} %)."]
        lines += [f"- round {d['round']}, `{d['path']}`[{d['index']}]: old {d['old']!r}, new {d['new']!r}"
                  for d in out["first_differences"]]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rev", required=True, help="the earlier revision (commit, tag, branch)")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "reports" / "compare-revisions.json"))
    parser.add_argument("--out-flag", default="--json", help="the script's option naming its JSON result file")
    parser.add_argument("--same-harness", action="store_true",
                        help="both sides run this tree's benchmark script and helpers (the load generator, the "
                             "checks) over their own tokenfleet; the default runs each revision's own script")
    parser.add_argument("--report-keys", default=r"out_tok_s|ttft_ms\.p(50|99)|tpot_ms\.p(50|99)",
                        help="regex: the figures the markdown report beside --out lists (the JSON keeps all)")
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
                harness = REPO if args.same_harness else tree
                cmd = [sys.executable, "-c", SHIM, str(tree), str(harness), str(harness / script[0]), *script[1:],
                       args.out_flag, str(out)]
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
    outputs = agreement(runs["old"], runs["new"])
    result = {"rev": args.rev, "script": script, "runs": runs, "summary": summary, "outputs": outputs,
              "started": time.strftime("%Y-%m-%d %H:%M:%S")}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    Path(args.out).with_suffix(".md").write_text(markdown(result, args.report_keys))
    if outputs["compared"]:
        print(f"outputs: {outputs['identical']} of {outputs['compared']} identical across the revisions")
    for key, s in summary.items():
        if s["new_over_old"] is not None:
            print(f"{key:50s} old {s['old_median']:10.2f}  new {s['new_median']:10.2f}  "
                  f"median of per-round new/old {s['new_over_old']:.2f}")


if __name__ == "__main__":
    main()
