"""The batch tier against interactive traffic: does a 500-line batch leave interactive TTFT alone?

One `tokenfleet up` cluster (one worker, one torch thread: the other core runs etcd, router, gateway and this
load generator). First its capacity: the completed requests per second of a closed loop at --saturation streams
of the interactive shape (--input-len random prompt tokens, --output-len output tokens). Then runs alternate:

- alone: an open-loop Poisson load of interactive streams at --load x that capacity, for --duration seconds;
- batch: the same load (fresh prompts, same rate) with a --batch-lines chat batch submitted through the official
  `openai` client just before it. After the window the batch is waited for and checked: every line has exactly
  one output line and one ledger charge.

Runs pair up (alone, then batch, in each of --runs rounds); the figure is the median over rounds of the
pair ratio batch / alone of interactive TTFT p99 (the bar: <= 1.2). The ratio of the two modes' medians is
reported beside it but judges nothing. Every run is reported, with how many batch lines had finished when
the window closed (the batch must still be running at the end of the window for the window to measure
anything).

Last, the durability check under load from the batch alone: a --batch-lines batch, the gateway killed with
SIGKILL once a fifth of it is done, `up` restarts it, the batch completes: lines and charges counted again.

    .venv/bin/python benchmarks/batch_interference.py --runs 3      # ~25 min here
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import os
import random
import signal
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import openai
import psutil
from serving.load import RequestResult, fresh_prompts, http_load, httpx, stream_completion
from serving.report import git_head, write_report

REPORTS = Path(__file__).parent / "reports"
MODEL = "smollm2-135m-instruct"
CHAT = "/v1/chat/completions"
TOPICS = ("the sea", "a lighthouse", "autumn rain", "a train at night", "bread", "snow on a roof", "a violin",
          "an old map", "the moon", "a garden")


def start_cluster(args: argparse.Namespace, cache: Path) -> tuple[subprocess.Popen, str]:
    env = {**os.environ, "TOKENFLEET_CACHE_DIR": str(cache), "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, "-m", "tokenfleet.cli", "up", "--workers", "1", "--threads", "1", "--port", "0", "--dtype", "bfloat16",
           "--batch-slots", str(args.batch_slots), "--batch-concurrency", str(args.batch_concurrency)]
    up = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=open(cache / "up.stderr", "w"), text=True, env=env)
    assert up.stdout is not None
    while True:
        line = up.stdout.readline()
        if not line:
            raise RuntimeError(f"tokenfleet up exited: {(cache / 'up.stderr').read_text()[-2000:]}")
        if line.startswith("gateway:"):
            gateway = line.split()[1]
            break
    threading.Thread(target=lambda: [None for _ in up.stdout], daemon=True).start()  # type: ignore[union-attr]
    return up, gateway


async def open_loop(base_url: str, prompts: list[list[int]], rate: float, duration: float, output_len: int,
                    seed: int) -> list[tuple[float, RequestResult]]:
    """Poisson arrivals at ``rate`` for ``duration`` s, each a streamed completion; (sent at, result) pairs."""
    rng = random.Random(seed)
    limits = httpx.Limits(max_connections=512, max_keepalive_connections=64)
    out: list[tuple[float, RequestResult]] = []
    async with httpx.AsyncClient(base_url=base_url, timeout=httpx.Timeout(600.0), limits=limits) as client:

        async def one(prompt: list[int], at: float) -> None:
            out.append((at, await stream_completion(client, MODEL, prompt, output_len)))

        tasks, t0, at, i = [], time.perf_counter(), 0.0, 0
        while True:
            at += rng.expovariate(rate)
            if at >= duration:
                break
            await asyncio.sleep(max(0.0, t0 + at - time.perf_counter()))
            tasks.append(asyncio.create_task(one(prompts[i % len(prompts)], at)))
            i += 1
        await asyncio.gather(*tasks)
    return out


def batch_lines(n: int, tag: str, max_tokens: int) -> bytes:
    rng = random.Random(tag)
    return "".join(json.dumps({"custom_id": f"{tag}-{i}", "method": "POST", "url": CHAT, "body": {
        "model": MODEL, "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0,
        "messages": [{"role": "user", "content": f"Note {tag}-{i}-{rng.randrange(10**6)}: write two lines about "
                      f"{TOPICS[i % len(TOPICS)]}."}]}}) + "\n" for i in range(n)).encode()


def submit(client: openai.OpenAI, n: int, tag: str, max_tokens: int) -> str:
    file_id = client.files.create(file=(f"{tag}.jsonl", io.BytesIO(batch_lines(n, tag, max_tokens))),
                                  purpose="batch").id
    return client.batches.create(input_file_id=file_id, endpoint=CHAT, completion_window="24h").id


def wait_batch(client: openai.OpenAI, batch_id: str, timeout: float = 1800) -> openai.types.Batch:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            batch = client.batches.retrieve(batch_id)
            if batch.status in ("completed", "failed", "expired", "cancelled"):
                return batch
        except openai.APIConnectionError:  # the gateway restarting
            pass
        time.sleep(1.0)
    raise TimeoutError(f"batch {batch_id} not finished in {timeout}s")


def check_batch(client: openai.OpenAI, batch: openai.types.Batch, n: int, ledger: Path) -> dict:
    """Every line: one output line, one ledger charge (by the line's id)."""
    output = [json.loads(x) for x in client.files.content(batch.output_file_id).text.splitlines()] \
        if batch.output_file_id else []
    ids = [o["id"] for o in output]
    prefix = f"batch_req_{batch.id.removeprefix('batch_')}_"
    with sqlite3.connect(f"file:{ledger}?mode=ro", uri=True) as conn:
        charged = [r[0] for r in conn.execute("SELECT request_id FROM usage WHERE request_id LIKE ? AND status = 'ok'",
                                              (prefix + "%",))]
    return {"status": batch.status, "lines": n, "output_lines": len(output), "distinct_output_ids": len(set(ids)),
            "ok_responses": sum(1 for o in output if (o.get("response") or {}).get("status_code") == 200),
            "charges": len(charged), "distinct_charges": len(set(charged)),
            "exactly_once": len(output) == len(set(ids)) == n and len(charged) == len(set(charged)) == n
            and set(charged) == set(ids)}


def gateway_pid(up: subprocess.Popen) -> int:
    for child in psutil.Process(up.pid).children(recursive=True):
        if "tokenfleet.services.gateway" in " ".join(child.cmdline()):
            return child.pid
    raise RuntimeError("no gateway process")


def p99(results: list[tuple[float, RequestResult]]) -> float | None:
    ttft = [r.ttft_s for _, r in results if r.error is None and r.ttft_s is not None]
    return float(np.percentile(ttft, 99)) if ttft else None


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--duration", type=float, default=90.0, help="seconds of interactive load per run")
    p.add_argument("--load", type=float, default=0.5, help="interactive rate as a share of the measured capacity")
    p.add_argument("--saturation", type=int, default=8, help="closed-loop streams of the capacity measurement")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--batch-lines", type=int, default=500)
    p.add_argument("--batch-max-tokens", type=int, default=16)
    p.add_argument("--batch-slots", type=int, default=4)
    p.add_argument("--batch-concurrency", type=int, default=4)
    p.add_argument("--out", default=str(REPORTS / f"{time.strftime('%Y-%m-%d')}-cpu-batch-interference.json"))
    args = p.parse_args()

    cache = Path(tempfile.mkdtemp(prefix="tf-batch-bench-"))
    up, gateway = start_cluster(args, cache)
    client = openai.OpenAI(base_url=gateway, api_key="unused", max_retries=0, timeout=120)
    base = gateway.removesuffix("/v1")
    vocab = 49152
    try:
        asyncio.run(http_load(base, MODEL, fresh_prompts(8, args.input_len, vocab, 1), 4, args.output_len))  # warm
        results, wall = asyncio.run(http_load(base, MODEL, fresh_prompts(6 * args.saturation, args.input_len, vocab, 2),
                                              args.saturation, args.output_len))
        capacity = sum(1 for r in results if r.error is None) / wall
        rate = args.load * capacity
        print(f"capacity {capacity:.2f} requests/s at {args.saturation} streams; interactive load {rate:.2f}/s",
              flush=True)
        runs = []
        for k in range(args.runs):
            for mode in (("alone", "batch") if k % 2 == 0 else ("batch", "alone")):
                seed = 100 + 2 * k + (mode == "batch")
                prompts = fresh_prompts(int(rate * args.duration * 2) + 8, args.input_len, vocab, seed)
                batch_id = submit(client, args.batch_lines, f"run{k}", args.batch_max_tokens) if mode == "batch" else None
                started = time.monotonic()
                done = asyncio.run(open_loop(base, prompts, rate, args.duration, args.output_len, seed))
                entry: dict = {"run": k, "mode": mode, "requests": len(done),
                               "errors": sum(1 for _, r in done if r.error is not None),
                               "ttft_p50_s": float(np.median([r.ttft_s for _, r in done if r.ttft_s is not None])),
                               "ttft_p99_s": p99(done), "window_s": round(time.monotonic() - started, 1)}
                if batch_id is not None:
                    entry["batch_lines_done_at_window_end"] = client.batches.retrieve(batch_id).request_counts.completed
                    batch = wait_batch(client, batch_id)
                    entry["batch_seconds"] = round(time.monotonic() - started, 1)
                    entry["batch_check"] = check_batch(client, batch, args.batch_lines, cache / "ledger.sqlite3")
                runs.append(entry)
                print(json.dumps(entry), flush=True)

        # durability: the gateway killed mid-batch
        batch_id = submit(client, args.batch_lines, "kill", args.batch_max_tokens)
        while client.batches.retrieve(batch_id).request_counts.completed < args.batch_lines // 5:
            time.sleep(0.5)
        killed_at = client.batches.retrieve(batch_id).request_counts.completed
        os.kill(gateway_pid(up), signal.SIGKILL)
        kill = {"completed_when_killed": killed_at,
                **check_batch(client, wait_batch(client, batch_id), args.batch_lines, cache / "ledger.sqlite3")}
        print(json.dumps({"kill": kill}), flush=True)
    finally:
        up.terminate()
        up.wait(timeout=120)

    alone = [r["ttft_p99_s"] for r in runs if r["mode"] == "alone"]
    batch = [r["ttft_p99_s"] for r in runs if r["mode"] == "batch"]
    pair_ratios = [b / a for a, b in zip(alone, batch, strict=True)]
    ratio = statistics.median(pair_ratios)
    out = {"benchmark": "batch_interference", "commit": git_head(), "args": vars(args), "capacity_req_s": capacity,
           "interactive_rate": rate, "runs": runs, "kill": kill, "ttft_p99_median_alone_s": statistics.median(alone),
           "ttft_p99_median_batch_s": statistics.median(batch), "ratio": ratio, "pair_ratios": pair_ratios,
           "ratio_of_medians": statistics.median(batch) / statistics.median(alone)}
    write_report(args.out, out, report(out))


def report(out: dict) -> str:
    a = out["args"]
    lines = [f"# Batch tier vs interactive TTFT (CPU, commit {out['commit']})", "",
             f"One `tokenfleet up` worker (1 torch thread), router `--batch-slots {a['batch_slots']}`, gateway "
             f"`--batch-concurrency {a['batch_concurrency']}`. Capacity: {out['capacity_req_s']:.2f} requests/s "
             f"(closed loop, {a['saturation']} streams of {a['input_len']} prompt / {a['output_len']} output tokens). "
             f"Interactive load: open-loop Poisson at {a['load']:.0%} of it = {out['interactive_rate']:.2f} "
             f"requests/s for {a['duration']:.0f} s per run. Batch runs add {a['batch_lines']} chat lines "
             f"({a['batch_max_tokens']} output tokens each) submitted with the `openai` client just before the load.",
             "", "**Interactive TTFT p99 with the batch / alone, round by round: "
             + ", ".join(f"{r:.2f}" for r in out["pair_ratios"]) + f"; median {out['ratio']:.2f}x** (bar: <= 1.2x, "
             f"{'met' if out['ratio'] <= 1.2 else 'NOT met'}). Medians of the modes, for reference: "
             f"{out['ttft_p99_median_batch_s'] * 1000:.0f} ms with the batch, {out['ttft_p99_median_alone_s'] * 1000:.0f} "
             "ms alone.", "",
             "| run | mode | requests | errors | TTFT p50 | TTFT p99 | batch lines done at window end | batch done "
             "after | outputs / charges (exactly once) |", "|---|---|---|---|---|---|---|---|---|"]
    for r in out["runs"]:
        check = r.get("batch_check")
        lines.append(f"| {r['run']} | {r['mode']} | {r['requests']} | {r['errors']} | {r['ttft_p50_s'] * 1000:.0f} ms | "
                     f"{r['ttft_p99_s'] * 1000:.0f} ms | {r.get('batch_lines_done_at_window_end', '-')} | "
                     + (f"{r['batch_seconds']:.0f} s | {check['output_lines']} / {check['charges']} "
                        f"({'yes' if check['exactly_once'] else 'NO'})" if check else "- | -") + " |")
    k = out["kill"]
    lines += ["", f"Gateway killed with SIGKILL mid-batch ({k['completed_when_killed']} of {k['lines']} lines done; "
              f"`up` restarted it): status {k['status']}, {k['output_lines']} output lines ({k['distinct_output_ids']} "
              f"distinct), {k['charges']} ledger charges ({k['distinct_charges']} distinct): exactly once "
              f"{'holds' if k['exactly_once'] else 'DOES NOT hold'}.", "",
              f"Command: `.venv/bin/python benchmarks/batch_interference.py --runs {a['runs']} --duration "
              f"{a['duration']:g}`."]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
