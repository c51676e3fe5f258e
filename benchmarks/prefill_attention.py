"""Prefill-chunk attention on CPU, one layer: the native kernel (csrc/paged_attention.c, every row of
the step in one call, K/V read from the cache) vs torch SDPA per request (what the pure-torch path
runs), bf16, SmolLM2's shapes (9 query / 3 KV heads, head_dim 64, 16-token blocks).

R requests of L new tokens each (no earlier context: the prompt's first chunk). Each case is
timed as 3 alternating rounds (native, SDPA, native, ...); the ratio is the median, every round
is reported. Also the largest |difference| between the two outputs (both bf16).

    .venv/bin/python benchmarks/prefill_attention.py [--threads N] [--out benchmarks/reports/...json]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from datetime import datetime
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serving.report import write_report  # noqa: E402

from tokenfleet.models import native  # noqa: E402
from tokenfleet.models.attention import NativePagedAttention, PagedQueries, _gather, _prefill_attention  # noqa: E402

KVH, G, HD, BS = 3, 3, 64, 16
CASES = ((1, 256), (8, 256), (4, 512), (2, 1024), (1, 2048), (1, 4096))


def timed(fn, n: int) -> float:
    fn()
    start = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - start) / n * 1e3


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    lib = native.load("paged_attention")
    if lib is None:
        raise SystemExit("the native kernel could not be built here (no C compiler?)")
    attend = NativePagedAttention(lib)
    dt = torch.bfloat16
    torch.manual_seed(0)
    num_blocks = max(r * length for r, length in CASES) // BS
    k_cache = torch.randn(KVH, num_blocks, BS, HD, dtype=dt)
    v_cache = torch.randn(KVH, num_blocks, BS, HD, dtype=dt)
    rows = []
    for r, length in CASES:
        tables = torch.randperm(num_blocks)[: r * length // BS].view(r, -1)
        q = torch.randn(r * length, KVH * G, HD, dtype=dt)
        meta = PagedQueries(tables, torch.full((r,), length), torch.arange(r + 1) * length, r * length, length)
        keys = [_gather(k_cache, tables[i]) for i in range(r)]
        values = [_gather(v_cache, tables[i]) for i in range(r)]

        def run_native():
            return attend(q, k_cache, v_cache, meta)

        def run_sdpa():
            return torch.cat([_prefill_attention(q[i * length:(i + 1) * length], keys[i], values[i], 0) for i in range(r)])

        diff = (run_native().float() - run_sdpa().float()).abs().max().item()
        n = max(2, int(4096 / (r * length) * 10))
        native_ms, sdpa_ms = [], []
        for _ in range(args.rounds):
            native_ms.append(timed(run_native, n))
            sdpa_ms.append(timed(run_sdpa, n))
        ratios = [s / m for m, s in zip(native_ms, sdpa_ms)]
        rows.append({"requests": r, "tokens": length, "native_ms": native_ms, "sdpa_ms": sdpa_ms,
                     "speedup_median": statistics.median(ratios), "max_abs_diff": diff})
    lines = [f"# Prefill attention, native kernel vs SDPA, one layer ({datetime.now():%Y-%m-%d %H:%M:%S})", "",
             f"bf16, {args.threads} torch threads, 9 query / 3 KV heads, head_dim 64; {args.rounds} alternating rounds.",
             "", "| requests x tokens | native ms (rounds) | SDPA ms (rounds) | SDPA / native (median) | max abs diff |",
             "|---|---|---|---|---|"]
    for row in rows:
        lines.append(f"| {row['requests']} x {row['tokens']} | {', '.join(f'{t:.2f}' for t in row['native_ms'])} | "
                     f"{', '.join(f'{t:.2f}' for t in row['sdpa_ms'])} | {row['speedup_median']:.2f}x | "
                     f"{row['max_abs_diff']:.4f} |")
    result = {"threads": args.threads, "rounds": args.rounds, "cases": rows}
    if args.out:
        write_report(args.out, result, "\n".join(lines) + "\n")
    else:
        print("\n".join(lines))


if __name__ == "__main__":
    main()
