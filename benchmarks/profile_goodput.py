"""Where the time goes at the goodput rate, against what this CPU can physically do, measured in the same script.

1. The physical limits, measured first (nothing else running): fp32 and bf16 matmul peak (torch.mm of 1024 x 1024
   matrices, best of several, on 1 and on all cores) and memory read bandwidth (a sum over 512 MiB, all cores).
2. `tokenfleet up` on its defaults; the goodput benchmark's workload (benchmarks/serving/mixed_workload.py: open
   loop, Poisson arrivals, 70 % chat / 20 % shared prefix / 10 % long prompts, streamed, greedy) offered at
   --rate (the goodput benchmark's measured goodput here) for --requests requests, after its untimed warm-up.
   Meanwhile py-spy samples every Python thread of the engine worker (idle samples included), a CoreMonitor
   records every process's and every worker thread's CPU, and the worker's Prometheus counters (busy seconds,
   model FLOPs and bytes of its steps, steps) are read before and after.
3. The report: attainment and latencies of the run; the engine thread's wall time split into linears, attention,
   other layer ops, sampling, scheduling, input building, output processing, the rest of the loop and idle; the
   gateway's, router's and the worker's gRPC threads' CPU; the FLOP/s and bytes/s the steps achieved while busy
   against the measured limits; and the worker's second core: the OpenMP helper thread's CPU against the share
   of engine time spent in the ops it helps with.

    .venv/bin/python benchmarks/profile_goodput.py [--rate 0.075] [--requests 12]
        [--out benchmarks/reports/DATE-cpu-profile-goodput.json]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from goodput import open_loop, summarize_run
from profile_serving import read_raw, shares, worker_pid
from serve_peer import start_tokenfleet
from serving import mixed_workload as workload
from serving.cores import CoreMonitor
from serving.procs import Children
from serving.report import git_head, machine_line, write_report

REPO = Path(__file__).resolve().parent.parent
COUNTERS = ("busy_seconds", "model_flops", "model_bytes", "steps", "prompt_tokens_computed")
PARALLEL = ("model GEMMs", "attention", "layer ops (norm, RoPE, SiLU)")  # the ops whose kernels use every thread


def best_seconds(fn, repeats: int) -> float:  # type: ignore[no-untyped-def]
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def physical_limits() -> dict:
    """Matmul peak (fp32, bf16) on 1 and all cores, and memory read bandwidth on all cores, measured here."""
    import torch

    cores = len(os.sched_getaffinity(0))
    out: dict = {"cores": cores, "matmul_gflops": {}}
    n = 1024
    for dtype in (torch.float32, torch.bfloat16):
        a, b = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)
        for threads in sorted({1, cores}):
            torch.set_num_threads(threads)
            seconds = best_seconds(lambda: torch.mm(a, b), 5)
            out["matmul_gflops"][f"{str(dtype).removeprefix('torch.')} x{threads}"] = 2 * n**3 / seconds / 1e9
    torch.set_num_threads(cores)
    x = torch.ones(128 * 1024 * 1024)  # 512 MiB of fp32
    seconds = best_seconds(lambda: x.sum(), 5)
    out["read_gb_s"] = x.numel() * 4 / seconds / 1e9
    return out


def worker_counters(address: str) -> dict[str, float]:
    """The worker's cumulative counters from its /metrics (Prometheus text)."""
    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.urlopen(f"http://{address}/metrics", timeout=30).read().decode()
    wanted = {f"tokenfleet_worker_{name}_total": name for name in COUNTERS}
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in wanted:
                values[wanted[sample.name]] = values.get(wanted[sample.name], 0.0) + sample.value
    return values


def worker_metrics_address() -> str:
    from tokenfleet.cli.context import cluster_state

    metrics = cluster_state().get("metrics", {})
    workers = [m["address"] for name, m in sorted(metrics.items()) if m["job"] == "worker"]
    if not workers:
        raise RuntimeError(f"no worker metrics endpoint in up's state file: {metrics}")
    return workers[0]


def analyse(result: dict) -> dict:
    run, limits = result["run"], result["limits"]
    wall = run["cpu"]["wall_s"]
    delta = {k: result["counters_after"].get(k, 0.0) - result["counters_before"].get(k, 0.0) for k in COUNTERS}
    busy = delta["busy_seconds"] or float("nan")
    engine = run["threads"].get("engine thread", {})
    engine_shares = dict(shares(engine))
    worker = next((p for p in run["cpu"]["processes"] if p["label"].endswith("/worker")), None)
    threads = sorted((t["cpu_pct"] for t in worker["busy_threads"]), reverse=True) if worker else []
    fp32_peak = limits["matmul_gflops"][f"float32 x{limits['cores']}"]
    return {
        "wall_s": wall, "busy_s": busy, "busy_share": busy / wall,
        "steps": delta["steps"], "prompt_tokens": delta["prompt_tokens_computed"],
        "achieved_gflops_busy": delta["model_flops"] / busy / 1e9,
        "achieved_gb_s_busy": delta["model_bytes"] / busy / 1e9,
        "mfu_fp32_busy": delta["model_flops"] / busy / 1e9 / fp32_peak,
        "mbu_busy": delta["model_bytes"] / busy / 1e9 / limits["read_gb_s"],
        "parallel_share": sum(engine_shares.get(k, 0.0) for k in PARALLEL) / 100,
        "idle_share": engine_shares.get("idle (waiting)", 0.0) / 100,
        "worker_cpu_pct": worker["cpu_pct"] if worker else None,
        # the engine thread and the OpenMP helper are the two busiest (every thread is named "python" in /proc)
        "second_thread_cpu_pct": threads[1] if len(threads) > 1 else 0.0,
    }


def markdown(result: dict) -> str:
    a, lim, run, an = result["args"], result["limits"], result["run"], result["analysis"]
    cores = lim["cores"]
    lines = [f"# Where the time goes at the goodput rate ({result['started']})", "",
             f"`tokenfleet up {' '.join(result['up_args'])}`; the goodput workload (benchmarks/serving/mixed_workload.py) "
             f"offered at {a['rate']} req/s, {a['requests']} requests; py-spy at {a['sample_rate']} Hz on the engine "
             f"worker. Machine: {result['machine']}. git {result['git']}.", "",
             "## This CPU's limits (measured in this script, before the server started)", "",
             "| what | figure |", "|---|---|"]
    lines += [f"| matmul {k} threads (1024^3) | {v:.1f} GFLOP/s |" for k, v in lim["matmul_gflops"].items()]
    lines += [f"| memory read, {lim['cores']} threads (sum over 512 MiB) | {lim['read_gb_s']:.1f} GB/s |", "",
              "## The run", "",
              f"Attainment {run['summary']['attainment']:.2f} (fixed objectives), "
              f"TTFT p50/p90 {run['summary']['ttft_p50_s'] or 0:.2f}/{run['summary']['ttft_p90_s'] or 0:.2f} s, "
              f"TPOT p50/p90 {1000 * (run['summary']['tpot_p50_s'] or 0):.0f}/"
              f"{1000 * (run['summary']['tpot_p90_s'] or 0):.0f} ms, {run['summary']['output_tokens']} output tokens, "
              f"errors {run['summary']['num_errors']}. Wall {an['wall_s']:.0f} s; the engine loop was in steps for "
              f"{an['busy_s']:.1f} s ({100 * an['busy_share']:.0f} %): {an['steps']:.0f} steps, "
              f"{an['prompt_tokens']:.0f} prompt tokens computed.", "",
              "## Engine thread (py-spy: share of its wall time; innermost frame that names a category)", "",
              "| category | share | seconds |", "|---|---|---|"]
    for k, v in shares(run["threads"].get("engine thread", {})):
        lines.append(f"| {k} | {v:.1f} % | {v / 100 * an['wall_s']:.1f} |")
    lines += ["", "## Against the limits (while the engine was in steps)", "",
              f"- FLOP/s: {an['achieved_gflops_busy']:.1f} GFLOP/s = {100 * an['mfu_fp32_busy']:.0f} % of the fp32 "
              f"matmul peak on {lim['cores']} cores (prefill is compute-bound: this is the share that matters for TTFT);",
              f"- bytes/s: {an['achieved_gb_s_busy']:.1f} GB/s = {100 * an['mbu_busy']:.0f} % of the measured read "
              "bandwidth (decode is memory-bound: weights and KV per step);",
              f"- bf16 against fp32 here: matmul peak {lim['matmul_gflops'][f'bfloat16 x{cores}']:.1f} vs "
              f"{lim['matmul_gflops'][f'float32 x{cores}']:.1f} GFLOP/s on {cores} cores (up's CPU default is fp32 "
              "where bf16 matmuls are the slower).",
              "", "## CPU by process and thread", ""]
    procs = ", ".join(f"{p['label']} {p['cpu_pct']:.1f} %" for p in run["cpu"]["processes"] if p["cpu_pct"] >= 0.5)
    lines += [f"100 % = one core. {procs}; outside the benchmark {run['cpu']['outside_cpu_pct']:.0f} %; cores busy "
              f"{'/'.join(f'{c:.0f}' for c in run['cpu']['core_busy_pct'])} %.", ""]
    worker = next((p for p in run["cpu"]["processes"] if p["label"].endswith("/worker")), None)
    if worker is not None:
        lines += ["| worker thread (from /proc) | CPU % of a core |", "|---|---|"]
        lines += [f"| {t['name']} | {t['cpu_pct']:.1f} |" for t in worker["busy_threads"]]
    lines += ["", "## The second core", "",
              f"The engine thread spent {100 * an['parallel_share']:.0f} % of its wall time in ops whose kernels use "
              f"every thread ({', '.join(PARALLEL)}) and {100 * an['idle_share']:.0f} % idle; the rest (sampling, "
              "scheduling, input building, output processing, the loop) runs on the engine thread alone. The second "
              f"busiest worker thread (the OpenMP helper) used {an['second_thread_cpu_pct']:.1f} % of a core: it can be "
              "busy only while the engine thread is in those ops, so the second core idles whenever the engine "
              "thread runs serial Python or waits for work."]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rate", type=float, default=0.075, help="offered req/s (the measured goodput here)")
    parser.add_argument("--requests", type=int, default=12)
    parser.add_argument("--round", type=int, default=0, help="which of the workload's seeded request sets")
    parser.add_argument("--sample-rate", type=int, default=100, help="py-spy samples per second")
    parser.add_argument("--up-arg", action="append", default=[])
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "reports" /
                                             f"{time.strftime('%Y-%m-%d')}-cpu-profile-goodput.json"))
    args = parser.parse_args()
    from tokenfleet.models.gguf_import import DEFAULT_MODEL_NAME, ensure_default_model
    from tokenfleet.models.tokenizer import Tokenizer

    model_dir = str(Path(ensure_default_model()).resolve())
    vocab = Tokenizer(model_dir).vocab_size
    result: dict = {"started": time.strftime("%Y-%m-%d %H:%M:%S"), "args": vars(args), "git": git_head(),
                    "machine": machine_line(), "limits": physical_limits()}
    print(f"limits: {result['limits']}", flush=True)
    children = Children()
    py_spy = str(Path(sys.executable).parent / "py-spy")
    raw = Path(tempfile.mkdtemp(prefix="profile-goodput-")) / "pyspy.txt"
    try:
        up_args = args.up_arg if "--dtype" in args.up_arg else ["--dtype", "auto", *args.up_arg]
        result["up_args"] = up_args
        up, url = start_tokenfleet(children, DEFAULT_MODEL_NAME, up_args)
        worker = worker_pid(up.proc.pid)
        address = worker_metrics_address()
        asyncio.run(open_loop(url, DEFAULT_MODEL_NAME, workload.warmup(vocab), drain_s=600, early_abort=False))
        requests = workload.requests(args.rate, args.requests, vocab, args.round, 0)
        result["counters_before"] = worker_counters(address)
        spy = subprocess.Popen([py_spy, "record", "-p", str(worker), "--rate", str(args.sample_rate), "--idle",
                                "--threads", "--format", "raw", "--nonblocking", "-o", str(raw)],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(1.0)
        with CoreMonitor({"tokenfleet": up.proc.pid, "client": os.getpid()}) as monitor:
            flights, aborted = asyncio.run(open_loop(url, DEFAULT_MODEL_NAME, requests, drain_s=900,
                                                     early_abort=False))
        spy.send_signal(2)  # SIGINT: py-spy writes its file and exits
        spy.wait(timeout=60)
        result["counters_after"] = worker_counters(address)
        summary = summarize_run(flights, aborted, {"fixed": workload.OBJECTIVES})
        summary.pop("records")
        result["run"] = {"summary": summary, "cpu": monitor.report(),
                         "threads": {k: dict(v.most_common()) for k, v in read_raw(raw).items()}}
    finally:
        children.stop_all()
    result["analysis"] = analyse(result)
    write_report(args.out, result, markdown(result))


if __name__ == "__main__":
    main()
