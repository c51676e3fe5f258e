"""Prefix-aware routing vs round-robin vs least-loaded on one multi-tenant workload.

Fleet (started afresh for each policy, so every policy begins with cold caches): etcd, 3
colocated workers (`--role both --threads 1`, each with a KV budget of --num-blocks blocks that
holds only about 6 of the 16 tenants' system prompts), the router with `--policy P`, the gateway.

Load (the same for every policy): --tenants tenants, each with its own --system-len-token system
prompt (random token ids from the tenant's seed); --num-requests requests, each from a random
tenant with a fresh short user turn (--turn-len random tokens), arriving as a Poisson process at
--rate requests/s; /v1/completions, stream, temperature 0, ignore_eos, max_tokens --output-len.

Per policy: hit rate = cached prompt tokens / prompt tokens (from each response's
usage.prompt_tokens_details.cached_tokens) over all requests after each tenant's first; TTFT
p50/p99 (request sent -> first token chunk); output tok/s (completion tokens / wall time of the
run); how requests spread over the workers (x-tokenfleet-replica). The bar: prefix-aware
hit rate >= 85 % and TTFT p50 >= 2x better than round-robin.

    .venv/bin/python benchmarks/prefix_routing.py [--num-requests 200] [--rate 0.6]
        [--policies prefix-aware round-robin least-loaded] [--out benchmarks/reports/prefix-routing.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import sys
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from serving.load import httpx
from serving.procs import Children, wait_completion
from serving.report import git_head

REPO = Path(__file__).resolve().parent.parent


@dataclass
class Result:
    tenant: int
    first_of_tenant: bool
    ttft_s: float | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    replica: str = ""
    error: str | None = None


def workload(args: argparse.Namespace, vocab: int) -> tuple[list[float], list[int], list[list[int]]]:
    """(arrival offsets, tenant of each request, prompts): identical for every policy."""
    rng = random.Random(args.seed)
    systems = [[random.Random(args.seed * 1000 + t).randrange(200, vocab) for _ in range(args.system_len)]
               for t in range(args.tenants)]
    arrivals, tenants, prompts, t = [], [], [], 0.0
    for _ in range(args.num_requests):
        t += rng.expovariate(args.rate)
        tenant = rng.randrange(args.tenants)
        arrivals.append(t)
        tenants.append(tenant)
        prompts.append(systems[tenant] + [rng.randrange(200, vocab) for _ in range(args.turn_len)])
    return arrivals, tenants, prompts


async def run_load(url: str, model: str, args: argparse.Namespace, arrivals: list[float], tenants: list[int],
                   prompts: list[list[int]]) -> tuple[list[Result], float]:
    seen: set[int] = set()
    firsts = []
    for tenant in tenants:
        firsts.append(tenant not in seen)
        seen.add(tenant)
    limits = httpx.Limits(max_connections=len(prompts) + 4, max_keepalive_connections=64)
    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(1800.0), limits=limits) as client:
        start = time.perf_counter()

        async def one(i: int) -> Result:
            result = Result(tenants[i], firsts[i])
            await asyncio.sleep(max(0.0, start + arrivals[i] - time.perf_counter()))
            body = {"model": model, "prompt": prompts[i], "max_tokens": args.output_len, "temperature": 0.0,
                    "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
            sent = time.perf_counter()
            try:
                async with client.stream("POST", "/v1/completions", json=body) as response:
                    result.replica = response.headers.get("x-tokenfleet-replica", "")
                    if response.status_code != 200:
                        result.error = f"HTTP {response.status_code}"
                        return result
                    async for line in response.aiter_lines():
                        if not line.startswith("data:") or line[5:].strip() == "[DONE]":
                            continue
                        event = json.loads(line[5:])
                        if event.get("choices") and result.ttft_s is None and event["choices"][0].get("text"):
                            result.ttft_s = time.perf_counter() - sent
                        if event.get("usage"):
                            usage = event["usage"]
                            result.prompt_tokens = usage["prompt_tokens"]
                            result.completion_tokens = usage["completion_tokens"]
                            result.cached_tokens = usage["prompt_tokens_details"]["cached_tokens"]
            except (httpx.HTTPError, json.JSONDecodeError, KeyError) as e:
                result.error = f"{type(e).__name__}: {e}"[:200]
            return result

        results = await asyncio.gather(*(one(i) for i in range(len(prompts))))
        return list(results), time.perf_counter() - start


def summarize(policy: str, results: list[Result], wall: float) -> dict:
    ok = [r for r in results if r.error is None]
    later = [r for r in ok if not r.first_of_tenant]
    ttft = [r.ttft_s * 1000 for r in ok if r.ttft_s is not None]

    def pct(q: float) -> float | None:
        return float(np.percentile(ttft, q)) if ttft else None

    prompt = sum(r.prompt_tokens for r in later)
    return {
        "policy": policy,
        "requests": len(results),
        "errors": dict(Counter(r.error for r in results if r.error)),
        "hit_rate": sum(r.cached_tokens for r in later) / prompt if prompt else None,
        "ttft_ms": {"p50": pct(50), "p99": pct(99), "mean": float(np.mean(ttft)) if ttft else None},
        "out_tok_s": sum(r.completion_tokens for r in ok) / wall if wall else 0.0,
        "wall_s": wall,
        "spread": dict(Counter(r.replica for r in ok)),
        "tenants_per_replica": {rep: len({r.tenant for r in ok if r.replica == rep})
                                for rep in {r.replica for r in ok}},
    }


def start_fleet(children: Children, args: argparse.Namespace, model_dir: str, model: str, policy: str) -> str:

    children.start_etcd()
    etcd = children.etcd.endpoint
    for i in range(args.workers):
        children.spawn_service(f"worker-{i}", "tokenfleet.services.decode", "--model", model_dir, "--model-name", model,
                               "--etcd", etcd, "--role", "both", "--threads", "1", "--replica-id", f"w{i}",
                               "--num-blocks", str(args.num_blocks), "--dtype", args.dtype, threads=1)
    router = children.spawn_service("router", "tokenfleet.services.router", "--etcd", etcd, "--policy", policy)
    gateway = children.spawn_service("gateway", "tokenfleet.services.gateway", "--router", router.address,
                                     "--model", f"{model}={model_dir}")
    url = f"http://{gateway.address}"
    wait_completion(url, model, 300, lambda: all(c.proc.poll() is None for c in children.children))
    return url


def markdown(result: dict) -> str:
    a = result["args"]
    lines = [
        "# Prefix-aware routing benchmark",
        "",
        f"{result['started']}, git {result['git']}, {result['machine']}",
        "",
        f"{a['workers']} colocated workers (--threads 1, --num-blocks {a['num_blocks']}, {a['dtype']}), router, gateway "
        f"on one {os.cpu_count()}-core machine. {a['tenants']} tenants x {a['system_len']}-token system prompts, "
        f"{a['num_requests']} requests (+{a['turn_len']}-token user turns, {a['output_len']} output tokens), Poisson "
        f"at {a['rate']}/s.",
        "",
        "| policy | hit rate | TTFT p50 ms | TTFT p99 ms | output tok/s | errors | requests per replica |",
        "|---|---|---|---|---|---|---|",
    ]
    for run in result["runs"]:
        hit = f"{run['hit_rate']:.1%}" if run["hit_rate"] is not None else "-"
        t = run["ttft_ms"]
        lines.append(f"| {run['policy']} | {hit} | {t['p50']:.0f} | {t['p99']:.0f} | {run['out_tok_s']:.1f} | "
                     f"{sum(run['errors'].values())} | {run['spread']} |")
    bar = result.get("bar")
    if bar:
        lines += ["", f"Bar: prefix-aware hit rate {bar['hit_rate']:.1%} (>= 85 %: {bar['hit_ok']}), TTFT p50 "
                      f"round-robin / prefix-aware = {bar['ttft_ratio']:.2f}x (>= 2x: {bar['ttft_ok']})."]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--policies", nargs="+", default=["prefix-aware", "round-robin", "least-loaded"])
    parser.add_argument("--workers", type=int, default=3)
    parser.add_argument("--num-blocks", type=int, default=420,
                        help="KV blocks per worker: ~6 system prompts of 1,000 tokens (63 blocks) + running requests")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--tenants", type=int, default=16)
    parser.add_argument("--system-len", type=int, default=1000)
    parser.add_argument("--turn-len", type=int, default=24)
    parser.add_argument("--num-requests", type=int, default=200)
    parser.add_argument("--output-len", type=int, default=8)
    parser.add_argument("--rate", type=float, default=0.6, help="Poisson arrival rate, requests/s")
    parser.add_argument("--seed", type=int, default=4)
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "reports" / "prefix-routing.json"))
    args = parser.parse_args()

    from tokenfleet.models.gguf_import import DEFAULT_MODEL_NAME, ensure_default_model

    model_dir = str(Path(ensure_default_model()).resolve())
    vocab = json.loads((Path(model_dir) / "config.json").read_text())["vocab_size"]
    arrivals, tenants, prompts = workload(args, vocab)

    def on_sigterm(*_: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_sigterm)
    result: dict = {"started": time.strftime("%Y-%m-%d %H:%M:%S"), "args": vars(args), "git": git_head(),
                    "machine": f"{os.cpu_count()} cpus, load {os.getloadavg()[0]:.1f} at start", "runs": []}
    children = Children()
    try:
        for policy in args.policies:
            print(f"{policy}: starting a fresh fleet ...", flush=True)
            url = start_fleet(children, args, model_dir, DEFAULT_MODEL_NAME, policy)
            results, wall = asyncio.run(run_load(url, DEFAULT_MODEL_NAME, args, arrivals, tenants, prompts))
            run = summarize(policy, results, wall)
            result["runs"].append(run)
            print(json.dumps(run), flush=True)
            children.stop_all()
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
    finally:
        children.stop_all()
        children.remove_logs()
    runs = {r["policy"]: r for r in result["runs"]}
    if "prefix-aware" in runs and "round-robin" in runs:
        pa, rr = runs["prefix-aware"], runs["round-robin"]
        ratio = rr["ttft_ms"]["p50"] / pa["ttft_ms"]["p50"]
        result["bar"] = {"hit_rate": pa["hit_rate"], "hit_ok": pa["hit_rate"] >= 0.85, "ttft_ratio": ratio,
                         "ttft_ok": ratio >= 2.0}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    out.with_suffix(".md").write_text(markdown(result))
    print(markdown(result))


if __name__ == "__main__":
    main()
