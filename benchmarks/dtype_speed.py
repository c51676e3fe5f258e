"""fp32 against bf16 on this CPU: the engine's throughput in each dtype, alternating rounds, one process per run.

Each round runs benchmarks/engine_throughput.py (in-process engine, --skip-hf) once per dtype, the order alternating
between rounds: output tok/s at each --batches size (prompts of --prompt-len random tokens, --output-len tokens
each, ignore EOS) and a --prefill-len-token prefill. Reported: every run, the per-round ratios fp32 / bf16 and their
median (never a ratio of medians).

    .venv/bin/python benchmarks/dtype_speed.py [--rounds 3] [--out benchmarks/reports/dtype-speed.json]
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

from serving.report import git_head, machine_line, write_report

HERE = Path(__file__).resolve().parent
DTYPES = ("float32", "bfloat16")


def run(dtype: str, args: argparse.Namespace) -> dict:
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        subprocess.run([sys.executable, str(HERE / "engine_throughput.py"), "--skip-hf", "--dtype", dtype,
                        "--batches", args.batches, "--prompt-len", str(args.prompt_len), "--output-len",
                        str(args.output_len), "--prefill-len", str(args.prefill_len), "--json", out.name],
                       check=True, stdout=subprocess.DEVNULL)
        raw = json.loads(Path(out.name).read_text())
    figures = {f"batch {row['batch']} out tok/s": row["ours"]["out_tok_s"] for row in raw["rows"]}
    figures[f"prefill {args.prefill_len} tok/s"] = raw["prefill"]["ours"]
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batches", default="1,16")
    parser.add_argument("--prompt-len", type=int, default=200)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--prefill-len", type=int, default=512)
    parser.add_argument("--out", default=str(HERE / "reports" / "dtype-speed.json"))
    args = parser.parse_args()
    rounds = []
    for r in range(args.rounds):
        order = DTYPES if r % 2 == 0 else DTYPES[::-1]
        rounds.append({dtype: run(dtype, args) for dtype in order})
        print(f"round {r + 1}: {rounds[-1]}", flush=True)
    metrics = list(rounds[0]["float32"])
    ratios = {m: [rd["float32"][m] / rd["bfloat16"][m] for rd in rounds] for m in metrics}
    result = {"started": time.strftime("%Y-%m-%d %H:%M:%S"), "machine": machine_line(), "commit": git_head(),
              "args": vars(args), "rounds": rounds, "ratios": ratios,
              "median_ratio": {m: statistics.median(v) for m, v in ratios.items()}}
    write_report(args.out, result, markdown(result))


def markdown(r: dict) -> str:
    lines = [f"# fp32 against bf16 on this CPU, engine throughput ({r['started']})", "",
             f"Machine: {r['machine']}; commit {r['commit']}. `benchmarks/engine_throughput.py --skip-hf` per run "
             f"(prompts of {r['args']['prompt_len']} tokens, {r['args']['output_len']} output tokens), dtypes "
             f"alternating.", "", "| metric | fp32 per round | bf16 per round | fp32 / bf16 per round | median ratio |",
             "|---|---|---|---|---|"]
    for m, ratios in r["ratios"].items():
        fp32 = " · ".join(f"{rd['float32'][m]:.1f}" for rd in r["rounds"])
        bf16 = " · ".join(f"{rd['bfloat16'][m]:.1f}" for rd in r["rounds"])
        lines.append(f"| {m} | {fp32} | {bf16} | {' · '.join(f'{x:.2f}' for x in ratios)} | "
                     f"**{r['median_ratio'][m]:.2f}** |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
