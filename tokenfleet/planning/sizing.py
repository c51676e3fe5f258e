"""``tokenfleet simulate sizing``: size the headline fleet by simulation and write docs/sizing.md.

The headline: 10M daily users x 15 turns (3k-token prompts on average, 400-token replies), a peak
of ~5k requests/s, Llama-3-70B-class in FP8 on 8 x H100 nodes (one TP-8 replica per node), TTFT
p99 < 700 ms and TPOT p99 < 40 ms. For each configuration (colocated or prefill/decode pools,
prefix-aware or round-robin placement) an 8-node cell is simulated at a grid of per-node request
rates around a roofline estimate, then once more between the fastest rate that met both SLOs and
the slowest that did not. The fleet needs ceil(peak / best per-node rate) nodes: cells are
independent (see "Extrapolating cells to the fleet" in the report for where that breaks).
"""

from __future__ import annotations

import argparse
import math
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from tokenfleet.planning import plots
from tokenfleet.planning.costs import Roofline, StepShape
from tokenfleet.planning.scenario import (
    Scenario,
    add_scenario_flags,
    run_all,
    scenario_from_args,
)
from tokenfleet.planning.sim import PREFIX_AWARE, ROUND_ROBIN
from tokenfleet.planning.workload import Conversations, peak_rate

FACTORS = (0.5, 0.75, 1.0, 1.3)  # x the roofline estimate of a node's rate
PD_FACTORS = (0.25, 0.4, 0.6, 0.85)  # P/D: a prefill pool caches only what it computed (see the report)
QUICK_FACTORS = (0.5, 1.0)
REFINEMENTS = 2  # bisection rounds between the best passing and the first failing rate


def headline(quick: bool) -> Scenario:
    parser = argparse.ArgumentParser()
    add_scenario_flags(parser)
    args = parser.parse_args(["--rate", "1"])
    args.warmup, args.duration, args.drain = (0.5, 1.0, 1.0) if quick else (15.0, 30.0, 15.0)
    if quick:  # small cells, short conversations: seconds, not an hour
        args.replicas, args.system_tokens, args.user_tokens, args.output_tokens = 2, 200, 30, 40
    return scenario_from_args(args)


def node_rate_estimate(s: Scenario, hit_rate: float) -> float:
    """Requests/s a node computes at full prefill steps, if every request costs its uncached prompt
    plus its reply in tokens (ignores memory: the grid around it finds the real limit)."""
    assert isinstance(s.cost, Roofline)
    budget = s.fleet.scheduler.max_num_batched_tokens
    tokens_per_s = budget / s.cost.step_seconds(StepShape(budget, 1, 1, budget * 1024, budget * 1024))
    c = s.conversations
    per_request = c.mean_prompt_tokens() * (1 - hit_rate) + c.output_tokens
    return tokens_per_s / per_request


def expected_hit_rate(c: Conversations, policy: str, nodes: int) -> float:
    """Reuse if caches were large enough: the system prompt always, the transcript where the router
    sends the next turn to the same replica (prefix-aware: always; round-robin: 1 in ``nodes``)."""
    prompt = c.mean_prompt_tokens()
    history = prompt - c.system_tokens - c.user_tokens
    same = 1.0 if policy == PREFIX_AWARE else 1 / nodes
    return (c.system_tokens + same * history) / prompt


def configurations(base: Scenario, quick: bool) -> list[tuple[str, Scenario]]:
    n = base.nodes
    out = []
    for policy in (PREFIX_AWARE, ROUND_ROBIN):
        out.append((f"colocated, {policy}", replace(base, fleet=replace(base.fleet, policy=policy))))
        for split in ((1,) if quick else (2, 3, 4) if policy == PREFIX_AWARE else (3, 4)):
            fleet = replace(base.fleet, policy=policy, replicas=n - split, prefill_replicas=split)
            out.append((f"P/D {split}:{n - split}, {policy}", replace(base, fleet=fleet)))
    return out


def search(cells: list[tuple[str, Scenario]], hit_for: Any, jobs: int, quick: bool = False) -> list[dict[str, Any]]:
    """A grid around each configuration's estimate, then bisection rounds; returns every simulated row."""
    grid = []
    for label, s in cells:
        r0 = node_rate_estimate(s, hit_for(s))
        factors = QUICK_FACTORS if quick else PD_FACTORS if s.fleet.disaggregated else FACTORS
        grid += [replace(s, label=label).with_rate_per_node(round(r0 * f, 2)) for f in factors]
    rows = run_all(grid, jobs)
    for _ in range(1 if quick else REFINEMENTS):
        refine = []
        for label, s in cells:
            best = best_rate(rows, label)
            above = [r["rate_per_node"] for r in rows if r["label"] == label and r["rate_per_node"] > best]
            if above and (min(above) - best) / min(above) > 0.05:
                lower = best or min(above) / 2
                refine.append(replace(s, label=label).with_rate_per_node(round((lower + min(above)) / 2, 2)))
        rows += run_all(refine, jobs)
    return rows


def best_rate(rows: list[dict[str, Any]], label: str) -> float:
    """The fastest per-node rate that met both SLOs with every slower rate tried also meeting them."""
    best = 0.0
    for r in sorted((r for r in rows if r["label"] == label), key=lambda r: r["rate_per_node"]):
        if not r["meets_slo"]:
            break
        best = r["rate_per_node"]
    return best


def regenerate(out: Path, jobs: int = 2, quick: bool = False) -> dict[str, Any]:
    started = time.time()
    base = headline(quick)
    peak = peak_rate(10e6, 15, 2.88)
    cells = configurations(base, quick)
    rows = search(cells, lambda s: expected_hit_rate(s.conversations, s.fleet.policy, s.nodes), jobs, quick)
    summary: list[dict[str, Any]] = []
    for label, s in cells:
        rate = best_rate(rows, label)
        nodes = math.ceil(peak / rate) if rate else None
        at = next((r for r in rows if r["label"] == label and r["rate_per_node"] == rate), None)
        summary.append({"label": label, "rate_per_node": rate, "nodes": nodes, "cell": s.nodes, "row": at})
    headline_rows = [dict(r, label=f"{base.conversations.turns:g} turns (headline)") for r in rows
                     if r["label"] == cells[0][0]]  # colocated, prefix-aware: the headline itself
    sensitivity = _sensitivity(base, jobs, quick) + headline_rows
    out.parent.mkdir(parents=True, exist_ok=True)
    figures = out.parent / out.stem
    figures.mkdir(exist_ok=True)
    plots.write_csv(rows + [dict(r, label=f"sensitivity: {r['label']}") for r in sensitivity], figures / "cells.csv")
    plots.line_plot(rows, "rate_per_node", [("slo_attainment", "SLO attainment", None),
                                            ("ttft_p99_s", "TTFT p99 (s)", base.objectives.ttft_s),
                                            ("tpot_p99_s", "TPOT p99 (s)", base.objectives.tpot_s)],
                    lambda r: r["label"], figures / "cells.png", f"{base.nodes}-node cells at the headline workload",
                    "requests/s per node")
    plots.bar_plot([s["label"] for s in summary], [s["nodes"] or 0 for s in summary], figures / "nodes.png",
                   f"nodes for {peak:,.0f} req/s at peak", "8 x H100 nodes")
    sens_points = _sensitivity_points(sensitivity, peak)
    plots.line_plot(sens_points, "prefix_hit_rate", [("nodes", "nodes", None)], lambda r: "colocated, prefix-aware",
                    figures / "prefix-sensitivity.png", "nodes vs prefix hit rate", "measured prefix hit rate")
    out.write_text(_markdown(base, peak, summary, sens_points, figures, out, time.time() - started, quick))
    return {"summary": summary, "sensitivity": sens_points, "rows": rows}


# ---- KV tiers and peer fetch -----------------------------------------------------------------------------------
TIER_GB = 1000.0  # host memory per node given to the second KV tier (an 8 x H100 node has 2 TB)
TIER_GBYTES_PER_S = 100.0  # restoring into the pool: host -> 8 GPUs over PCIe gen5, ~12.5 GB/s each
LONG_THINK_S = 300.0  # users who come back minutes later (or agents waiting on tools): a larger working set


def tier_cells(base: Scenario, quick: bool) -> list[tuple[str, Scenario]]:
    """Pairs that differ only in the second tier or in peer fetch."""
    tier_blocks = int(TIER_GB * 1e9 / (base.fleet.kv_bytes_per_token * base.fleet.block_size))
    tiered = replace(base.fleet, tier_blocks=tier_blocks, tier_bytes_per_s=TIER_GBYTES_PER_S * 1e9)
    long = replace(base, conversations=replace(base.conversations, think_seconds=LONG_THINK_S))
    n = base.nodes
    cells = [("colocated, headline", base), ("colocated, headline, + tier", replace(base, fleet=tiered))]
    if not quick:  # minutes of simulated users in flight: too slow for the smoke version
        cells += [(f"colocated, {LONG_THINK_S:g} s think", long),
                  (f"colocated, {LONG_THINK_S:g} s think, + tier", replace(long, fleet=tiered))]
    for split in ((1,) if quick else (3,)):  # 3:5, the best P/D split in sizing.md
        pd = replace(base.fleet, replicas=n - split, prefill_replicas=split)
        cells += [(f"P/D {split}:{n - split}", replace(base, fleet=pd)),
                  (f"P/D {split}:{n - split}, + peer fetch", replace(base, fleet=replace(pd, peer_fetch=True)))]
    return cells


def regenerate_tiers(out: Path, jobs: int = 2, quick: bool = False) -> dict[str, Any]:
    """docs/sizing-tiers.md: what a second KV tier and peer fetch are worth for the headline fleet."""
    started = time.time()
    base = headline(quick)
    peak = peak_rate(10e6, 15, 2.88)
    cells = tier_cells(base, quick)
    rows = search(cells, lambda s: expected_hit_rate(s.conversations, s.fleet.policy, s.nodes), jobs, quick)
    summary = []
    for label, _ in cells:
        rate = best_rate(rows, label)
        at = next((r for r in rows if r["label"] == label and r["rate_per_node"] == rate), None)
        summary.append({"label": label, "rate_per_node": rate, "nodes": math.ceil(peak / rate) if rate else None,
                        "row": at})
    figures = out.parent / out.stem
    figures.mkdir(parents=True, exist_ok=True)
    plots.write_csv(rows, figures / "cells.csv")
    out.write_text(_tiers_markdown(base, peak, summary, time.time() - started, quick))
    return {"summary": summary, "rows": rows}


def _tiers_markdown(base: Scenario, peak: float, summary: list[dict[str, Any]], seconds: float, quick: bool) -> str:
    f = base.fleet
    tier_tokens = int(TIER_GB * 1e9 / f.kv_bytes_per_token)
    lines = [
        "# KV tiers and peer fetch at the headline", "",
        "Regenerate with `.venv/bin/tokenfleet simulate sizing --tiers` (this file and `sizing-tiers/cells.csv`; "
        f"{seconds / 60:.0f} minutes on a 2-core machine{', QUICK smoke settings' if quick else ''}). The workload, "
        "hardware, cost model and objectives are those of [sizing.md](sizing.md); each pair below differs in one "
        "thing only:", "",
        f"- **+ tier**: every node keeps the blocks its pool evicts in {TIER_GB:g} GB of host memory "
        f"({tier_tokens:,} tokens of KV, {tier_tokens / (f.num_blocks * f.block_size):.1f}x the pool's "
        f"{f.num_blocks * f.block_size:,}) and restores them on a prefix hit at {TIER_GBYTES_PER_S:g} GB/s, charged "
        "to the step (not overlapped: pessimistic); the router counts tier blocks at 0.9 of a pool block.",
        f"- **{LONG_THINK_S:g} s think**: users come back after {LONG_THINK_S / 60:g} minutes instead of 30 s (or agents "
        "wait on tools): the same traffic with a working set about 10x larger.",
        "- **+ peer fetch**: the replica that computes a prompt (the prefill replica in P/D) first pulls the leading "
        "blocks another replica holds beyond its own, over the 400 Gbit/s link; in P/D that is the decode replica, "
        "which holds the replies it generated.", "",
        "| configuration | best rate per node (req/s) | nodes | TTFT p99 ms | TPOT p99 ms | prefix hit rate "
        "| tier restores / s | peer blocks / s | KV use |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for s in summary:
        row, nodes = s["row"] or {}, s["nodes"]
        if nodes is None:
            lines.append(f"| {s['label']} | none met the SLOs | - | - | - | - | - | - | - |")
            continue
        window = row.get("window_s") or 1.0
        lines.append(
            f"| {s['label']} | {s['rate_per_node']:.1f} | **{nodes}** | {(row.get('ttft_p99_s') or 0) * 1000:.0f} | "
            f"{(row.get('tpot_p99_s') or 0) * 1000:.1f} | {row.get('prefix_hit_rate') or 0:.2f} | "
            f"{row.get('tier_restored_blocks', 0) / window:,.0f} | {row.get('peer_blocks', 0) / window:,.0f} | "
            f"{row.get('kv_utilization') or 0:.2f} |")
    lines += ["", "What the pairs say:", ""]
    for a, b in zip(summary[::2], summary[1::2]):
        if a["nodes"] and b["nodes"]:
            saved = a["nodes"] - b["nodes"]
            lines.append(f"- {b['label']}: {b['nodes']} nodes instead of {a['nodes']} ({saved} fewer, "
                         f"{saved / a['nodes']:.0%}; ${saved * f.gpus_per_replica * 24 * 2:,.0f}/day at $2 per "
                         "GPU-hour, peak-sized).")
    return "\n".join(lines) + "\n"


# ---- prefix-hit sensitivity ---------------------------------------------------------------------------------
def _reuse_levels(c: Conversations, quick: bool) -> list[tuple[str, Conversations]]:
    """Workloads with the same mean prompt (~3k tokens) and less and less of it reusable."""
    target = c.mean_prompt_tokens()
    levels = [("fresh prompts", replace(c, system_tokens=1, turns=1.0, user_tokens=round(target) - 1)),
              ("system prompt only", replace(c, turns=1.0, user_tokens=round(target - c.system_tokens)))]
    for turns in (2.0,):
        earlier = turns - 1  # E[k - 1] for a geometric number of turns with this mean
        user = round((target - c.system_tokens - earlier * c.output_tokens) / (1 + earlier))
        levels.append((f"{turns:g} turns", replace(c, turns=turns, user_tokens=user)))
    return levels[1:2] if quick else levels  # the headline itself comes from the main search


def _sensitivity(base: Scenario, jobs: int, quick: bool) -> list[dict[str, Any]]:
    cells = []
    for label, conv in _reuse_levels(base.conversations, quick):
        cells.append((label, replace(base, conversations=conv)))
    return search(cells, lambda s: expected_hit_rate(s.conversations, PREFIX_AWARE, s.nodes), jobs, quick)


def _sensitivity_points(rows: list[dict[str, Any]], peak: float) -> list[dict[str, Any]]:
    points = []
    for label in dict.fromkeys(r["label"] for r in rows):
        rate = best_rate(rows, label)
        at = next((r for r in rows if r["label"] == label and r["rate_per_node"] == rate), None)
        if rate and at is not None:
            points.append({"label": label, "prefix_hit_rate": at["prefix_hit_rate"], "rate_per_node": rate,
                           "nodes": math.ceil(peak / rate)})
    return points


# ---- the report ----------------------------------------------------------------------------------------------
def _markdown(base: Scenario, peak: float, summary: list[dict[str, Any]], sens: list[dict[str, Any]],
              figures: Path, out: Path, seconds: float, quick: bool) -> str:
    rel = figures.relative_to(out.parent)
    c, f = base.conversations, base.fleet
    gpus_per_node = f.gpus_per_replica
    lines = [
        "# Sizing the headline fleet", "",
        "Regenerate with `.venv/bin/tokenfleet simulate sizing` (this file, the plots and `cells.csv` beside it;"
        f" {seconds / 60:.0f} minutes on a 2-core machine{', QUICK smoke settings' if quick else ''}).", "",
        "## The workload and the hardware", "",
        f"- 10M daily users x 15 turns, peak factor 2.88: **{peak:,.0f} requests/s at peak**.",
        f"- Conversations of {c.turns:g} turns on average (geometric), {c.tenants} tenants with a {c.system_tokens}-token "
        f"system prompt, {c.user_tokens}-token user messages, {c.output_tokens}-token replies (lognormal, sigma "
        f"{c.length_sigma}), {c.think_seconds:g} s think time; every turn resends the transcript: mean prompt "
        f"**{c.mean_prompt_tokens():,.0f} tokens**.",
        f"- Llama-3-70B-class, FP8 weights and KV, one TP-{gpus_per_node} replica per 8 x H100 node; cost model: the "
        "roofline of `tokenfleet plan` (50% of peak FLOP/s in prefill, 70% of HBM bandwidth in decode, 2 ms per step), "
        f"KV capacity {f.num_blocks * f.block_size:,} tokens per node, step budget "
        f"{f.scheduler.max_num_batched_tokens} tokens, at most {f.scheduler.max_num_running} running requests.",
        f"- Objectives: TTFT p99 <= {base.objectives.ttft_s * 1000:.0f} ms and TPOT p99 <= "
        f"{base.objectives.tpot_s * 1000:.0f} ms over the measured requests (one never started counts as an infinite "
        "TTFT; one still streaming at the end is judged on its tokens so far); a cell whose queue grows without bound "
        "fails.",
        f"- Each point: a {base.nodes}-node cell, {base.warmup_seconds:g} s warm-up (the conversations already under "
        f"way are seeded with their transcripts cached where the router put them), {base.duration_seconds:g} s "
        "measured, Poisson arrivals, our scheduler, block manager and placement code.", "",
        "## Nodes needed at peak", "",
        "| configuration | best rate per node (req/s) | nodes | GPUs | GPU-hours/day (peak-sized) | $/day at $2 | "
        "$/day at $4 | $/day at $2, autoscaled | TTFT p99 ms | TPOT p99 ms | prefix hit rate |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for s in summary:
        row, nodes = s["row"] or {}, s["nodes"]
        if nodes is None:
            lines.append(f"| {s['label']} | none met the SLOs | - | - | - | - | - | - | - | - | - |")
            continue
        gpu_hours = nodes * gpus_per_node * 24
        lines.append(
            f"| {s['label']} | {s['rate_per_node']:.1f} | **{nodes}** | {nodes * gpus_per_node:,} | {gpu_hours:,} | "
            f"{gpu_hours * 2:,.0f} | {gpu_hours * 4:,.0f} | {gpu_hours * 2 / 2.88:,.0f} | "
            f"{(row.get('ttft_p99_s') or 0) * 1000:.0f} | {(row.get('tpot_p99_s') or 0) * 1000:.1f} | "
            f"{row.get('prefix_hit_rate') or 0:.2f} |")
    ok = [s for s in summary if s["nodes"]]
    if ok:
        best = min(ok, key=lambda s: s["nodes"])
        lines += ["", f"Fewest nodes: **{best['label']}, {best['nodes']} nodes** ({best['nodes'] * gpus_per_node:,} "
                      "GPUs). \"Autoscaled\" assumes the fleet follows the diurnal curve exactly (mean/peak = 1/2.88); "
                      "a real fleet lands between the two columns.", ""]
    lines += [*_READING, "", f"![nodes]({rel}/nodes.png)", "", f"![cells]({rel}/cells.png)", "",
              "## Sensitivity to the prefix hit rate", "",
              "Colocated, prefix-aware; the same mean prompt with less of it reusable (fewer turns per conversation, "
              "then only the system prompt, then nothing):", "",
              "| workload | measured prefix hit rate | best rate per node | nodes |", "|---|---|---|---|"]
    lines += [f"| {p['label']} | {p['prefix_hit_rate']:.2f} | {p['rate_per_node']:.1f} | {p['nodes']} |" for p in sens]
    lines += ["", f"![sensitivity]({rel}/prefix-sensitivity.png)", "", *_EXTRAPOLATION]
    return "\n".join(lines) + "\n"


_READING = [
    "How to read it (the mechanisms behind the numbers, visible in `cells.csv`):", "",
    "- **Prefix-aware vs round-robin**: a conversation's next turn resends ~3k tokens of which ~96% were "
    "computed for its previous turn. Prefix-aware placement sends it back to the replica that holds them, so a "
    "turn costs about its new message plus its reply; round-robin lands on a replica holding the transcript 1 "
    "time in 8 and recomputes it otherwise (only the tenant's system prompt is found everywhere).",
    "- **Colocated vs P/D with this workload**: our router disaggregates a request only when the decode replica "
    "lacks at least `min_uncached_tokens` (128) of its prompt. The decode replica that served the previous turn "
    "holds the transcript *including the reply it generated*; the prefill pool holds only prompts it computed "
    "itself. A remote prefill therefore recomputes the last reply and any turns that stayed local, and the "
    "prefill pool, not the decode pool, sets the limit, even when most of the cell is decode capacity. P/D is "
    "built for long uncached prompts; this workload reuses most of each prompt (P/D on fresh-prompt traffic is "
    "not simulated here).",
    "- **At the limit**: TTFT p99 explodes once prefill demand nears a node's compute (the queue grows), and "
    "TPOT p99 rises as more steps carry a full 2048-token prefill chunk (~45 ms on this roofline, above the "
    "40 ms objective); a smaller step budget (`--max-num-batched-tokens`) trades TTFT for TPOT.",
    "- **KV tiers and peer fetch**: what a host-memory second tier per node and peer fetch (the prefill replica "
    "pulling the transcript, replies included, from the decode replica) change in these numbers is in "
    "[sizing-tiers.md](sizing-tiers.md) (`tokenfleet simulate sizing --tiers`).",
]

_EXTRAPOLATION = [
    "## Extrapolating cells to the fleet", "",
    "A cell is a group of nodes behind one routing domain that receives its share of the traffic (conversations "
    "and tenants are assigned to cells upstream, e.g. by hashing the conversation id at the gateway tier). Cells "
    "are independent, so the fleet is `ceil(peak / rate per node)` nodes arranged in cells like the simulated one, "
    "and percentiles "
    "of identical cells are the fleet's percentiles. Where that breaks:", "",
    "- **Prefix reuse across cells**: a tenant's system prompt is cached once per cell, not once per fleet; with "
    "few, huge system prompts a fleet-wide router would save a little more prefill (small here: 1k tokens per "
    "tenant). A conversation that moves between cells loses its cache.",
    "- **Statistical multiplexing**: bigger cells absorb bursts better; 8-node cells are slightly pessimistic "
    "for Poisson traffic and optimistic if a single tenant's burst can exceed a cell.",
    "- **Router and control plane**: the simulation charges a fixed hop per request; one router process handling "
    "5k picks/s and etcd's affinity writes are not modelled (measure them: benchmarks/prefix_routing.py).",
    "- **The cost model**: a roofline with fixed efficiencies; calibrate it against the real engine "
    "(`tokenfleet simulate calibrate` does this for our CPU engine; on H100 the TensorRT-LLM engine's measured "
    "step times would replace it). Failures, stragglers and network contention are not modelled.",
]
