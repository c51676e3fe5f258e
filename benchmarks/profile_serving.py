"""Where a step's time goes under `tokenfleet up` defaults: py-spy on the worker while load runs.

Starts `tokenfleet up` (its defaults), then for each --concurrency runs `vllm bench serve` (openai-chat,
random 256/64, --num-prompts, --ignore-eos) through the gateway while py-spy samples every Python
thread of the engine worker (idle samples included) and a CoreMonitor records each process's CPU.

The engine thread's samples are split by the innermost frame that names a category: model GEMMs
(linear layers and the LM head), attention, other layer ops (norms, RoPE, SiLU, embedding), sampler,
scheduler and block manager, output processing / detokenization, the rest of the engine loop, and
idle (waiting for work). The worker's other threads (asyncio event loop: gRPC, streaming) are
reported by CPU time per thread (from /proc). OpenMP helper threads are not Python threads: their
time shows there too.

    .venv/bin/python benchmarks/profile_serving.py --vllm-python VLLM_VENV/bin/python [--concurrency 1 8 32]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import tempfile
import time
from collections import Counter
from pathlib import Path

from serve_peer import bench, start_tokenfleet
from serving.cores import CoreMonitor
from serving.procs import Children, worker_pids
from serving.report import write_report

REPO = Path(__file__).resolve().parent.parent

# (category, predicate on one frame "function (path:line)"); the innermost matching frame decides
CATEGORIES = [
    ("model GEMMs", lambda f: "linear.py" in f or "_linear_pointwise" in f),
    ("attention", lambda f: "attention.py" in f),
    ("layer ops (norm, RoPE, SiLU)", lambda f: "layer_ops.py" in f or "forward (tokenfleet/models/llama.py" in f),
    ("sampler", lambda f: "sampler.py" in f or "guided.py" in f),
    ("scheduler + block manager", lambda f: any(m in f for m in ("scheduler.py", "block_manager.py", "fair_queue.py",
                                                                  "block_hash.py"))),
    ("input building (runner)", lambda f: "runner.py" in f),
    ("output processing / detokenization", lambda f: any(m in f for m in ("output.py", "detokenizer.py", "tokenizer"))),
    ("engine loop (other)", lambda f: "engine/core.py" in f or "async_engine.py" in f),
    ("gRPC / asyncio", lambda f: any(m in f for m in ("grpc", "asyncio", "services/", "uvloop"))),
]


def classify(frames: list[str]) -> str:
    for frame in reversed(frames):  # innermost first
        for name, match in CATEGORIES:
            if match(frame):
                return name
    return "other"


def worker_pid(up_pid: int) -> int:
    pids = worker_pids(up_pid)
    if not pids:
        raise RuntimeError("no worker process under `tokenfleet up`")
    return pids[0]


def read_raw(path: Path) -> dict[str, Counter]:
    """py-spy --format raw --threads --idle: 'thread (0x..) ; frame ; ... count' -> per thread, category -> samples."""
    threads: dict[str, Counter] = {}
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        frames = stack.split(";")
        thread, frames = frames[0], frames[1:]
        # Waiting: the engine thread blocked on its command queue (a C queue: no frame below), other
        # threads in select/poll/waits.
        idle = not frames or any(m in frames[-1] for m in ("wait (threading.py", "select (", "_worker (concurrent",
                                                           "get (queue.py", "poll (", "sleep", "epoll",
                                                           "_drain_commands (", "_poll_wrapper"))
        category = "idle (waiting)" if idle else classify(frames)
        is_engine = any("async_engine.py" in f or "engine/core.py" in f for f in frames)
        label = "engine thread" if is_engine or "tokenfleet-engine" in thread else "other threads"
        threads.setdefault(label, Counter())[category] += int(count)
    return threads


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vllm-python", default=os.environ.get("VLLM_PYTHON"))
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--seed", type=int, default=int(time.time()) % 1_000_000)
    parser.add_argument("--up-arg", action="append", default=[])
    parser.add_argument("--rate", type=int, default=100, help="py-spy samples per second (it costs CPU: ~5 %% at 100)")
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "reports" / "profile-serving.json"))
    args = parser.parse_args()
    if not args.vllm_python:
        parser.error("--vllm-python (or $VLLM_PYTHON): its `vllm bench serve` is the client")
    from tokenfleet.models.gguf_import import DEFAULT_MODEL_NAME, ensure_default_model

    model_dir = str(Path(ensure_default_model()).resolve())
    children = Children()
    out_dir = Path(tempfile.mkdtemp(prefix="profile-serving-"))
    py_spy = str(Path(os.sys.executable).parent / "py-spy")
    result: dict = {"started": time.strftime("%Y-%m-%d %H:%M:%S"), "args": vars(args), "runs": []}
    try:
        # `up`'s own default dtype unless --up-arg names one (start_tokenfleet alone would pin bf16 for peers)
        up_args = args.up_arg if "--dtype" in args.up_arg else ["--dtype", "auto", *args.up_arg]
        result["up_args"] = up_args
        up, url = start_tokenfleet(children, DEFAULT_MODEL_NAME, up_args)
        worker = worker_pid(up.proc.pid)
        bench(args, url, DEFAULT_MODEL_NAME, model_dir, 8, 16, args.seed + 999, out_dir)  # warm-up
        for c in args.concurrency:
            raw = out_dir / f"pyspy-{c}.txt"
            spy = subprocess.Popen([py_spy, "record", "-p", str(worker), "--rate", str(args.rate), "--idle", "--threads",
                                    "--format", "raw", "--nonblocking", "-o", str(raw)],
                                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            time.sleep(1.0)
            with CoreMonitor({"tokenfleet": up.proc.pid, "client": os.getpid()}) as monitor:
                summary = bench(args, url, DEFAULT_MODEL_NAME, model_dir, c, args.num_prompts, args.seed + c, out_dir)
            spy.send_signal(2)  # SIGINT: py-spy writes its file and exits
            spy.wait(timeout=60)
            threads = read_raw(raw)
            row = {"concurrency": c, "out_tok_s": summary["output_throughput"],
                   "tpot_p50_ms": summary["median_tpot_ms"], "ttft_p50_ms": summary["median_ttft_ms"],
                   "threads": {k: dict(v.most_common()) for k, v in threads.items()}, "cpu": monitor.report()}
            result["runs"].append(row)
            print(summary_line(row), flush=True)
    finally:
        children.stop_all()
    write_report(args.out, result, markdown(result))


def shares(counter: dict[str, int]) -> list[tuple[str, float]]:
    total = sum(counter.values()) or 1
    return [(k, 100 * v / total) for k, v in sorted(counter.items(), key=lambda kv: -kv[1])]


def summary_line(row: dict) -> str:
    engine = ", ".join(f"{k} {v:.0f}%" for k, v in shares(row["threads"].get("engine thread", {}))[:6])
    return f"c={row['concurrency']}: {row['out_tok_s']:.1f} tok/s; engine thread: {engine}"


def markdown(result: dict) -> str:
    lines = [f"# Profile of `tokenfleet up` (defaults) under load ({result['started']})", "",
             f"py-spy ({result['args']['rate']} Hz, idle samples included) on the engine worker while "
             "`vllm bench serve` (openai-chat, random "
             f"{result['args']['input_len']}/{result['args']['output_len']}, {result['args']['num_prompts']} prompts, "
             "--ignore-eos) runs through the gateway. Shares of the engine thread's samples (its wall time, including "
             "the client's own start-up of a few seconds, which shows as idle): the innermost frame that names a "
             "category decides. OpenMP helper threads are not sampled (their work shows "
             "as worker CPU above 100 %).", ""]
    for row in result["runs"]:
        lines += [f"## c={row['concurrency']}: {row['out_tok_s']:.1f} out tok/s, TTFT p50 {row['ttft_p50_ms']:.0f} ms, "
                  f"TPOT p50 {row['tpot_p50_ms']:.1f} ms", "", "| engine thread | share |", "|---|---|"]
        lines += [f"| {k} | {v:.1f} % |" for k, v in shares(row["threads"].get("engine thread", {}))]
        worker = next((p for p in row["cpu"]["processes"] if p["label"].endswith("/worker")), None)
        if worker is not None:  # CPU time per thread: the event loop and gRPC threads' share, the OpenMP helper's
            lines += ["", "| worker thread (from /proc) | CPU % of a core |", "|---|---|"]
            lines += [f"| {t['name']} | {t['cpu_pct']:.1f} |" for t in worker["busy_threads"]]
        procs = ", ".join(f"{p['label']} {p['cpu_pct']:.0f} %" for p in row["cpu"]["processes"] if p["cpu_pct"] >= 0.5)
        lines += ["", f"CPU by process (100 % = one core): {procs}; outside the benchmark "
                      f"{row['cpu']['outside_cpu_pct']:.0f} %; cores busy "
                      f"{'/'.join(f'{c:.0f}' for c in row['cpu']['core_busy_pct'])} %.", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
