"""Does the simulator, calibrated on this machine, predict the real serving benchmark?

1. ``tokenfleet simulate calibrate``: probe a private local cluster through its gateway, fit a cost profile;
2. ``benchmarks/serve.py`` (tokenfleet only, through the gateway) at two concurrencies;
3. the simulator (one replica with the profile's engine settings, a closed loop of C clients)
   predicts the same runs; the bar: TTFT p50, TPOT p50 and output tok/s within 15 %.

    .venv/bin/python benchmarks/sim_calibration.py [--concurrency 8 32] [--num-prompts 64] \\
        [--profile existing.json] [--out benchmarks/reports/sim-calibration.json]

Run it on a quiet machine: both steps measure wall time.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
METRICS = (("ttft_p50_ms", "TTFT p50 ms"), ("tpot_p50_ms", "TPOT p50 ms"), ("out_tok_s", "output tok/s"))
BAR = 0.15


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--concurrency", type=int, nargs="+", default=[8, 32])
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--threads", type=int, default=2, help="the worker's torch threads (serve.py's default)")
    p.add_argument("--hop-ms", type=float, help="gateway + router latency each way (default: the profile's / 2)")
    p.add_argument("--profile", help="use this cost profile instead of calibrating now")
    p.add_argument("--out", default=str(REPO / "benchmarks" / "reports" / "sim-calibration.json"))
    args = p.parse_args()

    from tokenfleet.cli.calibrate import calibrate
    from tokenfleet.planning.costs import Profile
    from tokenfleet.planning.predict import predict_serve

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    started = time.time()
    if args.profile:
        profile = Profile.load(args.profile)
    else:
        print("calibrating (probing a real worker) ...", flush=True)
        profile = calibrate(threads=args.threads, log=lambda m: print(m, flush=True))
        profile.save(out.with_name(out.stem + "-profile.json"))
    calibrate_s = time.time() - started
    print("running benchmarks/serve.py ...", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        serve_out = Path(tmp) / "serve.json"
        subprocess.run([sys.executable, str(REPO / "benchmarks" / "serve.py"), "--skip-vllm", "--skip-direct",
                        "--concurrency", *map(str, args.concurrency), "--num-prompts", str(args.num_prompts),
                        "--input-len", str(args.input_len), "--output-len", str(args.output_len),
                        "--worker-threads", str(args.threads), "--out", str(serve_out)], check=True)
        measured = {r["concurrency"]: r for r in json.loads(serve_out.read_text())["runs"]}
    rows = []
    for c in args.concurrency:
        hop = args.hop_ms / 1000 if args.hop_ms is not None else None
        predicted = predict_serve(profile, c, args.num_prompts, args.input_len, args.output_len, hop)
        real = measured[c]
        actual = {"ttft_p50_ms": real["ttft_ms"]["p50"], "tpot_p50_ms": real["tpot_ms"]["p50"],
                  "out_tok_s": real["out_tok_s"]}
        for key, label in METRICS:
            error = predicted[key] / actual[key] - 1
            rows.append({"concurrency": c, "metric": label, "measured": actual[key], "predicted": predicted[key],
                         "error": error, "pass": abs(error) <= BAR})
    result = {"started": time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(started)), "args": vars(args),
              "profile": {k: getattr(profile, k) for k in ("base", "per_token", "per_sample", "per_pair", "per_kv")}
              | {"fit": {k: v for k, v in profile.fit.items() if k != "points"}, "engine": dict(profile.engine)},
              "calibrate_s": calibrate_s, "rows": rows, "pass": all(r["pass"] for r in rows)}
    out.write_text(json.dumps(result, indent=2) + "\n")
    report = markdown(result)
    out.with_suffix(".md").write_text(report)
    print(report)
    sys.exit(0 if result["pass"] else 1)


def markdown(result: dict) -> str:
    prof = result["profile"]
    lines = [f"# Simulator calibration ({result['started']})", "",
             f"Profile (fit to {prof['fit']['measurements']} probes, median error {prof['fit']['median_rel_error']:.0%}): "
             f"{prof['base'] * 1000:.1f} ms + {prof['per_token'] * 1000:.3f} ms/token + "
             f"{prof['per_sample'] * 1000:.3f} ms/sample + {prof['per_pair'] * 1e6:.3f} us/attention pair + "
             f"{prof['per_kv'] * 1e6:.3f} us/KV token per step; calibration took {result['calibrate_s']:.0f} s.", "",
             f"`benchmarks/serve.py` (random {result['args']['input_len']}-token prompts, "
             f"{result['args']['output_len']} output tokens, {result['args']['num_prompts']} requests, through the "
             "gateway) vs the simulator's prediction:", "",
             "| concurrency | metric | measured | predicted | error | within 15 % |", "|---|---|---|---|---|---|"]
    for r in result["rows"]:
        lines.append(f"| {r['concurrency']} | {r['metric']} | {r['measured']:.1f} | {r['predicted']:.1f} | "
                     f"{r['error']:+.1%} | {'yes' if r['pass'] else 'NO'} |")
    lines += ["", f"All within 15 %: **{'yes' if result['pass'] else 'no'}**."]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
