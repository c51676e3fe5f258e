"""What mutual TLS on the internal plane costs: the serving benchmark with and without it, alternating.

Runs ``benchmarks/serve.py --skip-vllm --skip-direct`` (gateway -> router -> worker, etcd) with the
default mutual-TLS plane and with ``--insecure`` (plaintext), alternately, --rounds times each, at the
concurrencies given (default 1 and 32). Reports every run, the medians, and mTLS / plaintext ratios of
output tok/s, TTFT and TPOT p50/p99. The two configurations differ only in the plane: certificates
made for the run, etcd over TLS with client certificates, and every gRPC hop mutually authenticated.

    .venv/bin/python benchmarks/mtls_overhead.py [--rounds 3] [--concurrency 1 32] [--num-prompts 64]
        [--out benchmarks/reports/mtls-overhead.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
METRICS = (("out_tok_s", ("out_tok_s",)), ("ttft_p50_ms", ("ttft_ms", "p50")), ("ttft_p99_ms", ("ttft_ms", "p99")),
           ("tpot_p50_ms", ("tpot_ms", "p50")), ("tpot_p99_ms", ("tpot_ms", "p99")))


def one_run(insecure: bool, args: argparse.Namespace) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "serve.json"
        argv = [sys.executable, str(REPO / "benchmarks" / "serve.py"), "--skip-vllm", "--skip-direct",
                "--concurrency", *map(str, args.concurrency), "--num-prompts", str(args.num_prompts), "--out", str(out)]
        subprocess.run([*argv, *(["--insecure"] if insecure else [])], check=True, stdout=subprocess.DEVNULL)
        result = json.loads(out.read_text())
    rows = {}
    for run in result["runs"]:
        row = {}
        for name, path in METRICS:
            value = run
            for key in path:
                value = value[key]
            row[name] = value
        row["errors"] = run["errors"]
        rows[str(run["concurrency"])] = row
    return {"plane": "plaintext" if insecure else "mtls", "loadavg_start": result["machine"]["loadavg_start"],
            "by_concurrency": rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "reports" / "mtls-overhead.json"))
    args = parser.parse_args()
    runs = []
    for i in range(args.rounds):
        for insecure in (True, False) if i % 2 == 0 else (False, True):  # alternate which goes first
            run = one_run(insecure, args)
            runs.append(run)
            print(json.dumps(run), flush=True)
    summary: dict = {}
    for c in map(str, args.concurrency):
        summary[c] = {}
        for name, _ in METRICS:
            plain = [r["by_concurrency"][c][name] for r in runs if r["plane"] == "plaintext"]
            mtls = [r["by_concurrency"][c][name] for r in runs if r["plane"] == "mtls"]
            summary[c][name] = {"plaintext_runs": plain, "mtls_runs": mtls, "plaintext_median": statistics.median(plain),
                                "mtls_median": statistics.median(mtls),
                                "mtls_over_plaintext": statistics.median(mtls) / statistics.median(plain)}
    result = {"started": time.strftime("%Y-%m-%d %H:%M:%S"), "args": vars(args), "runs": runs, "summary": summary}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    lines = [f"# Mutual TLS on the internal plane: overhead\n\n{result['started']}; `benchmarks/mtls_overhead.py "
             f"--rounds {args.rounds}`: `benchmarks/serve.py --skip-vllm --skip-direct` (etcd, router, one worker with "
             f"2 torch threads, gateway; {args.num_prompts} prompts of 256 tokens, 64 output tokens) alternately with "
             "the default mutual-TLS plane and `--insecure`. Medians; every run below.\n",
             "| concurrency | metric | plaintext | mTLS | mTLS / plaintext | plaintext runs | mTLS runs |",
             "|---|---|---|---|---|---|---|"]
    for c, metrics in summary.items():
        for name, m in metrics.items():
            lines.append(f"| {c} | {name} | {m['plaintext_median']:.1f} | {m['mtls_median']:.1f} | "
                         f"{m['mtls_over_plaintext']:.3f} | {', '.join(f'{v:.1f}' for v in m['plaintext_runs'])} | "
                         f"{', '.join(f'{v:.1f}' for v in m['mtls_runs'])} |")
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
