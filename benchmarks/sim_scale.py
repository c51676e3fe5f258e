"""How long does the simulator take for the headline? One cell of >= 8 nodes, >= 60 s of peak measured.

The cell gets its share of the 5k req/s peak for a fleet of --fleet-nodes (take the count
docs/sizing.md found); the bar is 10 minutes of wall time on this 2-core machine, one process.

    .venv/bin/python benchmarks/sim_scale.py [--fleet-nodes 100] [--replicas 8] [--duration 60] \\
        [--out benchmarks/reports/sim-scale.json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
BAR_SECONDS = 600


def main() -> None:
    from tokenfleet.planning.scenario import (
        add_scenario_flags,
        scenario_from_args,
    )

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_scenario_flags(p)
    p.add_argument("--out", default=str(REPO / "benchmarks" / "reports" / "sim-scale.json"))
    p.set_defaults(fleet_nodes=100)
    args = p.parse_args()
    scenario = scenario_from_args(args)
    started = time.time()
    result = scenario.run()
    wall = time.time() - started
    row = {"started": time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(started)), "args": vars(args),
           "nodes": scenario.nodes, "measured_s": scenario.duration_seconds, "simulated_s": result["simulated_s"],
           "wall_s": wall, "loadavg_before": os.getloadavg()[0], "pass": wall <= BAR_SECONDS
           and scenario.nodes >= 8 and scenario.duration_seconds >= 60, "result": result}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(row, indent=2) + "\n")
    lines = [f"# Simulator scale ({row['started']})", "",
             f"One cell of {scenario.nodes} nodes ({result['gpus']} GPUs, {result['policy']}), its share of the 5k req/s "
             f"peak for a {args.fleet_nodes}-node fleet: {result['rate']:.0f} req/s, {scenario.warmup_seconds:g} s warm-up, "
             f"{scenario.duration_seconds:g} s measured, {result['simulated_s']:.0f} s simulated in all.", "",
             f"- wall time: **{wall:.0f} s** (bar: {BAR_SECONDS} s): {'pass' if row['pass'] else 'FAIL'}",
             f"- requests measured {result['requests']:,}, mean batch {result['mean_batch']:.0f} per replica, "
             f"output {result['output_tok_s']:,.0f} tok/s",
             f"- TTFT p50/p99 {result['ttft_p50_s'] * 1000:.0f}/{result['ttft_p99_s'] * 1000:.0f} ms, TPOT p50/p99 "
             f"{result['tpot_p50_s'] * 1000:.1f}/{result['tpot_p99_s'] * 1000:.1f} ms, prefix hit rate "
             f"{result['prefix_hit_rate']:.2f}, meets both SLOs: {result['meets_slo']}"]
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    sys.exit(0 if row["pass"] else 1)


if __name__ == "__main__":
    main()
