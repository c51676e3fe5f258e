"""Gemma 3 270M at a context of 4x its sliding window: KV blocks per request and concurrent requests in one
KV budget, sliding-window groups (what the engine does) vs a naive full-context allocation.

1. Allocation: requests at a context of 2,048 tokens and more (4 x 512: a 2,048-token prompt prefilled
   in 256-token chunks, then --output-tokens decoded) through the engine's scheduler and block manager (no
   forward) with the model's KV groups (1 global group, 5 sliding-window groups of 3 layers); the naive
   allocation is the same groups keeping every block (window 0). Reported: blocks one request holds at
   the full context per group kind, and the most requests holding the full context at once.
2. The real engine (bf16, the budget divided by --engine-divisor to keep the run short, the same chunking,
   32 output tokens): three more requests than the windowed allocation fits run to completion; reported: the most requests at the
   full context at once, preemptions, and the most blocks any sliding-window table held.

    .venv/bin/python benchmarks/gemma3_window_memory.py [--kv-gib 1] [--out benchmarks/reports/gemma3-window-memory.json]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from serving.report import write_report

from tokenfleet.engine.request_spec import RequestSpec

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


CHUNK = 256


def allocation(num_blocks: int, windows: tuple[int, ...], context: int, output: int, block_size: int) -> dict:
    from tokenfleet.engine.block_manager import NULL_BLOCK, BlockManager
    from tokenfleet.engine.request import Request
    from tokenfleet.engine.sampling_params import SamplingParams
    from tokenfleet.engine.scheduler import Scheduler, SchedulerConfig

    bm = BlockManager(num_blocks, block_size, windows)
    scheduler = Scheduler(SchedulerConfig(max_num_running=4096, max_num_batched_tokens=2048, max_model_len=context + output,
                                          max_prefill_chunk=CHUNK, max_num_waiting=100_000), bm, hash_salt="memory")
    prompt_len = context
    num_requests = bm.capacity // -(-prompt_len // block_size) + 8  # more than fit: each holds a full global table
    for i in range(num_requests):
        params = SamplingParams(max_tokens=output, temperature=0.0, ignore_eos=True)
        prompt = [(i * 7919 + j) % 50_000 + 3 for j in range(prompt_len)]  # distinct: no prefix sharing
        scheduler.add_request(Request(f"r{i}", prompt, params, arrival_time=i, max_tokens=output))
    at_context, held = 0, {"full": 0, "window": 0}
    while scheduler.has_unfinished():
        out = scheduler.schedule(0.0)
        full = [r for r in scheduler.running if r.num_computed_tokens >= prompt_len]
        at_context = max(at_context, len(full))
        for r in full:
            for window, table in zip(bm.windows, bm.block_tables(r.request_id)):
                key = "window" if window else "full"
                held[key] = max(held[key], sum(1 for b in table if b != NULL_BLOCK))
        scheduler.update(out, {s.request_id: 5 for s in out.scheduled if s.samples})
    per_request = held["full"] * sum(1 for w in windows if not w) + held["window"] * sum(1 for w in windows if w)
    return {"num_blocks": num_blocks, "requests": num_requests, "concurrent_at_context": at_context,
            "preemptions": scheduler.num_preemptions, "max_blocks_per_group_table": held, "blocks_per_request": per_request}


def engine_run(model_dir: str, kv_bytes: int, num_requests: int, context: int, output: int) -> dict:
    from tokenfleet.backends.torch.builder import build_engine_core
    from tokenfleet.engine.block_manager import NULL_BLOCK
    from tokenfleet.engine.config import EngineConfig
    from tokenfleet.engine.sampling_params import SamplingParams

    core = build_engine_core(EngineConfig(model=model_dir, dtype="bfloat16", kv_cache_bytes=kv_bytes, max_num_batched_tokens=2048,
                                          max_prefill_chunk=CHUNK, num_threads=2))
    bm = core.scheduler.block_manager
    for i in range(num_requests):
        prompt = [(i * 7919 + j) % 50_000 + 3 for j in range(context)]
        core.add_request(RequestSpec(prompt, SamplingParams(max_tokens=output, temperature=0.0, ignore_eos=True),
                                     request_id=f"e{i}"))
    at_context = window_held = steps = 0
    started = time.perf_counter()
    while core.has_unfinished():
        core.step()
        steps += 1
        at_context = max(at_context, sum(1 for r in core.scheduler.running if r.num_computed_tokens >= context))
        for rid in core.scheduler.requests:
            for window, table in zip(bm.windows, bm.block_tables(rid)):
                if window:
                    window_held = max(window_held, sum(1 for b in table if b != NULL_BLOCK))
    return {"kv_cache_bytes": kv_bytes, "num_blocks": bm.num_blocks, "requests": num_requests,
            "concurrent_at_context": at_context, "preemptions": core.scheduler.num_preemptions,
            "max_window_blocks_per_table": window_held, "steps": steps,
            "seconds": round(time.perf_counter() - started, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kv-gib", type=float, default=1.0)
    parser.add_argument("--output-tokens", type=int, default=128)
    parser.add_argument("--engine-divisor", type=int, default=8, help="the real-engine run's budget: kv-gib / this")
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "reports" / "gemma3-window-memory.json"))
    args = parser.parse_args()
    from tokenfleet.models.config import ModelConfig
    from tokenfleet.models.gguf_import import GEMMA3_MODEL_NAME, ensure_model

    model_dir = str(ensure_model(GEMMA3_MODEL_NAME))
    config = ModelConfig.from_dir(model_dir)
    groups = config.kv_groups
    window = max(g.window for g in groups)
    context, block_size, itemsize = 4 * window, 16, 2  # bf16
    page_bytes = 2 * len(groups[0].layers) * config.num_kv_heads * config.head_dim * itemsize * block_size
    num_blocks = int(args.kv_gib * 2**30) // page_bytes
    windowed = allocation(num_blocks, tuple(g.window for g in groups), context, args.output_tokens, block_size)
    naive = allocation(num_blocks, (0,) * len(groups), context, args.output_tokens, block_size)
    engine_bytes = int(args.kv_gib * 2**30) // args.engine_divisor
    small = {kind: allocation(engine_bytes // page_bytes, windows, context, args.output_tokens, block_size)
             for kind, windows in (("windowed", tuple(g.window for g in groups)), ("naive", (0,) * len(groups)))}
    engine = engine_run(model_dir, engine_bytes, small["windowed"]["concurrent_at_context"] + 3, context, 32)
    result = {"started": time.strftime("%Y-%m-%d %H:%M:%S"), "command": "benchmarks/gemma3_window_memory.py",
              "model": GEMMA3_MODEL_NAME, "context": context, "window": window, "block_size": block_size,
              "kv_gib": args.kv_gib, "page_bytes": page_bytes,
              "groups": [{"window": g.window, "layers": list(g.layers)} for g in groups],
              "windowed": windowed, "naive": naive,
              "ratio": round(windowed["concurrent_at_context"] / max(1, naive["concurrent_at_context"]), 2),
              "engine": engine, "engine_budget_allocation": small, "chunk": CHUNK,
              "bound_blocks_per_window_table": -(-(window + CHUNK) // block_size) + 1}
    write_report(args.out, result, markdown(result))


def markdown(r: dict) -> str:
    w, n, e = r["windowed"], r["naive"], r["engine"]
    return "\n".join([
        f"# Gemma 3 270M KV at a {r['context']}-token context (4 x the {r['window']}-token window), {r['started']}", "",
        f"KV budget {r['kv_gib']} GiB bf16 = {w['num_blocks']} blocks of {r['page_bytes']} bytes (one block: 3 layers of "
        f"one group, {r['block_size']} tokens); groups: 1 global, {len(r['groups']) - 1} sliding-window.", "",
        "| allocation | blocks per request | most blocks in one global table | in one sliding table "
        "| concurrent requests |", "|---|---|---|---|---|",
        f"| sliding-window groups (the engine) | {w['blocks_per_request']} | {w['max_blocks_per_group_table']['full']} "
        f"| {w['max_blocks_per_group_table']['window']} | **{w['concurrent_at_context']}** |",
        f"| naive full context | {n['blocks_per_request']} | {n['max_blocks_per_group_table']['full']} | - "
        f"| **{n['concurrent_at_context']}** |", "",
        f"Requests at the full context at once, windowed / naive: **{r['ratio']}x** ({w['requests']} requests offered; "
        f"{w['preemptions']} / {n['preemptions']} preemptions). Prefill in {r['chunk']}-token chunks.", "",
        f"Real engine (bf16, {e['kv_cache_bytes'] / 2**20:.0f} MiB of KV = {e['num_blocks']} blocks, {e['requests']} "
        f"requests of {r['context']} tokens; the allocation alone gives "
        f"{r['engine_budget_allocation']['windowed']['concurrent_at_context']} windowed vs "
        f"{r['engine_budget_allocation']['naive']['concurrent_at_context']} naive for that budget): "
        f"**{e['concurrent_at_context']}** at the full context at once, {e['preemptions']} preemptions; a sliding-window "
        f"table held at most {e['max_window_blocks_per_table']} blocks (bound: window + one chunk = "
        f"{r['bound_blocks_per_window_table']}); {e['steps']} steps in {e['seconds']} s.", ""])


if __name__ == "__main__":
    main()
