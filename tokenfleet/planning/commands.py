"""``tokenfleet simulate``: run a cell, sweep cells, calibrate a cost profile, regenerate docs/sizing.md."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

from tokenfleet.planning import plots
from tokenfleet.planning.scenario import (
    add_scenario_flags,
    run_all,
    scenario_from_args,
)

SHOWN = (("offered_rps", "offered req/s", ".1f"), ("ttft_p50_s", "TTFT p50 s", ".3f"), ("ttft_p99_s", "TTFT p99 s", ".3f"),
         ("tpot_p50_s", "TPOT p50 s", ".4f"), ("tpot_p99_s", "TPOT p99 s", ".4f"), ("itl_p50_s", "ITL p50 s", ".4f"),
         ("itl_p99_s", "ITL p99 s", ".4f"), ("slo_attainment", "SLO attainment", ".3f"),
         ("goodput_rps", "goodput req/s", ".1f"), ("output_tok_s", "output tok/s", ",.0f"),
         ("mean_prompt_tokens", "mean prompt tokens", ",.0f"), ("prefix_hit_rate", "prefix hit rate", ".3f"),
         ("preemptions", "preemptions", "d"), ("utilization", "busy share", ".3f"), ("mfu", "MFU", ".3f"),
         ("kv_utilization", "KV blocks in use", ".3f"), ("mean_batch", "mean batch", ".1f"),
         ("remote_prefills", "remote prefills", "d"), ("usd_per_m_output_tokens", "$ / 1M output tokens", ".3f"),
         ("usd_per_m_tokens", "$ / 1M tokens", ".4f"), ("wall_s", "wall seconds", ".1f"))


def add_command(sub: Any) -> None:
    p = sub.add_parser("simulate", help="discrete-event fleet simulation with the real scheduler and router")
    cmds = p.add_subparsers(dest="simulate_command", required=True)

    run = cmds.add_parser("run", help="simulate one cell and print its figures")
    add_scenario_flags(run)
    run.add_argument("--json", action="store_true")
    run.add_argument("--csv", help="append the figures to this CSV")
    run.set_defaults(func=_cmd_run)

    sweep = cmds.add_parser("sweep", help="simulate a grid: cell size x P/D split x policy x per-node rate; CSV and plots")
    add_scenario_flags(sweep)
    sweep.add_argument("--rates-per-node", type=float, nargs="+", required=True, help="requests/s per node")
    sweep.add_argument("--policies", nargs="+", help="default: --policy")
    sweep.add_argument("--cell-sizes", type=int, nargs="+", help="replicas per cell (default: --replicas)")
    sweep.add_argument("--prefill-splits", type=int, nargs="+", help="prefill replicas of each cell (0 = colocated); "
                                                                      "the others decode")
    sweep.add_argument("--jobs", type=int, default=2, help="cells simulated at once (processes)")
    sweep.add_argument("--out", default="sim-sweep", help="folder for sweep.csv and the plots")
    sweep.set_defaults(func=_cmd_sweep)

    cal = cmds.add_parser("calibrate", help="measure our engine as it serves here and write a cost profile")
    cal.add_argument("--model", help="HF model folder (default: the imported SmolLM2-135M-Instruct)")
    cal.add_argument("--threads", type=int, default=2, help="the worker's torch threads (serve.py's default: 2)")
    cal.add_argument("--repeats", type=int, default=3)
    cal.add_argument("--out", default="cost-profile.json")
    cal.add_argument("--predict", type=int, nargs="*", default=[],
                     help="then print benchmarks/serve.py's figures predicted at these concurrencies")
    cal.set_defaults(func=_cmd_calibrate)

    predict = cmds.add_parser("predict-serve", help="benchmarks/serve.py's figures predicted from a cost profile")
    predict.add_argument("--profile", required=True)
    predict.add_argument("--concurrency", type=int, nargs="+", default=[8, 32])
    predict.add_argument("--num-prompts", type=int, default=64)
    predict.add_argument("--input-len", type=int, default=256)
    predict.add_argument("--output-len", type=int, default=64)
    predict.add_argument("--hop-ms", type=float, help="gateway + router + RPC latency each way (default: the "
                                                      "profile's measured round trip / 2)")
    predict.set_defaults(func=_cmd_predict)

    day = cmds.add_parser("autoscale-day", help="a compressed diurnal day: the cell autoscaled vs fixed at its size; "
                          "writes docs/sizing-autoscale.md")
    add_scenario_flags(day)
    day.add_argument("--min-replicas", type=int, default=1)
    day.add_argument("--target-concurrency", type=float, default=64.0, help="requests one replica serves")
    day.add_argument("--lead-seconds", type=float, default=60.0)
    day.add_argument("--scale-start-seconds", type=float, default=60.0, help="a new replica's time to serve")
    day.add_argument("--out", default="docs/sizing-autoscale.md")
    day.add_argument("--jobs", type=int, default=2)
    day.set_defaults(func=_cmd_autoscale_day)

    sizing = cmds.add_parser("sizing", help="regenerate docs/sizing.md: nodes, GPU-hours and cost for the headline")
    sizing.add_argument("--out", help="default: docs/sizing.md (docs/sizing-tiers.md with --tiers)")
    sizing.add_argument("--jobs", type=int, default=2)
    sizing.add_argument("--quick", action="store_true", help="a tiny smoke version (tests): small cells, short windows")
    sizing.add_argument("--tiers", action="store_true", help="only docs/sizing-tiers.md (to --out, default "
                        "docs/sizing-tiers.md): what a second KV tier and peer fetch are worth")
    sizing.set_defaults(func=_cmd_sizing)


def _cmd_run(args: argparse.Namespace) -> int:
    result = scenario_from_args(args).run()
    if args.csv:
        path = Path(args.csv)
        rows = _read_csv(path) + [result]
        plots.write_csv(rows, path)
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    print(f"cell: {result['replicas']} {'decode' if result['prefill_replicas'] else 'colocated'} replicas"
          + (f" + {result['prefill_replicas']} prefill" if result["prefill_replicas"] else "")
          + f", {result['gpus']} GPUs, {result['policy']}; {result['pattern']} arrivals at {result['rate']:.1f} req/s; "
          f"{result['window_s']:.0f} s measured ({result['simulated_s']:.0f} s simulated)")
    for key, label, spec in SHOWN:
        value = result.get(key)
        print(f"  {label:<22} {'-' if value is None else format(value, spec)}")
    verdict = "overloaded (stopped early)" if result["overloaded"] else ("yes" if result["meets_slo"] else "no")
    print(f"  {'meets both p99 SLOs':<22} {verdict}")
    return 0


def _read_csv(path: Path) -> list[dict[str, Any]]:
    import csv

    if not path.exists():
        return []
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def _cmd_sweep(args: argparse.Namespace) -> int:
    base = scenario_from_args(argparse.Namespace(**{**vars(args), "rate": 1.0}))
    cells = []
    for size in args.cell_sizes or [args.replicas + args.prefill_replicas]:
        for split in args.prefill_splits or [args.prefill_replicas]:
            if not 0 <= split < size:
                raise SystemExit(f"a {size}-replica cell cannot have {split} prefill replicas")
            for policy in args.policies or [args.policy]:
                fleet = replace(base.fleet, policy=policy, replicas=size - split, prefill_replicas=split)
                label = f"{size} nodes, " + (f"P/D {split}:{size - split}" if split else "colocated") + f", {policy}"
                cells += [replace(base, fleet=fleet, label=label).with_rate_per_node(r) for r in args.rates_per_node]
    rows = run_all(cells, args.jobs)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    plots.write_csv(rows, out / "sweep.csv")
    plots.line_plot(rows, "rate_per_node", [("slo_attainment", "SLO attainment", None),
                                            ("ttft_p99_s", "TTFT p99 (s)", base.objectives.ttft_s),
                                            ("tpot_p99_s", "TPOT p99 (s)", base.objectives.tpot_s)],
                    lambda r: r["label"], out / "sweep.png", "cell sweep", "requests/s per node")
    for r in rows:
        print(f"{r['label']:<32} {r['rate_per_node']:7.1f} req/s/node  SLO {r['slo_attainment'] or 0:.3f}  "
              f"TTFT p99 {r['ttft_p99_s'] or float('nan'):.3f}  TPOT p99 {r['tpot_p99_s'] or float('nan'):.4f}  "
              f"hit {r['prefix_hit_rate'] or 0:.2f}  {'ok' if r['meets_slo'] else 'MISS'}  ({r['wall_s']:.0f} s)")
    print(f"wrote {out / 'sweep.csv'} and {out / 'sweep.png'}")
    return 0


def _cmd_calibrate(args: argparse.Namespace) -> int:
    from tokenfleet.planning.calibrate import calibrate, predict_serve

    profile = calibrate(args.model, args.threads, args.repeats, log=lambda m: print(m, file=sys.stderr))
    profile.save(args.out)
    print(f"wrote {args.out}: {profile.base * 1000:.1f} ms + {profile.per_token * 1000:.3f} ms/token + "
          f"{profile.per_sample * 1000:.3f} ms/sample + {profile.per_pair * 1e6:.3f} us/pair + "
          f"{profile.per_kv * 1e6:.3f} us/KV token per step (median fit error {profile.fit['median_rel_error']:.0%})")
    for c in args.predict:
        print(json.dumps(predict_serve(profile, c, 64, 256, 64)))
    return 0


def _cmd_predict(args: argparse.Namespace) -> int:
    from tokenfleet.planning.calibrate import predict_serve
    from tokenfleet.planning.costs import Profile

    profile = Profile.load(args.profile)
    for c in args.concurrency:
        hop = args.hop_ms / 1000 if args.hop_ms is not None else None
        print(json.dumps(predict_serve(profile, c, args.num_prompts, args.input_len, args.output_len, hop)))
    return 0


def _cmd_sizing(args: argparse.Namespace) -> int:
    from tokenfleet.planning.sizing import regenerate, regenerate_tiers

    if args.tiers:
        regenerate_tiers(Path(args.out or "docs/sizing-tiers.md"), jobs=args.jobs, quick=args.quick)
    else:
        regenerate(Path(args.out or "docs/sizing.md"), jobs=args.jobs, quick=args.quick)
    return 0


def _cmd_autoscale_day(args: argparse.Namespace) -> int:
    """Two runs of one compressed diurnal day: the cell fixed at --replicas, and autoscaled between --min-replicas and
    --replicas with the autoscaler's own policy (cluster.autoscale). GPU-hours and SLO attainment of each."""
    from dataclasses import replace

    from tokenfleet.cluster.autoscale import ScalePolicy

    args.pattern = "diurnal"
    fixed = scenario_from_args(args)
    fixed = replace(fixed, warmup_seconds=0.0, duration_seconds=args.day_seconds, label="fixed")
    hour = args.day_seconds / 24  # the policy's clocks run at the day's compression
    policy = ScalePolicy(target_concurrency=args.target_concurrency, min_replicas=args.min_replicas,
                         max_replicas=fixed.fleet.replicas, lead_seconds=args.lead_seconds, window=hour,
                         up_cooldown=hour / 4, down_cooldown=hour / 2, down_stable=hour / 2)
    scaled = replace(fixed, fleet=replace(fixed.fleet, replicas=args.min_replicas), autoscale=policy,
                     scale_start_seconds=args.scale_start_seconds, label="autoscaled")
    results = run_all([fixed, scaled], args.jobs)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(_autoscale_report(args, policy, results))
    for r in results:
        print(f"{r['label']}: {r['gpu_hours']:.1f} GPU-hours, mean {r['mean_replicas']:.1f} replicas, SLO attainment "
              f"{r['slo_attainment']:.1%}, TTFT p99 {r['ttft_p99_s']}, TPOT p99 {r['tpot_p99_s']}")
    return 0


def _autoscale_report(args: argparse.Namespace, policy: Any, results: list[dict[str, Any]]) -> str:
    fixed, scaled = results
    lines = ["# Autoscaling over a compressed day (generated by `tokenfleet simulate autoscale-day`)", "",
             f"One cell of {fixed['replicas']} replicas ({args.gpu} x{args.tp} per replica, model "
             f"{args.model}) under diurnal traffic peaking at {fixed['rate']:.1f} requests/s (trough "
             f"{0.35:.0%} of the peak), one day compressed into {args.day_seconds:.0f} simulated seconds. Fixed: "
             f"all {fixed['replicas']} replicas all day. Autoscaled: the autoscaler's policy (`cluster.autoscale`), "
             f"{policy.min_replicas}-{policy.max_replicas} replicas at {policy.target_concurrency:g} requests each, "
             f"trend over {policy.window:.0f} s projected {policy.lead_seconds:.0f} s ahead, cooldowns "
             f"{policy.up_cooldown:.0f} s up / {policy.down_cooldown:.0f} s down (the clocks compressed with the day), "
             f"new replicas serving "
             f"{args.scale_start_seconds:.0f} s after they are asked for, retired ones drained.", "",
             "| fleet | GPU-hours (the compressed day) | mean replicas | SLO attainment | TTFT p99 | TPOT p99 | "
             "requests |", "|---|---|---|---|---|---|---|"]
    for r in results:
        ttft = "-" if r["ttft_p99_s"] is None else f"{r['ttft_p99_s'] * 1000:.0f} ms"
        tpot = "-" if r["tpot_p99_s"] is None else f"{r['tpot_p99_s'] * 1000:.1f} ms"
        lines.append(f"| {r['label']} | {r['gpu_hours']:.2f} | {r['mean_replicas']:.2f} | {r['slo_attainment']:.1%} | "
                     f"{ttft} | {tpot} | {r['requests']} |")
    saved = 1 - scaled["gpu_hours"] / fixed["gpu_hours"] if fixed["gpu_hours"] else 0.0
    lines += ["", f"The autoscaled cell used {saved:.0%} fewer GPU-hours. Replicas over the day (autoscaled):", "",
              "| simulated s | replicas paid for |", "|---|---|"]
    timeline = scaled.get("replica_timeline") or []
    step = max(1, len(timeline) // 24)
    for t, n in timeline[::step]:
        lines.append(f"| {t:.0f} | {n} |")
    lines += ["", f"Command: `tokenfleet simulate autoscale-day --replicas {fixed['replicas']} "
              f"--min-replicas {policy.min_replicas} --target-concurrency {policy.target_concurrency:g} "
              f"--day-seconds {args.day_seconds:g} ...` (see the flags of `tokenfleet simulate run`)."]
    return "\n".join(lines) + "\n"
