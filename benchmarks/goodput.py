"""Goodput under SLO: the highest offered request rate at which >= 90 % of requests meet both objectives.

The workload is fixed in benchmarks/serving/mixed_workload.py (seeds committed before any tuning):
open-loop Poisson arrivals; 70 % chat prompts of 64-512 tokens, 20 % one of 8 shared 1,500-token prefixes
plus 64-256 new tokens, 10 % prompts of 2,000-3,000 tokens; 32-256 output tokens; streamed
/v1/completions with token-id prompts, greedy, `ignore_eos`. Objectives (this 2-core CPU): TTFT <= 0.5 s
+ 1 ms per prompt token, TPOT <= 100 ms; a request that errors or never gets a token misses. The
definitions (``Objectives.met``, ``goodput_rate``) are tokenfleet/planning/metrics.py's, the simulator's.

Per system and round: the server is started fresh; its answers are checked first (greedy, the Japan
question must say Tokyo; four more prompts from tests/data/correctness_prompts.json, whose first 16
tokens are compared across systems and reported as a match rate); 4 untimed warm-up requests; then the
rates of the ladder (--start-rate x --factor^i) are offered one after another, --requests each, each run
drained before the next, until one's attainment falls below 90 %. A run stops early once misses make 90 %
impossible (its attainment is then an upper bound, marked). Goodput = the highest rate before the first
miss. Systems alternate in order each round; the bar is the median over rounds of tokenfleet's goodput /
the peer's, and the attainment-vs-rate curve of every run is drawn to a PNG beside the report.

Systems: ``tokenfleet`` = `tokenfleet up` on its defaults (dtype auto: the machine's fastest, models.auto_dtype),
``tokenfleet:bf16`` = `tokenfleet up --dtype bfloat16`, ``vllm:SPEC`` = vLLM-CPU in the configuration SPEC
(benchmarks/serving/vllm_configs.py, dtype included; the best ones benchmarks/peer_sweep.py found).

    .venv/bin/python benchmarks/goodput.py --vllm-python VLLM_VENV/bin/python \\
        --systems tokenfleet vllm:bind=0-1,tcmalloc [--rounds 3] [--start-rate 0.3] [--factor 1.25] \\
        [--requests 30] [--out benchmarks/reports/DATE-cpu-goodput.json]
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path

from serving import mixed_workload as workload
from serving.answers import check_answers
from serving.cores import CoreMonitor
from serving.goodput_report import TOKENFLEET, answer_match, markdown, plot, ratios
from serving.load import httpx, sse_events
from serving.procs import Child, Children
from serving.report import git_head, machine_line, report_path, write_report
from serving.vllm_configs import parse

from tokenfleet.planning.metrics import ATTAINMENT_TARGET, Objectives, goodput_rate

REPO = Path(__file__).resolve().parent.parent


@dataclass
class Flight:
    """One request in flight: what the watcher and the summary read. Times are perf_counter seconds; TTFT
    counts from the request's scheduled arrival (open loop: a client that wakes late must not hide it)."""

    request: workload.Request
    scheduled: float | None = None
    sent: float | None = None
    first: float | None = None
    last: float | None = None
    tokens: int = 0
    error: str | None = None
    done: bool = False  # the stream ended (cleanly or not)
    complete: bool = False  # it ended cleanly with exactly the tokens asked for
    cancelled: bool = False
    objectives: Objectives = workload.OBJECTIVES  # what the early stop judges by

    @property
    def ttft(self) -> float | None:
        return None if self.first is None or self.scheduled is None else self.first - self.scheduled

    @property
    def tpot(self) -> float | None:
        if self.first is None or self.last is None or self.tokens < 2:
            return None
        return (self.last - self.first) / (self.tokens - 1)

    def met(self, objectives: Objectives | None = None) -> bool:
        o = objectives or self.objectives
        return self.complete and not self.cancelled and o.met(self.ttft, self.tpot, len(self.request.prompt))

    def certain_miss(self, now: float) -> bool:
        """Missed already, whatever happens next."""
        if self.done:
            return not self.met()
        if self.scheduled is None:
            return False
        if self.first is None:
            return now - self.scheduled > self.objectives.ttft_limit(len(self.request.prompt))
        # the last token comes no earlier than the latest seen: TPOT >= (latest - first) / (tokens asked - 1)
        assert self.last is not None
        return (self.last - self.first) / max(1, self.request.max_tokens - 1) > self.objectives.tpot_s


async def stream(client: httpx.AsyncClient, model: str, flight: Flight) -> None:
    body = {"model": model, "prompt": flight.request.prompt, "max_tokens": flight.request.max_tokens,
            "temperature": 0.0, "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    flight.sent = time.perf_counter()
    usage = 0
    try:
        async with client.stream("POST", "/v1/completions", json=body) as response:
            if response.status_code != 200:
                flight.error = f"HTTP {response.status_code}: {(await response.aread()).decode(errors='replace')[:200]}"
                return
            async for event in sse_events(response):
                choices = event.get("choices")
                if choices:
                    # a token chunk, or the finish chunk: that one may carry the last token with text held back
                    # (vLLM) or come right after it (tokenfleet), so it stamps `last` either way
                    now = time.perf_counter()
                    if flight.first is None and (choices[0].get("text") or choices[0].get("finish_reason") is None):
                        flight.first = now
                    flight.last = now
                if event.get("usage"):
                    usage = int(event["usage"]["completion_tokens"] or 0)
        flight.tokens = usage
        if usage != flight.request.max_tokens:
            flight.error = f"{usage} tokens, asked {flight.request.max_tokens}"
        else:
            flight.complete = True
    except Exception as e:  # noqa: BLE001 - any failure of one request is that request's miss, not the run's
        flight.error = f"{type(e).__name__}: {e}"[:200]
    finally:
        flight.done = True


async def open_loop(url: str, model: str, requests: list[workload.Request], drain_s: float,
                    early_abort: bool = True, objectives: Objectives = workload.OBJECTIVES) -> tuple[list[Flight], bool]:
    """Offer ``requests`` at their offsets; returns the flights and whether the run was stopped early (more
    certain misses than 90 % allows, or still running ``drain_s`` after the last arrival: a miss either way)."""
    flights = [Flight(r, objectives=objectives) for r in requests]
    allowed = int(len(flights) * (1 - ATTAINMENT_TARGET) + 1e-9)  # misses that still leave >= 90 %
    limits = httpx.Limits(max_connections=len(flights) + 8, max_keepalive_connections=len(flights) + 8)
    aborted = False
    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(drain_s + 600), limits=limits) as client:
        start = time.perf_counter()

        async def one(flight: Flight) -> None:
            flight.scheduled = start + flight.request.offset_s
            await asyncio.sleep(max(0.0, flight.scheduled - time.perf_counter()))
            await stream(client, model, flight)

        tasks = [asyncio.create_task(one(f)) for f in flights]
        deadline = start + requests[-1].offset_s + drain_s
        while not all(t.done() for t in tasks):
            await asyncio.sleep(0.25)
            now = time.perf_counter()
            if now > deadline or (early_abort and sum(f.certain_miss(now) for f in flights) > allowed):
                aborted = True
                for flight, task in zip(flights, tasks):
                    if not task.done():
                        flight.cancelled = True
                        task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
                break
    return flights, aborted


def summarize_run(flights: list[Flight], aborted: bool, sets: dict[str, Objectives]) -> dict:
    """Attainment under each objective set (the first is the bar's), per class too, and every request."""
    attainment, by_kind = {}, {}
    for name, o in sets.items():
        attainment[name] = sum(f.met(o) for f in flights) / len(flights)
        kinds: dict[str, dict[str, int]] = {}
        for f in flights:
            entry = kinds.setdefault(f.request.kind, {"met": 0, "of": 0})
            entry["met"] += f.met(o)
            entry["of"] += 1
        by_kind[name] = kinds
    ttft = sorted(f.ttft for f in flights if f.ttft is not None)
    tpot = sorted(f.tpot for f in flights if f.tpot is not None)

    def pct(values: list[float], q: float) -> float | None:
        return values[min(len(values) - 1, int(q * len(values)))] if values else None

    errors = [f.error for f in flights if f.error and not f.cancelled]
    lags = sorted(f.sent - f.scheduled for f in flights if f.sent is not None and f.scheduled is not None)
    primary = next(iter(sets))
    return {"requests": len(flights), "attainment": attainment[primary], "attainment_by": attainment,
            "aborted": aborted,
            "send_lag_max_ms": 1000 * lags[-1] if lags else None,
            "cancelled": sum(f.cancelled for f in flights), "errors": errors[:5], "num_errors": len(errors),
            "by_kind": by_kind,
            "records": [[f.request.kind, len(f.request.prompt), f.request.max_tokens, f.ttft, f.tpot, f.complete]
                        for f in flights],
            "ttft_p50_s": pct(ttft, 0.5), "ttft_p90_s": pct(ttft, 0.9), "tpot_p50_s": pct(tpot, 0.5),
            "tpot_p90_s": pct(tpot, 0.9),
            "output_tokens": sum(f.tokens for f in flights if f.done and not f.cancelled)}


# ---------------------------------------------------------------------------------------------- servers


def start(children: Children, system: str, model_dir: str, model_name: str, vllm_python: str) -> Child:
    from serve_peer import start_tokenfleet, start_vllm

    if system in TOKENFLEET:
        child, url = start_tokenfleet(children, model_name, TOKENFLEET[system])
    elif system.startswith("vllm:"):
        child, url = start_vllm(children, vllm_python, model_dir, model_name, parse(system.removeprefix("vllm:")))
    else:
        raise ValueError(f"unknown system {system!r} (tokenfleet | vllm:SPEC)")
    child.address = url
    return child


def run_system(args: argparse.Namespace, children: Children, system: str, round_index: int, model_dir: str,
               model_name: str, vocab: int) -> dict:
    sets = objective_sets(args)
    control = sets[args.control]
    entry: dict = {"system": system, "round": round_index, "runs": [], "goodput_rps": None, "censored": False,
                   "goodput": {name: None for name in sets}}
    started = time.monotonic()
    try:
        child = start(children, system, model_dir, model_name, args.vllm_python)
    except Exception as e:  # noqa: BLE001 - a server that cannot start is a result (reported), not the end of the run
        entry["error"] = f"did not start: {type(e).__name__}: {str(e)[-400:]}"
        print(f"{system} round {round_index}: {entry['error']}", flush=True)
        return entry
    entry["startup_s"] = time.monotonic() - started
    try:
        entry["answers"] = check_answers(child.address, model_name)
        entry["tokyo"] = "Tokyo" in entry["answers"]["japan"]
        if not entry["tokyo"]:
            print(f"{system}: the Japan answer lacks Tokyo: {entry['answers']['japan']!r}", flush=True)
        warm, _ = asyncio.run(open_loop(child.address, model_name, workload.warmup(vocab), drain_s=600,
                                        early_abort=False))
        entry["warmup_errors"] = [f.error for f in warm if f.error]
        for step, rate in enumerate(workload.ladder(args.start_rate, args.factor, args.max_steps)):
            requests = workload.requests(rate, args.requests, vocab, round_index, step)
            with CoreMonitor({system: child.proc.pid, "client": os.getpid()}) as monitor:
                flights, aborted = asyncio.run(open_loop(child.address, model_name, requests, args.drain_s,
                                                         objectives=control))
            cpu: dict[str, float] = {}
            for proc in monitor.report()["processes"]:
                cpu[proc["label"]] = round(cpu.get(proc["label"], 0.0) + proc["cpu_pct"], 1)
            run = {"rate": rate, "step": step, **summarize_run(flights, aborted, sets),
                   "cpu_pct": {k: v for k, v in cpu.items() if v >= 1}}
            entry["runs"].append(run)
            shares = ", ".join(f"{name} {v:.2f}" for name, v in run["attainment_by"].items())
            print(f"{system:>32} round {round_index} rate {rate:5.3f}/s attainment {shares}"
                  f"{' (stopped early)' if aborted else ''}  TTFT p50 {run['ttft_p50_s'] or 0:.2f} s  "
                  f"TPOT p50 {1000 * (run['tpot_p50_s'] or 0):.0f} ms  errors {run['num_errors']}  "
                  f"send lag max {run['send_lag_max_ms'] or 0:.0f} ms", flush=True)
            if aborted or run["attainment_by"][args.control] < ATTAINMENT_TARGET:
                break
        else:
            entry["censored"] = True  # never missed: goodput is at least the top of the ladder
    except Exception as e:  # noqa: BLE001
        entry["error"] = f"{type(e).__name__}: {str(e)[-400:]}"
        print(f"{system} round {round_index}: {entry['error']}", flush=True)
    finally:
        children.stop(child, timeout=60)
    for name in sets:
        entry["goodput"][name] = goodput_rate([(r["rate"], 0.0 if r["aborted"] else r["attainment_by"][name])
                                               for r in entry["runs"]])
    # never missed under the control set (the loosest): the others may have missed, and are then not censored
    entry["censored_by"] = {name: entry["censored"] and all(r["attainment_by"][name] >= ATTAINMENT_TARGET
                                                              for r in entry["runs"]) for name in sets}
    entry["goodput_rps"] = entry["goodput"][next(iter(sets))]
    return entry


def objective_sets(args: argparse.Namespace) -> dict[str, Objectives]:
    """``fixed``: the workload's objectives (the bar); ``machine``: the same with the TTFT allowance per prompt
    token given by --machine-ttft-per-token-ms, for a CPU that cannot prefill at the fixed rate."""
    sets = {"fixed": workload.OBJECTIVES}
    if args.machine_ttft_per_token_ms:
        sets["machine"] = dataclasses.replace(workload.OBJECTIVES,
                                              ttft_per_prompt_token_s=args.machine_ttft_per_token_ms / 1000)
    return sets


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vllm-python", default=os.environ.get("VLLM_PYTHON"), help="python of a vLLM-CPU virtualenv")
    parser.add_argument("--systems", nargs="+", default=["tokenfleet", "vllm:bind=0-1"],
                        help="tokenfleet (up's defaults) | tokenfleet:bf16 | vllm:SPEC; ratios are the first tokenfleet "
                             "system's over each vllm one")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--start-rate", type=float, default=0.3)
    parser.add_argument("--factor", type=float, default=1.25)
    parser.add_argument("--max-steps", type=int, default=12)
    parser.add_argument("--requests", type=int, default=30, help="requests offered per rate")
    parser.add_argument("--drain-s", type=float, default=120.0, help="after the last arrival, before a run is cut")
    parser.add_argument("--machine-ttft-per-token-ms", type=float, default=0.0,
                        help="also judge by a second objective set, `machine`, whose TTFT allowance per prompt token is "
                             "this (for a CPU that cannot prefill at 1 ms per token); it then steps the rates")
    parser.add_argument("--control", choices=["fixed", "machine"], default=None,
                        help="the objective set that stops the ladder (default: machine when given, else fixed)")
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "reports" / f"{time.strftime('%Y-%m-%d')}-cpu-goodput.json"))
    args = parser.parse_args()
    args.control = args.control or ("machine" if args.machine_ttft_per_token_ms else "fixed")
    if args.control == "machine" and not args.machine_ttft_per_token_ms:
        parser.error("--control machine needs --machine-ttft-per-token-ms")
    if any(s.startswith("vllm:") for s in args.systems) and not args.vllm_python:
        parser.error("--vllm-python (or $VLLM_PYTHON) for the vllm systems")
    for s in args.systems:
        if s.startswith("vllm:"):
            parse(s.removeprefix("vllm:"))  # a typo fails now, not an hour in

    from serve_peer import _vllm_version

    from tokenfleet.models.gguf_import import DEFAULT_MODEL_NAME, ensure_default_model
    from tokenfleet.models.tokenizer import Tokenizer

    model_dir = str(Path(ensure_default_model()).resolve())
    vocab = Tokenizer(model_dir).vocab_size
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    children = Children()
    result: dict = {"started": time.strftime("%Y-%m-%d %H:%M:%S"), "args": vars(args), "git": git_head(),
                    "machine": machine_line(), "model": DEFAULT_MODEL_NAME, "seed": workload.SEED,
                    "objectives": {n: dataclasses.asdict(o) for n, o in objective_sets(args).items()},
                    "classes": workload.CLASSES, "entries": []}
    if args.vllm_python:
        result["vllm_version"] = _vllm_version(args.vllm_python)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    try:
        for r in range(args.rounds):
            for system in args.systems if r % 2 == 0 else args.systems[::-1]:
                result["entries"].append(run_system(args, children, system, r, model_dir, DEFAULT_MODEL_NAME, vocab))
                out.with_suffix(".partial.json").write_text(json.dumps(result, indent=2))
    finally:
        children.stop_all()
    result["ratios"] = {name: ratios(result["entries"], args.systems, args.rounds, name) for name in result["objectives"]}
    result["ratio_of"] = next((s for s in args.systems if s in TOKENFLEET), "tokenfleet")
    result["answer_match"] = answer_match(result["entries"])
    final = report_path(out)  # the plot is named after the report, never over an earlier report's
    result["plot"] = str(final.with_suffix(".png"))
    plot(result, Path(result["plot"]))
    write_report(final, result, markdown(result))
    out.with_suffix(".partial.json").unlink(missing_ok=True)


if __name__ == "__main__":
    main()
