"""Usage-ledger write cost: durable SQLite writes (WAL, synchronous=FULL, group commit) as the
gateway does them, one awaited write per finished request, at several concurrency levels.

    .venv/bin/python benchmarks/ledger.py [--requests 2000] [--concurrency 1 8 64]

Reports, per concurrency: µs of wall time per record (throughput view), the median and p99 time
one request waits for its write (latency added before its final chunk), and commits per record.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from pathlib import Path

from tokenfleet.tenancy.ledger import Ledger, UsageRecord


async def run(ledger: Ledger, n: int, concurrency: int) -> tuple[float, list[float]]:
    gate = asyncio.Semaphore(concurrency)
    waits: list[float] = []

    async def one(i: int) -> None:
        async with gate:
            now = time.time()
            record = UsageRecord(f"req-{i}", "acme", "smol", "chat", "ok", "k1", 100, 20, 50, 120.0, 900.0, now, now)
            start = time.perf_counter()
            await ledger.write(record)
            waits.append(time.perf_counter() - start)

    start = time.perf_counter()
    await asyncio.gather(*(one(i) for i in range(n)))
    return time.perf_counter() - start, waits


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 64])
    parser.add_argument("--dir", help="where the ledger file goes (default: a temporary folder on this disk)")
    args = parser.parse_args()
    print("| concurrency | µs per record (wall / n) | write wait p50 µs | p99 µs | records per commit |")
    print("|---|---|---|---|---|")
    for concurrency in args.concurrency:
        with tempfile.TemporaryDirectory(dir=args.dir) as folder:
            ledger = Ledger(Path(folder) / "ledger.sqlite3")
            wall, waits = asyncio.run(run(ledger, args.requests, concurrency))
            commits = ledger.num_commits
            ledger.close()
        waits.sort()
        print(f"| {concurrency} | {1e6 * wall / args.requests:.0f} | {1e6 * statistics.median(waits):.0f} | "
              f"{1e6 * waits[int(0.99 * len(waits)) - 1]:.0f} | {args.requests / commits:.1f} |")


if __name__ == "__main__":
    main()
