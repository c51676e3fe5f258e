"""The native fp32 CPU kernels against the torch reference kernels, end to end in the engine and matmul by matmul.

fp32 is the CPU default dtype. Two engines serve it: ``TOKENFLEET_KERNELS=auto`` (the native kernels: the few-row
matmul of csrc/skinny_linear.c for steps of up to 32 rows, csrc/paged_attention.c and csrc/fused_ops.c in fp32) and
``TOKENFLEET_KERNELS=torch`` (F.linear / MKL, the torch attention and layer ops). Each round runs one fresh process
per choice, the order alternating between rounds, each process:

1. answers first: greedy outputs of a France chat and of --batch random prompts, compared across the two choices
   (token match rate per request; the France answer must contain "Paris");
2. c=1: one --prompt-len prompt, --output-len tokens (ignore EOS): time per output token after the first;
3. c=--batch: --batch prompts together: output tok/s;
4. prefill: one --prefill-len prompt, one token: prefill tok/s.

Then the matmul alone, in this process: the model's 30 layers of fp32 weights (distinct tensors, so each pass reads
them from memory as a decode step does), x of 1..32 rows, the few-row kernel against F.linear, alternating, with the
outputs compared with float64 first. Reported: every run, per-round ratios and their median.

    .venv/bin/python benchmarks/cpu_kernels.py [--rounds 3] [--out benchmarks/reports/DATE-cpu-kernels.json]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from serving.report import git_head, machine_line, write_report

HERE = Path(__file__).resolve().parent
CHOICES = ("auto", "torch")
FRANCE = [{"role": "user", "content": "What is the capital of France?"}]


def child(args: argparse.Namespace) -> dict:
    import torch

    from tokenfleet.engine.sampling_params import SamplingParams
    from tokenfleet.llm import LLM

    llm = LLM(None, dtype="float32", num_threads=args.threads)
    vocab = llm.core.model.vocab_size
    rng = random.Random(20261128)

    def prompt(n: int) -> list[int]:
        return [rng.randrange(200, vocab) for _ in range(n)]

    greedy = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    (france,) = llm.chat(FRANCE, SamplingParams(max_tokens=16, temperature=0.0))
    single, batch, long = prompt(args.prompt_len), [prompt(args.prompt_len) for _ in range(args.batch)], prompt(
        args.prefill_len)
    llm.generate([single], SamplingParams(max_tokens=4, temperature=0.0))  # warm-up
    start = time.perf_counter()
    llm.generate([single], SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
    ttft = time.perf_counter() - start
    start = time.perf_counter()
    one = llm.generate([single], greedy)[0]
    c1 = time.perf_counter() - start
    start = time.perf_counter()
    many = llm.generate(batch, greedy)
    cb = time.perf_counter() - start
    start = time.perf_counter()
    llm.generate([long], SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
    prefill = time.perf_counter() - start
    assert len(one.token_ids) == args.output_len
    return {"kernels": [c.implementation for c in llm.core.model.kernel_checks if c.serving == c.implementation]
            or ["torch reference"],
            "threads": torch.get_num_threads(), "france": france.text,
            "tokens": {"c1": one.token_ids, **{f"batch-{i}": r.token_ids for i, r in enumerate(many)}},
            "figures": {"c=1 ms per output token": (c1 - ttft) / (args.output_len - 1) * 1e3,
                        f"c={args.batch} out tok/s": args.batch * args.output_len / cb,
                        f"prefill {args.prefill_len} tok/s": args.prefill_len / prefill}}


def run(choice: str, args: argparse.Namespace) -> dict:
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        subprocess.run([sys.executable, __file__, "--child", "--json", out.name, "--threads", str(args.threads),
                        "--batch", str(args.batch), "--prompt-len", str(args.prompt_len), "--output-len",
                        str(args.output_len), "--prefill-len", str(args.prefill_len)],
                       env={**os.environ, "TOKENFLEET_KERNELS": choice}, check=True, stdout=subprocess.DEVNULL)
        return json.loads(Path(out.name).read_text())


def matmul_rounds(rounds: int) -> dict:
    """Few-row kernel vs F.linear over 30 layers' distinct fp32 weights (SmolLM2-135M's shapes)."""
    import torch
    import torch.nn.functional as F

    from tokenfleet.models.linear import native_few_rows

    few = native_few_rows()
    if few is None:
        return {"skipped": "the native few-row matmul cannot be built here"}
    shapes = [(960, 576), (576, 576), (3072, 576), (576, 1536)] * 30
    weights = [torch.randn(n, k) * k**-0.5 for n, k in shapes]
    total_bytes = sum(w.numel() * 4 for w in weights)
    result: dict = {"weight bytes": total_bytes, "rows": {}}
    for rows in (1, 2, 4, 8, 16, 32):
        xs = {k: torch.randn(rows, k) for k in (576, 1536)}
        for w in weights[:4]:
            x = xs[w.shape[1]]
            want = F.linear(x.double(), w.double())
            err = float(((few(x, w).double() - want).abs() / (1e-5 + 1e-4 * want.abs())).max())
            assert err <= 1, f"few-row matmul off by {err:.3g}x the fp32 tolerance at {rows} rows, {tuple(w.shape)}"

        def timed(fn) -> float:
            start = time.perf_counter()
            for w in weights:
                fn(xs[w.shape[1]], w)
            return (time.perf_counter() - start) * 1e3

        runs = []
        for r in range(rounds):
            order = (("few", few), ("F.linear", F.linear)) if r % 2 == 0 else (("F.linear", F.linear), ("few", few))
            timed(F.linear)  # warm-up
            runs.append({name: timed(fn) for name, fn in order})
        ratios = [run["few"] / run["F.linear"] for run in runs]
        result["rows"][rows] = {"runs_ms": runs, "ratios": ratios, "median_ratio": statistics.median(ratios)}
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=200)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--prefill-len", type=int, default=1024)
    parser.add_argument("--out", default=str(HERE / "reports" / f"{time.strftime('%Y-%m-%d')}-cpu-kernels.json"))
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--json", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        Path(args.json).write_text(json.dumps(child(args)))
        return
    rounds = []
    for r in range(args.rounds):
        order = CHOICES if r % 2 == 0 else CHOICES[::-1]
        rounds.append({choice: run(choice, args) for choice in order})
        print(f"round {r + 1}: " + json.dumps({c: rounds[-1][c]["figures"] for c in CHOICES}), flush=True)
    answers = []
    for rd in rounds:
        a, b = rd["auto"]["tokens"], rd["torch"]["tokens"]
        answers.append({name: sum(x == y for x, y in zip(a[name], b[name])) / max(1, len(b[name])) for name in b})
        for choice in CHOICES:
            if "Paris" not in rd[choice]["france"]:
                raise SystemExit(f"{choice} kernels answered France with {rd[choice]['france']!r}: no speed reported")
    metrics = list(rounds[0]["auto"]["figures"])
    ratios = {m: [rd["auto"]["figures"][m] / rd["torch"]["figures"][m] for rd in rounds] for m in metrics}
    result = {"started": time.strftime("%Y-%m-%d %H:%M:%S"), "machine": machine_line(), "commit": git_head(),
              "args": {k: v for k, v in vars(args).items() if k not in ("child", "json")}, "rounds": rounds,
              "answer_match": answers, "ratios": ratios,
              "median_ratio": {m: statistics.median(v) for m, v in ratios.items()},
              "matmul": matmul_rounds(args.rounds)}
    write_report(args.out, result, markdown(result))


def markdown(res: dict) -> str:
    lines = ["# Native fp32 CPU kernels against the torch reference kernels", "",
             f"Machine: {res['machine']}. Commit {res['commit']}. Command: `.venv/bin/python benchmarks/cpu_kernels.py "
             + " ".join(f"--{k.replace('_', '-')} {v}" for k, v in res["args"].items() if k != "out") + "`.", "",
             "Engine (in-process, fp32, one fresh process per run, alternating): `auto` = native kernels "
             f"({'; '.join(res['rounds'][0]['auto']['kernels'])}), `torch` = F.linear (MKL) and the torch attention "
             "and layer ops. Ratios are auto / torch per round (for ms per token, lower is better).", "",
             "| round | figure | auto | torch | ratio |", "|---|---|---:|---:|---:|"]
    for i, rd in enumerate(res["rounds"], 1):
        for m in rd["auto"]["figures"]:
            lines.append(f"| {i} | {m} | {rd['auto']['figures'][m]:.1f} | {rd['torch']['figures'][m]:.1f} | "
                         f"{rd['auto']['figures'][m] / rd['torch']['figures'][m]:.2f} |")
    lines += ["", "Median of per-round ratios: " + "; ".join(f"{m} **{v:.2f}x**" for m, v in res["median_ratio"].items()),
              "", "Answers before speed: France answered "
              + " / ".join(repr(res["rounds"][0][c]["france"]) for c in CHOICES) + " (auto / torch). Greedy token "
              "match rate auto vs torch per request and round (fp32 sums in another order can flip a near-tie; "
              "1.00 = identical): "
              + "; ".join(", ".join(f"{k} {v:.2f}" for k, v in a.items()) for a in res["answer_match"]) + "."]
    mm = res["matmul"]
    if "rows" in mm:
        lines += ["", f"Matmul alone: 120 distinct fp32 weights (30 layers of SmolLM2-135M, {mm['weight bytes'] / 1e6:.0f} "
                  "MB), outputs checked against float64 first. Time per pass over all of them, ms:", "",
                  "| rows | few-row kernel (per round) | F.linear (per round) | median ratio |", "|---:|---|---|---:|"]
        for rows, row in mm["rows"].items():
            few = ", ".join(f"{r['few']:.1f}" for r in row["runs_ms"])
            ref = ", ".join(f"{r['F.linear']:.1f}" for r in row["runs_ms"])
            lines.append(f"| {rows} | {few} | {ref} | {row['median_ratio']:.2f} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
