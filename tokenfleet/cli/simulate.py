"""``tokenfleet simulate``: run a cell, sweep cells, calibrate a cost profile, regenerate docs/sizing.md."""

from __future__ import annotations

import argparse
import json
import math
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
    day.add_argument("--target-concurrency", type=float, default=0.0, help="requests one replica serves "
                     "(0: measured, one replica at the peak's share of the load)")
    day.add_argument("--down-margin", type=float, default=0.75, help="scale down only when demand fits one replica "
                     "fewer at this share of its capacity")
    day.add_argument("--sensitivity", type=float, nargs="*", default=[], help="further troughs (trough / peak) to "
                     "run the same policy on")
    day.add_argument("--ttft-objective", type=float, default=0.0, help="seconds (0: none); the policy adds a replica "
                     "when a newcomer's predicted wait before its prefill exceeds it, instead of on any queue")
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
    from tokenfleet.cli.calibrate import calibrate
    from tokenfleet.planning.predict import predict_serve

    profile = calibrate(args.model, args.threads, args.repeats, log=lambda m: print(m, file=sys.stderr))
    profile.save(args.out)
    print(f"wrote {args.out}: {profile.base * 1000:.1f} ms + {profile.per_token * 1000:.3f} ms/token + "
          f"{profile.per_sample * 1000:.3f} ms/sample + {profile.per_pair * 1e6:.3f} us/pair + "
          f"{profile.per_kv * 1e6:.3f} us/KV token per step (median fit error {profile.fit['median_rel_error']:.0%})")
    for c in args.predict:
        print(json.dumps(predict_serve(profile, c, 64, 256, 64)))
    return 0


def _cmd_predict(args: argparse.Namespace) -> int:
    from tokenfleet.planning.costs import Profile
    from tokenfleet.planning.predict import predict_serve

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
    """One compressed diurnal day, the cell fixed at --replicas (sized for the peak) against the cell autoscaled between
    --min-replicas and --replicas by the autoscaler's own policy (cluster.autoscale); then the same at each
    --sensitivity trough. A replica's capacity (--target-concurrency 0) is measured at the SLO: one replica under
    the peak's share of the load, its mean running + waiting requests."""
    from dataclasses import replace

    from tokenfleet.cluster.autoscale import ScalePolicy

    args.pattern = "diurnal"
    fixed = scenario_from_args(args)
    fixed = replace(fixed, warmup_seconds=0.0, duration_seconds=args.day_seconds, label="fixed")
    calibration = None
    if args.target_concurrency <= 0:
        one = replace(fixed, fleet=replace(fixed.fleet, replicas=1), warmup_seconds=20.0, duration_seconds=60.0,
                      arrivals=replace(fixed.arrivals, pattern="poisson", rate=fixed.arrivals.rate / fixed.nodes),
                      label="calibration")
        calibration = one.run()
        args.target_concurrency = calibration["mean_demand_per_replica"]
        print(f"capacity: one replica at {one.arrivals.rate:.2f} requests/s holds {args.target_concurrency:.0f} "
              f"requests (SLO attainment {calibration['slo_attainment']:.1%})")
    hour = args.day_seconds / 24  # the policy's clocks run at the day's compression
    policy = ScalePolicy(target_concurrency=args.target_concurrency, min_replicas=args.min_replicas,
                         max_replicas=fixed.fleet.replicas, lead_seconds=args.lead_seconds, window=hour,
                         up_cooldown=hour / 4, down_cooldown=hour / 2, down_stable=hour / 2,
                         down_margin=args.down_margin, ttft_objective=args.ttft_objective,
                         scale_on_queue=args.ttft_objective <= 0)
    days = []
    for trough in [args.trough_ratio, *(t for t in args.sensitivity if t != args.trough_ratio)]:
        day = replace(fixed, arrivals=replace(fixed.arrivals, trough_ratio=trough), label=f"fixed@{trough:g}")
        # the day starts at its trough, with the cell the previous night left: the trough's share of the peak's size
        start = min(fixed.fleet.replicas, max(args.min_replicas, math.ceil(trough * fixed.fleet.replicas)))
        days += [day, replace(day, fleet=replace(day.fleet, replicas=start), autoscale=policy,
                              scale_start_seconds=args.scale_start_seconds, label=f"autoscaled@{trough:g}")]
    results = run_all(days, args.jobs)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(_autoscale_report(args, policy, results, calibration))
    for r in results:
        print(f"{r['label']}: {r['gpu_hours']:.1f} GPU-hours, mean {r['mean_replicas']:.1f} replicas, SLO attainment "
              f"{r['slo_attainment']:.1%}, TTFT p99 {r['ttft_p99_s']}, TPOT p99 {r['tpot_p99_s']}")
    return 0


def _autoscale_report(args: argparse.Namespace, policy: Any, results: list[dict[str, Any]],
                      calibration: dict[str, Any] | None) -> str:
    fixed, scaled = results[:2]
    capacity = (f"{policy.target_concurrency:.0f} requests each (measured: one replica at the peak's share, "
                f"{fixed['rate'] / fixed['replicas']:.2f} requests/s, held a mean of that many running + waiting, at "
                f"{calibration['slo_attainment']:.1%} SLO attainment)" if calibration else
                f"{policy.target_concurrency:g} requests each (given)")
    lines = ["# Autoscaling over a compressed day (generated by `tokenfleet simulate autoscale-day`)", "",
             f"One cell of {fixed['replicas']} replicas ({args.gpu} x{args.tp} per replica, model "
             f"{args.model}) under diurnal traffic peaking at {fixed['rate']:.1f} requests/s (a raised cosine; trough "
             f"{args.trough_ratio:.0%} of the peak, so the day's mean is {(1 + args.trough_ratio) / 2:.0%} of it), one "
             f"day compressed into {args.day_seconds:.0f} simulated seconds. Fixed: all {fixed['replicas']} replicas "
             f"all day, sized for the peak. Autoscaled: the autoscaler's policy (`cluster.autoscale`), "
             f"{policy.min_replicas}-{policy.max_replicas} replicas at {capacity}, "
             f"trend over {policy.window:.0f} s projected {policy.lead_seconds:.0f} s ahead, cooldowns "
             f"{policy.up_cooldown:.0f} s up / {policy.down_cooldown:.0f} s down (the clocks compressed with the day), "
             f"scale-down only with {1 - policy.down_margin:.0%} to spare, "
             + (f"a replica added when a newcomer's predicted wait before its prefill exceeds "
                f"{policy.ttft_objective * 1000:.0f} ms (not on any queue), " if policy.ttft_objective else
                f"a replica added when requests queue for {policy.queue_seconds:g} s, ")
             + "starting the day at the trough's share of the "
             f"cell, new replicas serving "
             f"{args.scale_start_seconds:.0f} s after they are asked for, retired ones drained.", "",
             "| fleet | GPU-hours (the compressed day) | mean replicas | SLO attainment | TTFT p99 | TPOT p99 | "
             "requests |", "|---|---|---|---|---|---|---|"]
    for r in results[:2]:
        ttft = "-" if r["ttft_p99_s"] is None else f"{r['ttft_p99_s'] * 1000:.0f} ms"
        tpot = "-" if r["tpot_p99_s"] is None else f"{r['tpot_p99_s'] * 1000:.1f} ms"
        lines.append(f"| {r['label'].split('@')[0]} | {r['gpu_hours']:.2f} | {r['mean_replicas']:.2f} | "
                     f"{r['slo_attainment']:.1%} | {ttft} | {tpot} | {r['requests']} |")
    ratio = scaled["gpu_hours"] / fixed["gpu_hours"] if fixed["gpu_hours"] else 0.0
    lines += ["", f"The autoscaled cell used **{ratio:.2f}x** the fixed cell's GPU-hours at "
              f"**{scaled['slo_attainment']:.1%}** SLO attainment (TTFT p99 <= {args.ttft_slo_ms:g} ms and TPOT p99 <= "
              f"{args.tpot_slo_ms:g} ms per request). Replicas over the day (autoscaled):", "",
              "| simulated s | replicas paid for |", "|---|---|"]
    timeline = scaled.get("replica_timeline") or []
    step = max(1, len(timeline) // 24)
    for t, n in timeline[::step]:
        lines.append(f"| {t:.0f} | {n} |")
    if len(results) > 2:
        lines += ["", "## The same policy on other days", "", "The trough decides how much there is to save: a "
                  "fleet that followed the curve exactly would pay (1 + trough) / 2 of the fixed cell.", "",
                  "| trough / peak | fixed GPU-hours | fixed SLO | autoscaled GPU-hours | ratio | autoscaled SLO | "
                  "mean replicas |", "|---|---|---|---|---|---|---|"]
        for f, a in zip(results[::2], results[1::2], strict=True):
            lines.append(f"| {f['label'].split('@')[1]} | {f['gpu_hours']:.2f} | {f['slo_attainment']:.1%} | "
                         f"{a['gpu_hours']:.2f} | {a['gpu_hours'] / f['gpu_hours']:.2f}x | {a['slo_attainment']:.1%} | "
                         f"{a['mean_replicas']:.2f} |")
    lines += ["", f"Command: `tokenfleet simulate autoscale-day --replicas {fixed['replicas']} --rate {fixed['rate']:g} "
              f"--min-replicas {policy.min_replicas} --trough-ratio {args.trough_ratio:g} --day-seconds "
              f"{args.day_seconds:g} --scale-start-seconds {args.scale_start_seconds:g} --lead-seconds "
              f"{args.lead_seconds:g} --down-margin {policy.down_margin:g}"
              + (f" --ttft-objective {policy.ttft_objective:g}" if policy.ttft_objective else "")
              + (" --peer-fetch" if args.peer_fetch else "")
              + (f" --sensitivity {' '.join(f'{t:g}' for t in args.sensitivity)}" if args.sensitivity else "")
              + "` (target concurrency measured unless given; see the flags of `tokenfleet simulate run`)."]
    return "\n".join(lines) + "\n"
