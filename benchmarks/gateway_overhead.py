"""Gateway overhead: the same load straight to a worker's gRPC `Generate` vs through the gateway.

One cluster (etcd, one colocated worker with `tokenfleet up`'s default threads, router, gateway),
then --rounds alternating pairs at --concurrency: direct (gRPC `EngineService.Generate`) and gateway
(streamed `/v1/completions` over HTTP), each with its own fresh random prompts of --input-len token
ids, --output-len tokens (ignore_eos). Per run: output tok/s, TTFT/TPOT and each process's CPU
share. The ratio gateway / direct is taken per pair; the bar (>= 0.9) is checked on the median.

    .venv/bin/python benchmarks/gateway_overhead.py [--rounds 3] [--concurrency 32]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import time
from pathlib import Path

from serve import Tokenfleet
from serving.cores import CoreMonitor
from serving.load import fresh_prompts, summarize
from serving.procs import Children
from serving.report import write_report

REPO = Path(__file__).resolve().parent.parent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--seed", type=int, default=int(time.time()) % 1_000_000)
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "reports" / "gateway-overhead.json"))
    args = parser.parse_args()

    from tokenfleet.cli.launcher import worker_threads
    from tokenfleet.models.gguf_import import DEFAULT_MODEL_NAME, ensure_default_model

    model_dir = str(Path(ensure_default_model()).resolve())
    vocab = json.loads((Path(model_dir) / "config.json").read_text())["vocab_size"]
    children = Children()
    runs: list[dict] = []
    try:
        system = Tokenfleet(children, model_dir, DEFAULT_MODEL_NAME, worker_threads(1), direct=True)
        targets = system.targets()
        warm = fresh_prompts(2 * args.concurrency, args.input_len, vocab, seed=args.seed + 999_999)
        for load in targets.values():
            asyncio.run(load(warm[: args.concurrency], args.concurrency, 8))
        for r in range(args.rounds):
            order = ["worker-grpc", "gateway"] if r % 2 == 0 else ["gateway", "worker-grpc"]
            for target in order:
                prompts = fresh_prompts(args.num_prompts, args.input_len, vocab, seed=args.seed + 1000 * r + len(target))
                with CoreMonitor(system.roots() | {"client": os.getpid()}) as monitor:
                    results, wall = asyncio.run(targets[target](prompts, args.concurrency, args.output_len))
                row = {"round": r, "target": target, **summarize(results, wall, args.output_len), "cpu": monitor.report()}
                runs.append(row)
                procs = ", ".join(f"{p['label']} {p['cpu_pct']:.0f}%" for p in row["cpu"]["processes"] if p["cpu_pct"] >= 1)
                print(f"round {r} {target:>11}: {row['out_tok_s']:.1f} tok/s | {procs}", flush=True)
    finally:
        children.stop_all()
    ratios = []
    for r in range(args.rounds):
        direct = next(x for x in runs if x["round"] == r and x["target"] == "worker-grpc")
        gateway = next(x for x in runs if x["round"] == r and x["target"] == "gateway")
        ratios.append(gateway["out_tok_s"] / direct["out_tok_s"])
    result = {"started": time.strftime("%Y-%m-%d %H:%M:%S"), "args": vars(args), "runs": runs, "ratios": ratios,
              "median_ratio": statistics.median(ratios), "pass": statistics.median(ratios) >= 0.9}
    write_report(args.out, result, markdown(result))


def markdown(result: dict) -> str:
    a = result["args"]
    lines = [f"# Gateway overhead at c={a['concurrency']} ({result['started']})", "",
             f"One cluster (etcd, one worker with `tokenfleet up`'s default threads, router, gateway); {a['rounds']} "
             f"alternating pairs of runs, {a['num_prompts']} fresh random {a['input_len']}-token prompts each, "
             f"{a['output_len']} output tokens (ignore_eos). direct = gRPC `Generate` on the worker; gateway = streamed "
             "`/v1/completions`. Both clients run in this process (`client`).", "",
             "| round | target | out tok/s | TTFT p50/p99 ms | TPOT p50/p99 ms | CPU % by process |", "|---|---|---|---|---|---|"]
    for r in result["runs"]:
        procs = ", ".join(f"{p['label']} {p['cpu_pct']:.0f}" for p in r["cpu"]["processes"] if p["cpu_pct"] >= 1)
        lines.append(f"| {r['round']} | {r['target']} | {r['out_tok_s']:.1f} | {r['ttft_ms']['p50']:.0f}/"
                     f"{r['ttft_ms']['p99']:.0f} | {r['tpot_ms']['p50']:.1f}/{r['tpot_ms']['p99']:.1f} | {procs} |")
    lines += ["", f"gateway / direct per round: {' · '.join(f'{x:.2f}' for x in result['ratios'])}; median "
                  f"**{result['median_ratio']:.2f}** (bar >= 0.90: {'pass' if result['pass'] else 'FAIL'})."]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
