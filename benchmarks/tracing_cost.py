"""What tracing costs (`tokenfleet up --tracing`): CPU-seconds per request of the serving processes with traces on vs off.

The serving benchmark's tokenfleet cluster (etcd, one worker `--role both`, router, gateway on mutual TLS; serve.py's
`Tokenfleet`) is started fresh for each run, with `TOKENFLEET_TRACING=1 TOKENFLEET_TRACE_SAMPLE=1.0` or without,
its spans exported over OTLP/HTTP to a receiver in this script (which decodes every export request as a collector
would). Each run sends --num-prompts fresh random prompts at --concurrency (32) through the gateway and takes the
CPU time (user + system) every cluster process used during the timed load, over the requests served. Runs
alternate off / on; the figure is the median of the on/off ratios of each pair, every run listed.

    .venv/bin/python benchmarks/tracing_cost.py --runs 3      # ~8 min here
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import psutil
from serve import Tokenfleet
from serving.load import fresh_prompts, http_load, summarize
from serving.procs import Children

REPORTS = Path(__file__).parent / "reports"


class Receiver(BaseHTTPRequestHandler):
    spans = 0

    def do_POST(self):  # noqa: N802 - http.server's name
        from opentelemetry.proto.collector.trace.v1 import trace_service_pb2

        request = trace_service_pb2.ExportTraceServiceRequest.FromString(
            self.rfile.read(int(self.headers["Content-Length"])))
        Receiver.spans += sum(len(s.spans) for r in request.resource_spans for s in r.scope_spans)
        self.send_response(200)
        self.end_headers()

    def log_message(self, *args):
        pass


def cpu_seconds(pids: list[int]) -> float:
    """User + system CPU of these processes and their children (threads included)."""
    total = 0.0
    for pid in pids:
        try:
            proc = psutil.Process(pid)
            for p in [proc, *proc.children(recursive=True)]:
                t = p.cpu_times()
                total += t.user + t.system
        except psutil.NoSuchProcess:
            continue
    return total


def run_once(tracing: bool, seed: int, args: argparse.Namespace, model_dir: str, vocab: int, endpoint: str) -> dict:
    for key in ("TOKENFLEET_TRACING", "TOKENFLEET_TRACE_SAMPLE", "OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_BSP_SCHEDULE_DELAY"):
        os.environ.pop(key, None)
    if tracing:
        os.environ.update({"TOKENFLEET_TRACING": "1", "TOKENFLEET_TRACE_SAMPLE": "1.0",
                           "OTEL_EXPORTER_OTLP_ENDPOINT": endpoint})
    children = Children()
    try:
        system = Tokenfleet(children, model_dir, "smol", args.worker_threads, direct=False)
        pids = list(system.roots().values())
        warm = fresh_prompts(args.num_warmups, args.input_len, vocab, seed + 1_000_000)
        asyncio.run(http_load(system.url, "smol", warm, args.concurrency, args.output_len))
        spans_before = Receiver.spans
        prompts = fresh_prompts(args.num_prompts, args.input_len, vocab, seed)
        before = cpu_seconds(pids)
        results, wall = asyncio.run(http_load(system.url, "smol", prompts, args.concurrency, args.output_len))
        used = cpu_seconds(pids) - before
        time.sleep(1.0)  # the last batch of spans
        summary = summarize(results, wall, args.output_len)
        ok = summary["completed"]
        return {"tracing": tracing, "cpu_s": used, "requests_ok": ok, "cpu_s_per_request": used / max(1, ok),
                "wall_s": wall, "spans_exported": Receiver.spans - spans_before, "summary": summary}
    finally:
        children.stop_all()
        children.remove_logs()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--num-prompts", type=int, default=96)
    p.add_argument("--num-warmups", type=int, default=8)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--worker-threads", type=int, default=1)
    p.add_argument("--name", default="cpu-tracing-cost")
    args = p.parse_args()
    from tokenfleet.models.gguf_import import ensure_default_model

    model_dir = str(Path(ensure_default_model()).resolve())
    vocab = json.loads((Path(model_dir) / "config.json").read_text())["vocab_size"]
    receiver = ThreadingHTTPServer(("127.0.0.1", 0), Receiver)
    threading.Thread(target=receiver.serve_forever, daemon=True).start()
    endpoint = f"http://127.0.0.1:{receiver.server_port}"
    runs = []
    for k in range(args.runs):
        for tracing in (False, True):
            r = run_once(tracing, 20261125 + 1000 * k, args, model_dir, vocab, endpoint)
            r["run"] = k
            runs.append(r)
            print(f"run {k} tracing={'on' if tracing else 'off'}: {r['cpu_s_per_request'] * 1000:.1f} ms CPU/request "
                  f"({r['cpu_s']:.1f} s over {r['requests_ok']} requests, {r['wall_s']:.1f} s), spans exported "
                  f"{r['spans_exported']}", file=sys.stderr, flush=True)
    ratios = [on["cpu_s_per_request"] / off["cpu_s_per_request"] for off, on in zip(runs[::2], runs[1::2], strict=True)]
    out = {"args": vars(args), "runs": runs, "ratios": ratios, "median_ratio": statistics.median(ratios)}
    stamp = time.strftime("%Y-%m-%d")
    (REPORTS / f"{stamp}-{args.name}.json").write_text(json.dumps(out, indent=1))
    (REPORTS / f"{stamp}-{args.name}.md").write_text(report(out))
    print(report(out))


def report(out: dict) -> str:
    a = out["args"]
    lines = ["## What tracing costs", "",
             f"A fresh cluster per run (etcd, one worker `--role both --threads {a['worker_threads']}`, router, gateway, "
             f"mutual TLS), {a['num_prompts']} requests of {a['input_len']} prompt tokens and {a['output_len']} output "
             f"tokens at concurrency {a['concurrency']} through the gateway; with tracing on, every request traced "
             "(sample ratio 1.0) and exported over OTLP/HTTP to a receiver in the benchmark script. CPU: user + "
             "system seconds of every cluster process during the timed load, per request served. Runs alternate "
             "off / on on one 2-core machine.", "",
             f"**CPU-seconds per request, tracing on / off: {out['median_ratio']:.3f}x** (median of the "
             f"{len(out['ratios'])} pairs: {', '.join(f'{r:.3f}' for r in out['ratios'])}).", "",
             "| run | tracing | CPU ms / request | CPU s | requests | wall s | output tok/s | TTFT p50 ms | spans exported |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in out["runs"]:
        s = r["summary"]
        lines.append(f"| {r['run']} | {'on' if r['tracing'] else 'off'} | {r['cpu_s_per_request'] * 1000:.1f} | "
                     f"{r['cpu_s']:.1f} | {r['requests_ok']} | {r['wall_s']:.1f} | {s['out_tok_s']:.1f} | "
                     f"{s['ttft_ms']['p50'] or 0:.0f} | {r['spans_exported']} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
