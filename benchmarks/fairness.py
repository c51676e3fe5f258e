"""Fair queuing between tenants on one worker: a flooding tenant vs an occasional one.

One worker (--threads 1, --max-num-running 4 so a queue forms), driven over gRPC Generate with
the tenant field set (what the gateway sends). Tenant A submits --flood requests at once;
tenant B sends one request every --period s while A's backlog lasts. Same load twice: with
fair queuing (the default) and with --no-fair-queuing (plain arrival order). Reports B's and
A's TTFT p50/max and the ratio. Prompts: random token ids, --prompt-len tokens, --output-len
output tokens (ignore_eos).

    .venv/bin/python benchmarks/fairness.py [--flood 40] [--period 2] [--b-requests 6]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time
from pathlib import Path

from serving.procs import Children

from tokenfleet.v1 import common_pb2, engine_pb2, engine_pb2_grpc

REPO = Path(__file__).resolve().parent.parent


async def ttft(stub, prompt: list[int], tenant: str, request_id: str, output_len: int) -> float:
    start = time.perf_counter()
    first = None
    request = engine_pb2.GenerateRequest(request_id=request_id, prompt_token_ids=prompt, tenant=tenant,
                                         sampling=common_pb2.SamplingParams(temperature=0.0, max_tokens=output_len,
                                                                            ignore_eos=True))
    async for response in stub.Generate(request):
        if first is None and response.HasField("chunk") and response.chunk.token_ids:
            first = time.perf_counter()
    assert first is not None
    return first - start


async def run(address: str, args: argparse.Namespace, vocab: int, plane) -> dict:  # type: ignore[no-untyped-def]
    rng = random.Random(args.seed)

    def prompt() -> list[int]:
        return [rng.randrange(200, vocab) for _ in range(args.prompt_len)]

    async with plane.channel(address, "worker") as channel:
        stub = engine_pb2_grpc.EngineServiceStub(channel)
        flood = [asyncio.create_task(ttft(stub, prompt(), "A", f"a{i}", args.output_len)) for i in range(args.flood)]
        await asyncio.sleep(args.period)
        b = []
        for i in range(args.b_requests):
            b.append(asyncio.create_task(ttft(stub, prompt(), "B", f"b{i}", args.output_len)))
            await asyncio.sleep(args.period)
        a_times, b_times = await asyncio.gather(asyncio.gather(*flood), asyncio.gather(*b))
    return {"A": {"p50_ms": 1000 * statistics.median(a_times), "max_ms": 1000 * max(a_times)},
            "B": {"p50_ms": 1000 * statistics.median(b_times), "max_ms": 1000 * max(b_times)}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--flood", type=int, default=40)
    parser.add_argument("--b-requests", type=int, default=6)
    parser.add_argument("--period", type=float, default=2.0)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--seed", type=int, default=5)
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "reports" / "fairness.json"))
    args = parser.parse_args()

    from tokenfleet.models.gguf_import import ensure_default_model

    model_dir = str(Path(ensure_default_model()).resolve())
    vocab = json.loads((Path(model_dir) / "config.json").read_text())["vocab_size"]
    result: dict = {"started": time.strftime("%Y-%m-%d %H:%M:%S"), "args": vars(args), "runs": {}}
    children = Children()
    try:
        for label, extra in (("fair", []), ("fifo", ["--no-fair-queuing"])):
            worker = children.spawn_service(label, "tokenfleet.services.decode", "--model", model_dir, "--threads", "1",
                                            "--max-num-running", "4", *extra, threads=1)
            result["runs"][label] = asyncio.run(run(worker.address, args, vocab, children.plane("gateway")))
            print(label, json.dumps(result["runs"][label]), flush=True)
            children.stop(worker)
    finally:
        children.stop_all()
        children.remove_logs()
    fair, fifo = result["runs"]["fair"], result["runs"]["fifo"]
    result["b_ttft_p50_ratio_fifo_over_fair"] = fifo["B"]["p50_ms"] / fair["B"]["p50_ms"]
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    lines = [f"# Fair queuing\n\n{result['started']}: tenant A floods {args.flood} requests at once, tenant B sends "
             f"{args.b_requests}, one every {args.period} s; one worker, 1 thread, 4 running at most; "
             f"{args.prompt_len}-token prompts, {args.output_len} output tokens.\n",
             "| queue | B TTFT p50 ms | B max | A TTFT p50 ms | A max |", "|---|---|---|---|---|"]
    for label, r in result["runs"].items():
        lines.append(f"| {label} | {r['B']['p50_ms']:.0f} | {r['B']['max_ms']:.0f} | {r['A']['p50_ms']:.0f} | "
                     f"{r['A']['max_ms']:.0f} |")
    lines.append(f"\nB's TTFT p50, arrival order / fair: {result['b_ttft_p50_ratio_fifo_over_fair']:.1f}x")
    report = "\n".join(lines) + "\n"
    out.with_suffix(".md").write_text(report)
    print(report)


if __name__ == "__main__":
    main()
