"""Prefill/decode interference: running streams' inter-token latency while long prompts arrive.

Three fleets on the same two cores, each behind the router and gateway:
- colocated unchunked: one worker (--role both --threads 2, pinned to cores 0-1) whose step budget
  (--max-num-batched-tokens 4096) takes a whole 2,000-token prompt in one step;
- colocated chunked: the same worker with --max-num-batched-tokens --chunk (prefill in chunks
  interleaved with the decodes);
- disaggregated: a prefill worker (--role prefill --threads 1) pinned to core 0 and a decode
  worker (--role decode --threads 1) pinned to core 1; the router sends the long prompts' prefill
  to the prefill worker (KV pulled over gRPC) and the streams' short prompts stay local.
etcd, router, gateway and this load generator are not pinned (they need little CPU).

Load: --streams streams (short prompts, long outputs) start first; after --warmup s, --long
long prompts (--long-len random tokens, 2 output tokens) arrive every --period s. Reported: ITL
(gap between consecutive streamed tokens of the running streams) p50/p99 over the window from
the first long prompt's arrival to the last one's completion, and the long prompts' TTFT.
The bar: disaggregated ITL p99 >= 3x lower than colocated unchunked.

    .venv/bin/python benchmarks/interference.py [--streams 4] [--long 6] [--period 4]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from pathlib import Path

import numpy as np
from serving.load import httpx
from serving.procs import Children, wait_completion

REPO = Path(__file__).resolve().parent.parent
CONFIGS = ("colocated-unchunked", "colocated-chunked", "disaggregated")


def start_fleet(children: Children, config: str, args: argparse.Namespace, model_dir: str, model: str) -> str:

    children.start_etcd()
    etcd = children.etcd.endpoint
    common = ["tokenfleet.services.decode", "--model", model_dir, "--model-name", model, "--etcd", etcd,
              "--dtype", args.dtype, "--num-blocks", "1024"]
    if config == "disaggregated":
        children.spawn_service("prefill", *common, "--role", "prefill", "--threads", "1", "--replica-id", "p0",
                               threads=1, cores="0")
        children.spawn_service("decode", *common, "--role", "decode", "--threads", "1", "--replica-id", "d0",
                               threads=1, cores="1")
    else:
        budget = "4096" if config == "colocated-unchunked" else str(args.chunk)
        children.spawn_service("worker", *common, "--role", "both", "--threads", "2", "--replica-id", "w0",
                               "--max-num-batched-tokens", budget, threads=2, cores="0-1")
    router = children.spawn_service("router", "tokenfleet.services.router", "--etcd", etcd)
    gateway = children.spawn_service("gateway", "tokenfleet.services.gateway", "--router", router.address,
                                     "--model", f"{model}={model_dir}")
    url = f"http://{gateway.address}"
    wait_completion(url, model, 300, lambda: all(c.proc.poll() is None for c in children.children))
    return url


async def stream(client, model: str, prompt: list[int], max_tokens: int, times: list[float],
                 stop: asyncio.Event | None = None) -> float:
    """Streams a completion, appending each token chunk's arrival time; returns the send time."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True,
            "stream": True}
    sent = time.perf_counter()
    async with client.stream("POST", "/v1/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if line.startswith("data:") and line[5:].strip() != "[DONE]":
                event = json.loads(line[5:])
                if event.get("choices") and event["choices"][0].get("text"):
                    times.append(time.perf_counter())
            if stop is not None and stop.is_set():
                break
    return sent


async def run(url: str, model: str, args: argparse.Namespace, vocab: int) -> dict:
    rng = random.Random(args.seed)
    short = [[rng.randrange(200, vocab) for _ in range(32)] for _ in range(args.streams)]
    long = [[rng.randrange(200, vocab) for _ in range(args.long_len)] for _ in range(args.long)]
    stop = asyncio.Event()
    limits = httpx.Limits(max_connections=args.streams + args.long + 4)
    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(900.0), limits=limits) as client:
        stream_times: list[list[float]] = [[] for _ in short]
        streams = [asyncio.create_task(stream(client, model, p, 4000, t, stop)) for p, t in zip(short, stream_times)]
        await asyncio.sleep(args.warmup)

        async def one_long(i: int) -> tuple[float, float]:
            await asyncio.sleep(i * args.period)
            times: list[float] = []
            sent = await stream(client, model, long[i], 2, times)
            return sent, times[0] - sent

        longs = await asyncio.gather(*(one_long(i) for i in range(args.long)))
        window = (min(s for s, _ in longs), time.perf_counter())
        stop.set()
        await asyncio.gather(*streams, return_exceptions=True)
    gaps = [b - a for times in stream_times for a, b in zip(times, times[1:]) if window[0] <= b <= window[1]]
    ttft = [t for _, t in longs]
    return {
        "itl_ms": {"p50": 1000 * float(np.percentile(gaps, 50)), "p99": 1000 * float(np.percentile(gaps, 99)),
                   "max": 1000 * max(gaps), "samples": len(gaps)},
        "long_ttft_ms": {"p50": 1000 * float(np.percentile(ttft, 50)), "max": 1000 * max(ttft)},
        "window_s": window[1] - window[0],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=CONFIGS)
    parser.add_argument("--streams", type=int, default=4)
    parser.add_argument("--long", type=int, default=6)
    parser.add_argument("--long-len", type=int, default=2000)
    parser.add_argument("--period", type=float, default=6.0, help="seconds between long prompts")
    parser.add_argument("--warmup", type=float, default=3.0)
    parser.add_argument("--chunk", type=int, default=256, help="step token budget of the chunked run")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--seed", type=int, default=9)
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "reports" / "interference.json"))
    args = parser.parse_args()

    from tokenfleet.models.gguf_import import DEFAULT_MODEL_NAME, ensure_default_model

    model_dir = str(Path(ensure_default_model()).resolve())
    vocab = json.loads((Path(model_dir) / "config.json").read_text())["vocab_size"]
    result: dict = {"started": time.strftime("%Y-%m-%d %H:%M:%S"), "args": vars(args), "runs": {}}
    children = Children()
    try:
        for config in args.configs:
            print(f"{config}: starting ...", flush=True)
            url = start_fleet(children, config, args, model_dir, DEFAULT_MODEL_NAME)
            result["runs"][config] = asyncio.run(run(url, DEFAULT_MODEL_NAME, args, vocab))
            print(config, json.dumps(result["runs"][config]), flush=True)
            children.stop_all()
    finally:
        children.stop_all()
        children.remove_logs()
    runs = result["runs"]
    if "disaggregated" in runs and "colocated-unchunked" in runs:
        ratio = runs["colocated-unchunked"]["itl_ms"]["p99"] / runs["disaggregated"]["itl_ms"]["p99"]
        result["bar"] = {"itl_p99_ratio": ratio, "ok": ratio >= 3.0}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    lines = [f"# Interference benchmark\n\n{result['started']}; {args.streams} streams, {args.long} x "
             f"{args.long_len}-token prompts every {args.period} s; 2 cores (see the docstring for pinning).\n",
             "| config | ITL p50 ms | ITL p99 ms | ITL max ms | long-prompt TTFT p50 ms | max |", "|---|---|---|---|---|---|"]
    for config, r in runs.items():
        lines.append(f"| {config} | {r['itl_ms']['p50']:.0f} | {r['itl_ms']['p99']:.0f} | {r['itl_ms']['max']:.0f} | "
                     f"{r['long_ttft_ms']['p50']:.0f} | {r['long_ttft_ms']['max']:.0f} |")
    if "bar" in result:
        lines.append(f"\nBar: colocated-unchunked / disaggregated ITL p99 = {result['bar']['itl_p99_ratio']:.1f}x "
                     f"(>= 3x: {result['bar']['ok']})")
    report = "\n".join(lines) + "\n"
    out.with_suffix(".md").write_text(report)
    print(report)


if __name__ == "__main__":
    main()
