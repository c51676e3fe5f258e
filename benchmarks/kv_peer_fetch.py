"""Peer fetch under spills and a restart: prompt tokens recomputed with and without it.

The workload and fleet of benchmarks/kv_tier.py (2 workers x 1 thread, each with its disk tier, the
prefix-aware router), with load that forces spills away from a prefix's home (--concurrency requests at
a time and the router's --load-slack and --spill-floor, so a busy home hands turns to the other worker)
and, once half the requests are done, worker 1 drained (SIGTERM: its streams finish; with peer fetch it
then keeps sending blocks to its peer until none has been asked for in --handoff-idle seconds) and
restarted on its disk tier (which holds its pool too: a closing worker copies it there). With peer fetch
the router names the replica holding more of the prompt's prefix and the picked worker pulls those blocks
from it; without (`router --no-peer-fetch`, workers `--handoff-idle-seconds 0`) the picked worker
recomputes them.

Per run: recomputed prompt tokens = computed prompt tokens (prompt - cached, from each response's usage)
minus the novel ones (past the longest prefix a prompt shares with an earlier one: computed nowhere
before, so no cache can serve them); hit rate; TTFT; the workers' peer counters from their load reports
at the end (the restarted worker's count from its restart).
Runs alternate peer / no-peer, --runs times; bar: median recomputed tokens without / with >= 3.

    .venv/bin/python benchmarks/kv_peer_fetch.py [--runs 3] [--out benchmarks/reports/kv-peer-fetch.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
from kv_tier import run_load, workload
from serving.procs import Children, wait_completion
from serving.report import git_head

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def shared_prefixes(prompts: list[list[int]]) -> list[int]:
    """Per prompt, in sending order: the length of the longest prefix it shares with an earlier prompt."""
    seen: set[tuple[int, ...]] = set()
    out = []
    for prompt in prompts:
        out.append(max((n for n in range(len(prompt), 0, -1) if tuple(prompt[:n]) in seen), default=0))
        seen.update(tuple(prompt[:n]) for n in range(1, len(prompt) + 1))
    return out


def novel_tokens(prompts: list[list[int]]) -> list[int]:
    """Per prompt: its tokens past that shared prefix (their KV cannot have been computed anywhere before it;
    the rest, if computed again, is a recompute)."""
    return [len(p) - shared for p, shared in zip(prompts, shared_prefixes(prompts))]


def block_floor(prompts: list[list[int]]) -> list[int]:
    """Per prompt: the tokens even an unbounded block cache computes (past the last full block of the shared
    prefix; at least the last token, whose logits are needed)."""
    return [len(p) - min(shared // 16, (len(p) - 1) // 16) * 16 for p, shared in zip(prompts, shared_prefixes(prompts))]


def worker_args(args: argparse.Namespace, model_dir: str, model: str, etcd: str, i: int, tier_root: Path,
                peer: bool) -> list[str]:
    # Without peer fetch nothing fetches from a drained worker: it exits once its streams end.
    return ["--handoff-idle-seconds", str(args.handoff_idle if peer else 0), "--model", model_dir, "--model-name", model,
            "--etcd", etcd, "--role", "both", "--threads", "1", "--replica-id", f"w{i}", "--num-blocks",
            str(args.num_blocks), "--dtype", args.dtype,
            "--kv-tier", f"disk:{tier_root / f'w{i}'}", "--kv-tier-bytes", str(args.tier_bytes), "--grace-seconds", "5"]


def peer_counters(children: Children, addresses: list[str]) -> dict:
    from tokenfleet.v1 import engine_pb2, engine_pb2_grpc

    out = {"received": 0, "served": 0, "failures": 0, "tier_hits": 0}
    for address in addresses:
        with children.plane("router").sync_channel(address, "worker") as channel:
            stream = engine_pb2_grpc.EngineServiceStub(channel).Load(engine_pb2.LoadRequest(interval_ms=50))
            r = next(iter(stream))
            stream.cancel()
        out["received"] += r.num_peer_blocks_received
        out["served"] += r.num_peer_blocks_served
        out["failures"] += r.num_peer_fetch_failures
        out["tier_hits"] += r.num_tier_hit_blocks
    return out


def one_run(args: argparse.Namespace, model_dir: str, model: str, prompts: list[list[int]], peer: bool) -> dict:
    children = Children()
    tier_root = Path(tempfile.mkdtemp(prefix="tokenfleet-peer-"))
    finished = threading.Event()
    try:
        etcd = children.start_etcd().endpoint
        workers = [children.spawn_service(f"worker-{i}", "tokenfleet.services.decode",
                                          *worker_args(args, model_dir, model, etcd, i, tier_root, peer), threads=1)
                   for i in range(2)]
        router = children.spawn_service("router", "tokenfleet.services.router", "--etcd", etcd, "--policy",
                                        args.policy, "--load-slack", str(args.load_slack),
                                        "--spill-floor", str(args.spill_floor),
                                        *([] if peer else ["--no-peer-fetch"]))
        gateway = children.spawn_service("gateway", "tokenfleet.services.gateway", "--router", router.address,
                                         "--model", f"{model}={model_dir}")
        url = f"http://{gateway.address}"
        wait_completion(url, model, 300, lambda: all(c.proc.poll() is None for c in children.children))
        at_half = threading.Event()
        restarted: dict = {}

        def restart() -> None:
            at_half.wait()
            started = restarted["stop_at"] = time.perf_counter()
            children.stop(workers[1])  # SIGTERM: drains, hands its blocks to peers, exits
            restarted["exited_at"] = time.perf_counter()
            workers[1] = children.spawn_service("worker-1b", "tokenfleet.services.decode",
                                                *worker_args(args, model_dir, model, etcd, 1, tier_root, peer), threads=1)
            restarted["up_at"] = time.perf_counter()
            restarted["seconds"] = round(time.perf_counter() - started, 1)
            # The child's parent-death signal follows the thread that spawned it: this one stays until the end.
            finished.wait()

        thread = threading.Thread(target=restart, daemon=True)
        thread.start()
        half = len(prompts) // 2
        results, wall = asyncio.run(run_load(url, model, args, prompts, lambda n: at_half.set() if n == half else None))
        while "seconds" not in restarted and thread.is_alive():
            time.sleep(0.2)
        for w in workers:
            if w.proc.poll() is not None:
                raise RuntimeError(f"{w.name} exited ({w.proc.poll()}):\n{w.log_tail(40)}")
        counters = peer_counters(children, [w.address for w in workers])
        finished.set()
    finally:
        children.stop_all()
        children.remove_logs()
        shutil.rmtree(tier_root, ignore_errors=True)
    finished.set()
    ok = [r for r in results if r.error is None]
    ttft = [r.ttft_s * 1000 for r in ok if r.ttft_s is not None]
    prompt, cached = sum(r.prompt_tokens for r in ok), sum(r.cached_tokens for r in ok)
    novel = sum(n for n, r in zip(novel_tokens(prompts), results) if r.error is None)
    floor = sum(n for n, r in zip(block_floor(prompts), results) if r.error is None)
    phases: dict[str, int] = {"before": 0, "draining": 0, "down": 0, "after": 0}  # beyond the floor, by send time
    for r, f in zip(results, block_floor(prompts)):
        if r.error is None:
            phase = ("before" if r.sent_at < restarted.get("stop_at", float("inf")) else
                     "draining" if r.sent_at < restarted.get("exited_at", float("inf")) else
                     "down" if r.sent_at < restarted.get("up_at", float("inf")) else "after")
            phases[phase] += r.prompt_tokens - r.cached_tokens - f
    return {"config": "peer" if peer else "no-peer", "requests": len(results), "errors": len(results) - len(ok),
            "computed_tokens": prompt - cached, "novel_tokens": novel, "recomputed_tokens": prompt - cached - novel,
            "block_floor_tokens": floor, "beyond_block_floor": prompt - cached - floor,
            "hit_rate": cached / prompt if prompt else None,
            "ttft_ms": {"p50": float(np.percentile(ttft, 50)), "p99": float(np.percentile(ttft, 99))} if ttft else None,
            "wall_s": round(wall, 2), "restart_s": restarted.get("seconds"),
            "drain_s": round(restarted["exited_at"] - restarted["stop_at"], 1) if "exited_at" in restarted else None,
            "beyond_floor_by_phase": phases,
            "spread": {rep: sum(1 for r in ok if r.replica == rep) for rep in sorted({r.replica for r in ok})},
            "peer_counters_after_restart": counters}


def bars(runs: list[dict]) -> dict:
    def median(config: str, key: str) -> float:
        return statistics.median(r[key] for r in runs if r["config"] == config)

    with_peer, without = median("peer", "recomputed_tokens"), median("no-peer", "recomputed_tokens")
    floor_peer, floor_without = median("peer", "beyond_block_floor"), median("no-peer", "beyond_block_floor")
    return {"peer": with_peer, "no_peer": without, "ratio": without / max(1, with_peer), "ok": without >= 3 * with_peer,
            "beyond_floor_peer": floor_peer, "beyond_floor_no_peer": floor_without,
            "beyond_floor_ratio": floor_without / max(1, floor_peer)}


def markdown(result: dict) -> str:
    a, bar = result["args"], result["bar"]
    lines = ["# Peer fetch under spills and a restart", "", f"{result['started']}, git {result['git']}, {result['machine']}",
             "", f"2 workers (--threads 1, --num-blocks {a['num_blocks']}, disk tiers), {a['policy']} router "
             f"(--load-slack {a['load_slack']}, --spill-floor {a['spill_floor']}), {a['concurrency']} requests at a time; "
             f"worker 1 drained (peer: handing off blocks until idle {a['handoff_idle']} s) and restarted "
             f"on its disk tier after half the requests. Workload of kv_tier.py: {a['tenants']} tenants, "
             f"{a['conversations']} conversations x {a['turns']} turns.", "",
             "| run | config | recomputed prompt tokens (computed - novel) | hit rate | TTFT p50 ms | TTFT p99 ms | wall s "
             "| restart s (drain + handoff) | beyond the block floor: before / draining / down / after the restart "
             "| requests per replica | peer blocks received (restarted worker: since restart) | errors |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for i, r in enumerate(result["runs"]):
        t = r["ttft_ms"] or {"p50": float("nan"), "p99": float("nan")}
        lines.append(f"| {i // 2 + 1} | {r['config']} | {r['recomputed_tokens']} ({r['computed_tokens']} - "
                     f"{r['novel_tokens']}) | {r['hit_rate']:.1%} | {t['p50']:.0f} | "
                     f"{t['p99']:.0f} | {r['wall_s']} | {r['restart_s']} ({r['drain_s']}) | "
                     f"{' / '.join(str(v) for v in r['beyond_floor_by_phase'].values())} | {r['spread']} | "
                     f"{r['peer_counters_after_restart']['received']} | {r['errors']} |")
    lines += ["", f"Medians: recomputed prompt tokens without peer fetch {bar['no_peer']:.0f} / with "
                  f"{bar['peer']:.0f} = **{bar['ratio']:.2f}x** (bar >= 3: {'pass' if bar['ok'] else 'FAIL'}). Beyond "
                  f"the block floor (what an unbounded block cache computes too: partial last blocks; "
                  f"{result['runs'][0]['block_floor_tokens']} tokens): {bar['beyond_floor_no_peer']:.0f} / "
                  f"{bar['beyond_floor_peer']:.0f} = {bar['beyond_floor_ratio']:.2f}x."]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--num-blocks", type=int, default=160)
    parser.add_argument("--tier-bytes", type=int, default=1 << 30)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--load-slack", type=float, default=0.0)
    parser.add_argument("--spill-floor", type=int, default=2,
                        help="the router's: with 4 requests at a time over 2 workers, a home with 3 spills")
    parser.add_argument("--handoff-idle", type=float, default=2.0,
                        help="the drained worker's --handoff-idle-seconds with peer fetch (0 without)")
    parser.add_argument("--policy", default="prefix-aware", choices=["prefix-aware", "least-loaded", "round-robin"],
                        help="least-loaded: every placement ignores the prefix, as when load spills all traffic")
    parser.add_argument("--tenants", type=int, default=4)
    parser.add_argument("--system-len", type=int, default=400)
    parser.add_argument("--conversations", type=int, default=24)
    parser.add_argument("--turns", type=int, default=8)
    parser.add_argument("--user-len", type=int, default=20)
    parser.add_argument("--reply-len", type=int, default=20)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--output-len", type=int, default=4)
    parser.add_argument("--seed", type=int, default=5)
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "reports" / "kv-peer-fetch.json"))
    args = parser.parse_args()
    from tokenfleet.models.gguf_import import DEFAULT_MODEL_NAME, ensure_default_model

    model_dir = str(Path(ensure_default_model()).resolve())
    vocab = json.loads((Path(model_dir) / "config.json").read_text())["vocab_size"]
    prompts = workload(args, vocab)

    def on_sigterm(*_: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_sigterm)
    result: dict = {"started": time.strftime("%Y-%m-%d %H:%M:%S"), "args": vars(args), "git": git_head(),
                    "machine": f"{os.cpu_count()} cpus, load {os.getloadavg()[0]:.1f} at start", "runs": [],
                    "command": "benchmarks/kv_peer_fetch.py " + " ".join(sys.argv[1:])}
    for run in range(args.runs):
        for peer in (True, False):
            print(f"run {run + 1} {'peer' if peer else 'no-peer'} ...", flush=True)
            summary = one_run(args, model_dir, DEFAULT_MODEL_NAME, prompts, peer)
            result["runs"].append(summary)
            print(json.dumps(summary), flush=True)
    result["bar"] = bars(result["runs"])
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    out.with_suffix(".md").write_text(markdown(result))
    print(markdown(result))


if __name__ == "__main__":
    main()
