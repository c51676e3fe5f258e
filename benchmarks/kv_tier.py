"""The second KV tier: hit rate and TTFT of a multi-turn, multi-tenant workload whose distinct prefixes are
about 3x what the workers' pools hold, with the disk tier on, off, and against an unbounded pool.

Fleet (afresh for every run): etcd, --workers colocated workers (`--threads 1`, --num-blocks blocks each),
the prefix-aware router, the gateway. Configurations:
- off: the pools only;
- on: the same pools (same RAM) plus each worker's disk tier (`--kv-tier disk:DIR/wN`, --tier-bytes);
- unbounded: tiers off, pools of --unbounded-blocks blocks (nothing is ever evicted): the hit-rate ceiling.

Workload (seeded, identical for every run): --tenants tenants, each with a --system-len-token system prompt;
--conversations conversations spread over them, each --turns turns; turn k's prompt is the system prompt
then k earlier exchanges (a --user-len-token user message and a --reply-len-token reply each: synthetic
tokens standing in for the model's replies) and the new user message. Requests go turn by turn over all
conversations (every other conversation passes between two turns of one), --concurrency at a time;
/v1/completions, stream, temperature 0, ignore_eos, --output-len tokens.

Per run: hit rate = cached prompt tokens (usage.prompt_tokens_details.cached_tokens: pool and tier) /
prompt tokens over all requests; TTFT p50/p99; recomputed prompt tokens (prompt - cached). Runs alternate
off, on, unbounded, --runs times; the bars use the medians: hit rate (on) >= 0.9 x hit rate (unbounded),
TTFT p50 (off) / TTFT p50 (on) >= 2.

    .venv/bin/python benchmarks/kv_tier.py [--runs 3] [--out benchmarks/reports/kv-tier.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from serving.load import httpx
from serving.procs import Children, wait_completion
from serving.report import git_head

REPO = Path(__file__).resolve().parent.parent


@dataclass
class Result:
    ttft_s: float | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    replica: str = ""
    error: str | None = None
    sent_at: float = 0.0  # time.perf_counter() when sent


def workload(args: argparse.Namespace, vocab: int) -> list[list[int]]:
    """Prompts in the order they are sent: turn 0 of every conversation, then turn 1, ..."""
    def tokens(seed: int, n: int) -> list[int]:
        r = random.Random(seed)
        return [r.randrange(200, vocab) for _ in range(n)]

    systems = [tokens(1000 + t, args.system_len) for t in range(args.tenants)]
    prompts = []
    for turn in range(args.turns):
        for c in range(args.conversations):
            history = []
            for k in range(turn):
                history += tokens(args.seed * 7919 + c * 101 + 2 * k, args.user_len)
                history += tokens(args.seed * 7919 + c * 101 + 2 * k + 1, args.reply_len)
            prompts.append(systems[c % args.tenants] + history + tokens(args.seed * 7919 + c * 101 + 2 * turn, args.user_len))
    return prompts


async def run_load(url: str, model: str, args: argparse.Namespace, prompts: list[list[int]],
                   on_done: Callable[[int], None] | None = None) -> tuple[list[Result], float]:
    """Closed loop, --concurrency at a time, in order; ``on_done(n)`` after the n-th request ends."""
    limits = httpx.Limits(max_connections=args.concurrency + 4, max_keepalive_connections=args.concurrency + 4)
    results = [Result() for _ in prompts]
    queue: asyncio.Queue[int] = asyncio.Queue()
    for i in range(len(prompts)):
        queue.put_nowait(i)
    done = 0
    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(1800.0), limits=limits) as client:
        async def worker() -> None:
            nonlocal done
            while not queue.empty():
                i = queue.get_nowait()
                result = results[i]
                body = {"model": model, "prompt": prompts[i], "max_tokens": args.output_len, "temperature": 0.0,
                        "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
                sent = result.sent_at = time.perf_counter()
                try:
                    async with client.stream("POST", "/v1/completions", json=body) as response:
                        result.replica = response.headers.get("x-tokenfleet-replica", "")
                        if response.status_code != 200:
                            result.error = f"HTTP {response.status_code}"
                            continue
                        async for line in response.aiter_lines():
                            if not line.startswith("data:") or line[5:].strip() == "[DONE]":
                                continue
                            event = json.loads(line[5:])
                            if event.get("choices") and result.ttft_s is None and event["choices"][0].get("text"):
                                result.ttft_s = time.perf_counter() - sent
                            if event.get("usage"):
                                result.prompt_tokens = event["usage"]["prompt_tokens"]
                                result.cached_tokens = event["usage"]["prompt_tokens_details"]["cached_tokens"]
                except (httpx.HTTPError, json.JSONDecodeError, KeyError) as e:
                    result.error = f"{type(e).__name__}: {e}"[:200]
                finally:
                    done += 1
                    if on_done is not None:
                        on_done(done)

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(args.concurrency)))
        return results, time.perf_counter() - start


def summarize(config: str, results: list[Result], wall: float) -> dict:
    ok = [r for r in results if r.error is None]
    ttft = [r.ttft_s * 1000 for r in ok if r.ttft_s is not None]
    prompt = sum(r.prompt_tokens for r in ok)
    cached = sum(r.cached_tokens for r in ok)
    return {"config": config, "requests": len(results), "errors": sum(r.error is not None for r in results),
            "hit_rate": cached / prompt if prompt else None, "prompt_tokens": prompt, "recomputed_tokens": prompt - cached,
            "ttft_ms": {"p50": float(np.percentile(ttft, 50)), "p99": float(np.percentile(ttft, 99))} if ttft else None,
            "wall_s": round(wall, 2)}


def start_fleet(children: Children, args: argparse.Namespace, model_dir: str, model: str, config: str,
                tier_root: Path) -> str:
    children.start_etcd()
    etcd = children.etcd.endpoint
    blocks = args.unbounded_blocks if config == "unbounded" else args.num_blocks
    for i in range(args.workers):
        tier = ["--kv-tier", f"disk:{tier_root / f'w{i}'}", "--kv-tier-bytes", str(args.tier_bytes)] if config == "on" else []
        children.spawn_service(f"worker-{i}", "tokenfleet.services.decode", "--model", model_dir, "--model-name", model,
                               "--etcd", etcd, "--role", "both", "--threads", "1", "--replica-id", f"w{i}",
                               "--num-blocks", str(blocks), "--dtype", args.dtype, *tier, threads=1)
    router = children.spawn_service("router", "tokenfleet.services.router", "--etcd", etcd, "--policy", "prefix-aware")
    gateway = children.spawn_service("gateway", "tokenfleet.services.gateway", "--router", router.address,
                                     "--model", f"{model}={model_dir}")
    url = f"http://{gateway.address}"
    wait_completion(url, model, 300, lambda: all(c.proc.poll() is None for c in children.children))
    return url


def median_of(runs: list[dict], config: str, key: str) -> float:
    values = [r["ttft_ms"]["p50"] if key == "ttft_p50" else r[key] for r in runs if r["config"] == config]
    return statistics.median(values)


def markdown(result: dict) -> str:
    a, bar = result["args"], result["bar"]
    lines = ["# Second KV tier (disk) vs pools only vs an unbounded pool", "",
             f"{result['started']}, git {result['git']}, {result['machine']}", "",
             f"{a['workers']} workers (--threads 1, --num-blocks {a['num_blocks']}, {a['dtype']}), prefix-aware router. "
             f"{a['tenants']} tenants x {a['system_len']}-token system prompts, {a['conversations']} conversations x "
             f"{a['turns']} turns (+{a['user_len']} user / +{a['reply_len']} reply tokens a turn), {a['concurrency']} "
             f"at a time, {a['output_len']} output tokens. Distinct prefix tokens: {result['working_set_tokens']} = "
             f"{result['working_set_ratio']:.1f}x the pools' {result['pool_tokens']} tokens. Disk tier "
             f"{a['tier_bytes'] / 2**20:.0f} MiB per worker; unbounded pool: {a['unbounded_blocks']} blocks.", "",
             "| run | config | hit rate | recomputed prompt tokens | TTFT p50 ms | TTFT p99 ms | wall s | errors |",
             "|---|---|---|---|---|---|---|---|"]
    for i, r in enumerate(result["runs"]):
        t = r["ttft_ms"] or {"p50": float("nan"), "p99": float("nan")}
        lines.append(f"| {i // 3 + 1} | {r['config']} | {r['hit_rate']:.1%} | {r['recomputed_tokens']} | {t['p50']:.0f} | "
                     f"{t['p99']:.0f} | {r['wall_s']} | {r['errors']} |")
    lines += ["", f"Medians: hit rate on {bar['hit_on']:.1%} / unbounded {bar['hit_unbounded']:.1%} = "
                  f"**{bar['hit_ratio']:.2f}** (bar >= 0.9: {'pass' if bar['hit_ok'] else 'FAIL'}); TTFT p50 off "
                  f"{bar['ttft_off']:.0f} ms / on {bar['ttft_on']:.0f} ms = **{bar['ttft_ratio']:.2f}x** (bar >= 2: "
                  f"{'pass' if bar['ttft_ok'] else 'FAIL'}); recomputed prompt tokens off / on = "
                  f"{bar['recompute_ratio']:.2f}x."]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--num-blocks", type=int, default=160)
    parser.add_argument("--unbounded-blocks", type=int, default=4000)
    parser.add_argument("--tier-bytes", type=int, default=1 << 30)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--tenants", type=int, default=4)
    parser.add_argument("--system-len", type=int, default=400)
    parser.add_argument("--conversations", type=int, default=24)
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--user-len", type=int, default=40)
    parser.add_argument("--reply-len", type=int, default=60)
    parser.add_argument("--concurrency", type=int, default=2)
    parser.add_argument("--output-len", type=int, default=4)
    parser.add_argument("--seed", type=int, default=5)
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "reports" / "kv-tier.json"))
    args = parser.parse_args()
    from tokenfleet.models.gguf_import import DEFAULT_MODEL_NAME, ensure_default_model

    model_dir = str(Path(ensure_default_model()).resolve())
    vocab = json.loads((Path(model_dir) / "config.json").read_text())["vocab_size"]
    prompts = workload(args, vocab)
    distinct = args.tenants * args.system_len + args.conversations * (args.turns * (args.user_len + args.reply_len))
    pool_tokens = args.workers * args.num_blocks * 16

    def on_sigterm(*_: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_sigterm)
    result: dict = {"started": time.strftime("%Y-%m-%d %H:%M:%S"), "args": vars(args), "git": git_head(),
                    "machine": f"{os.cpu_count()} cpus, load {os.getloadavg()[0]:.1f} at start", "runs": [],
                    "working_set_tokens": distinct, "pool_tokens": pool_tokens, "working_set_ratio": distinct / pool_tokens,
                    "command": "benchmarks/kv_tier.py " + " ".join(sys.argv[1:])}
    children = Children()
    tier_root = Path(tempfile.mkdtemp(prefix="tokenfleet-tier-"))
    try:
        for run in range(args.runs):
            for config in ("off", "on", "unbounded"):
                shutil.rmtree(tier_root, ignore_errors=True)
                print(f"run {run + 1} {config}: starting a fresh fleet ...", flush=True)
                url = start_fleet(children, args, model_dir, DEFAULT_MODEL_NAME, config, tier_root)
                results, wall = asyncio.run(run_load(url, DEFAULT_MODEL_NAME, args, prompts))
                summary = summarize(config, results, wall)
                result["runs"].append(summary)
                print(json.dumps(summary), flush=True)
                children.stop_all()
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
    finally:
        children.stop_all()
        children.remove_logs()
        shutil.rmtree(tier_root, ignore_errors=True)
    runs = result["runs"]
    hit_on, hit_unbounded = median_of(runs, "on", "hit_rate"), median_of(runs, "unbounded", "hit_rate")
    ttft_off, ttft_on = median_of(runs, "off", "ttft_p50"), median_of(runs, "on", "ttft_p50")
    recompute = median_of(runs, "off", "recomputed_tokens") / max(1.0, median_of(runs, "on", "recomputed_tokens"))
    result["bar"] = {"hit_on": hit_on, "hit_unbounded": hit_unbounded, "hit_ratio": hit_on / hit_unbounded,
                     "hit_ok": hit_on >= 0.9 * hit_unbounded, "ttft_off": ttft_off, "ttft_on": ttft_on,
                     "ttft_ratio": ttft_off / ttft_on, "ttft_ok": ttft_off >= 2 * ttft_on, "recompute_ratio": recompute}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    out.with_suffix(".md").write_text(markdown(result))
    print(markdown(result))


if __name__ == "__main__":
    main()
