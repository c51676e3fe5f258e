"""Goodput under SLO: the highest offered request rate at which >= 90 % of requests meet both objectives.

The workload is fixed in benchmarks/serving/mixed_workload.py (seeds committed before any tuning):
open-loop Poisson arrivals; 70 % chat prompts of 64-512 tokens, 20 % one of 8 shared 1,500-token prefixes
plus 64-256 new tokens, 10 % prompts of 2,000-3,000 tokens; 32-256 output tokens; streamed
/v1/completions with token-id prompts, greedy, `ignore_eos`. Objectives (this 2-core CPU): TTFT <= 0.5 s
+ 1 ms per prompt token, TPOT <= 100 ms; a request that errors or never gets a token misses. The
definitions (``Objectives.met``, ``goodput_rate``) are tokenfleet/planning/metrics.py's, the simulator's.

Per system and round: the server is started fresh; its answers are checked first (greedy, the France
question must say Paris; three more prompts from tests/data/correctness_prompts.json, whose first 16
tokens are compared across systems and reported as a match rate); 4 untimed warm-up requests; then the
rates of the ladder (--start-rate x --factor^i) are offered one after another, --requests each, each run
drained before the next, until one's attainment falls below 90 %. A run stops early once misses make 90 %
impossible (its attainment is then an upper bound, marked). Goodput = the highest rate before the first
miss. Systems alternate in order each round; the bar is the median over rounds of tokenfleet's goodput /
the peer's, and the attainment-vs-rate curve of every run is drawn to a PNG beside the report.

Systems: ``tokenfleet`` = `tokenfleet up --dtype bfloat16` (otherwise its defaults; the peers serve bf16),
``vllm:SPEC`` = vLLM-CPU in the configuration SPEC (benchmarks/serving/vllm_configs.py; the best ones
benchmarks/peer_sweep.py found).

    .venv/bin/python benchmarks/goodput.py --vllm-python VLLM_VENV/bin/python \\
        --systems tokenfleet vllm:bind=0-1,tcmalloc [--rounds 3] [--start-rate 0.3] [--factor 1.25] \\
        [--requests 30] [--out benchmarks/reports/goodput.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from serving import mixed_workload as workload
from serving.cores import CoreMonitor
from serving.load import httpx
from serving.procs import Child, Children
from serving.report import git_head, machine_line, write_report
from serving.vllm_configs import parse

from tokenfleet.planning.metrics import ATTAINMENT_TARGET, goodput_rate

REPO = Path(__file__).resolve().parent.parent
CHECK_IDS = ("france", "colors", "water", "town")
CHECK_TOKENS = 16


@dataclass
class Flight:
    """One request in flight: what the watcher and the summary read."""

    request: workload.Request
    sent: float | None = None
    first: float | None = None
    last: float | None = None
    tokens: int = 0
    error: str | None = None
    done: bool = False
    cancelled: bool = False

    @property
    def ttft(self) -> float | None:
        return None if self.first is None or self.sent is None else self.first - self.sent

    @property
    def tpot(self) -> float | None:
        if self.first is None or self.last is None or self.tokens < 2:
            return None
        return (self.last - self.first) / (self.tokens - 1)

    def met(self) -> bool:
        return (self.done and self.error is None
                and workload.OBJECTIVES.met(self.ttft, self.tpot, len(self.request.prompt)))

    def certain_miss(self, now: float) -> bool:
        """Missed already, whatever happens next."""
        if self.done:
            return not self.met()
        if self.sent is None:
            return False
        limit = workload.OBJECTIVES.ttft_limit(len(self.request.prompt))
        if self.first is None:
            return now - self.sent > limit
        # even if every remaining token came at once, the mean gap so far already exceeds the TPOT objective
        remaining_min = max(1, self.request.max_tokens - 1)
        return (now - self.first) / remaining_min > workload.OBJECTIVES.tpot_s


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
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                event = json.loads(data)
                if event.get("choices") and (event["choices"][0].get("text") or event["choices"][0].get(
                        "finish_reason") is None):
                    now = time.perf_counter()
                    flight.first = now if flight.first is None else flight.first
                    flight.last = now
                if event.get("usage"):
                    usage = int(event["usage"]["completion_tokens"])
        flight.tokens = usage
        if usage != flight.request.max_tokens:
            flight.error = f"{usage} tokens, asked {flight.request.max_tokens}"
    except (httpx.HTTPError, json.JSONDecodeError, KeyError, ValueError) as e:
        flight.error = f"{type(e).__name__}: {e}"[:200]
    finally:
        flight.done = True


async def open_loop(url: str, model: str, requests: list[workload.Request], drain_s: float) -> tuple[list[Flight], bool]:
    """Offer ``requests`` at their offsets; returns the flights and whether the run stopped early."""
    flights = [Flight(r) for r in requests]
    allowed = int(len(flights) * (1 - ATTAINMENT_TARGET) + 1e-9)  # misses that still leave >= 90 %
    limits = httpx.Limits(max_connections=len(flights) + 8, max_keepalive_connections=len(flights) + 8)
    aborted = False
    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(drain_s + 600), limits=limits) as client:
        start = time.perf_counter()

        async def one(flight: Flight) -> None:
            await asyncio.sleep(max(0.0, start + flight.request.offset_s - time.perf_counter()))
            await stream(client, model, flight)

        tasks = [asyncio.create_task(one(f)) for f in flights]
        deadline = start + requests[-1].offset_s + drain_s
        while not all(t.done() for t in tasks):
            await asyncio.sleep(0.25)
            now = time.perf_counter()
            if sum(f.certain_miss(now) for f in flights) > allowed or now > deadline:
                aborted = True
                for flight, task in zip(flights, tasks):
                    if not task.done():
                        flight.cancelled = True
                        task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
                break
    return flights, aborted


def summarize_run(flights: list[Flight], aborted: bool) -> dict:
    met = sum(f.met() for f in flights)
    by_kind: dict[str, list[int]] = {}
    for f in flights:
        entry = by_kind.setdefault(f.request.kind, [0, 0])
        entry[0] += f.met()
        entry[1] += 1
    ttft = sorted(f.ttft for f in flights if f.ttft is not None)
    tpot = sorted(f.tpot for f in flights if f.tpot is not None)

    def pct(values: list[float], q: float) -> float | None:
        return values[min(len(values) - 1, int(q * len(values)))] if values else None

    errors = [f.error for f in flights if f.error and not f.cancelled]
    return {"requests": len(flights), "met": met, "attainment": met / len(flights), "aborted": aborted,
            "cancelled": sum(f.cancelled for f in flights), "errors": errors[:5], "num_errors": len(errors),
            "by_kind": {k: {"met": v[0], "of": v[1]} for k, v in by_kind.items()},
            "ttft_p50_s": pct(ttft, 0.5), "ttft_p90_s": pct(ttft, 0.9), "tpot_p50_s": pct(tpot, 0.5),
            "tpot_p90_s": pct(tpot, 0.9),
            "output_tokens": sum(f.tokens for f in flights if f.done and not f.cancelled)}


# ---------------------------------------------------------------------------------------------- servers


def start(children: Children, system: str, model_dir: str, model_name: str, vllm_python: str) -> Child:
    from serve_peer import start_tokenfleet, start_vllm

    if system == "tokenfleet":
        child, url = start_tokenfleet(children, model_name, [])
    elif system.startswith("vllm:"):
        child, url = start_vllm(children, vllm_python, model_dir, model_name, parse(system.removeprefix("vllm:")))
    else:
        raise ValueError(f"unknown system {system!r} (tokenfleet | vllm:SPEC)")
    child.address = url
    return child


def check_answers(url: str, model: str) -> dict[str, str]:
    """Greedy answers (16 tokens) to a few correctness prompts (the report flags a France answer without Paris)."""
    prompts = {p["id"]: p for p in json.loads((REPO / "tests" / "data" / "correctness_prompts.json").read_text())["prompts"]}
    answers = {}
    with httpx.Client(base_url=url, timeout=300) as client:
        for pid in CHECK_IDS:
            p = prompts[pid]
            body = {"model": model, "max_tokens": CHECK_TOKENS, "temperature": 0.0}
            if "chat" in p:
                messages = [{"role": "user", "content": p["chat"]}]
                response = client.post("/v1/chat/completions", json={**body, "messages": messages})
                answers[pid] = response.json()["choices"][0]["message"]["content"]
            else:
                response = client.post("/v1/completions", json={**body, "prompt": p["completion"]})
                answers[pid] = response.json()["choices"][0]["text"]
    return answers


def run_system(args: argparse.Namespace, children: Children, system: str, round_index: int, model_dir: str,
               model_name: str, vocab: int) -> dict:
    started = time.monotonic()
    child = start(children, system, model_dir, model_name, args.vllm_python)
    entry: dict = {"system": system, "round": round_index, "startup_s": time.monotonic() - started, "runs": []}
    try:
        entry["answers"] = check_answers(child.address, model_name)
        entry["paris"] = "Paris" in entry["answers"]["france"]
        if not entry["paris"]:
            print(f"{system}: the France answer lacks Paris: {entry['answers']['france']!r}", flush=True)
        asyncio.run(open_loop(child.address, model_name, workload.warmup(vocab), drain_s=600))
        for step, rate in enumerate(workload.ladder(args.start_rate, args.factor, args.max_steps)):
            requests = workload.requests(rate, args.requests, vocab, round_index, step)
            with CoreMonitor({system: child.proc.pid, "client": os.getpid()}) as monitor:
                flights, aborted = asyncio.run(open_loop(child.address, model_name, requests, args.drain_s))
            run = {"rate": rate, "step": step, **summarize_run(flights, aborted),
                   "cpu_pct": {p["label"]: round(p["cpu_pct"], 1) for p in monitor.report()["processes"]
                               if p["cpu_pct"] >= 1}}
            entry["runs"].append(run)
            print(f"{system:>32} round {round_index} rate {rate:5.3f}/s attainment {run['attainment']:.2f}"
                  f"{' (stopped early)' if aborted else ''}  TTFT p50 {run['ttft_p50_s'] or 0:.2f} s  "
                  f"TPOT p50 {1000 * (run['tpot_p50_s'] or 0):.0f} ms  errors {run['num_errors']}", flush=True)
            if run["attainment"] < ATTAINMENT_TARGET:
                break
    finally:
        children.stop(child, timeout=60)
    entry["goodput_rps"] = goodput_rate([(r["rate"], r["attainment"]) for r in entry["runs"]])
    return entry


# ---------------------------------------------------------------------------------------------- report


def ratios(entries: list[dict], systems: list[str], rounds: int) -> dict[str, dict]:
    """Per peer: each round's tokenfleet goodput / the peer's, and their median (the bar)."""
    out = {}
    for peer in systems:
        if peer == "tokenfleet":
            continue
        per_round = []
        for r in range(rounds):
            ours = next((e for e in entries if e["system"] == "tokenfleet" and e["round"] == r), None)
            theirs = next((e for e in entries if e["system"] == peer and e["round"] == r), None)
            if ours and theirs and ours["goodput_rps"] and theirs["goodput_rps"]:
                per_round.append(ours["goodput_rps"] / theirs["goodput_rps"])
        out[peer] = {"rounds": per_round, "median": statistics.median(per_round) if per_round else None}
    return out


def plot(result: dict, path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib missing: no curve drawn", file=sys.stderr)
        return
    fig, ax = plt.subplots(figsize=(8, 5))
    colors = {s: f"C{i}" for i, s in enumerate(result["args"]["systems"])}
    for e in result["entries"]:
        xs = [r["rate"] for r in e["runs"]]
        ys = [r["attainment"] for r in e["runs"]]
        ax.plot(xs, ys, marker="o", color=colors[e["system"]], alpha=0.8,
                label=e["system"] if e["round"] == 0 else None, linestyle=["-", "--", ":"][e["round"] % 3])
    ax.axhline(ATTAINMENT_TARGET, color="grey", linewidth=0.8)
    ax.set_xlabel("offered rate (requests/s)")
    ax.set_ylabel("share of requests meeting TTFT and TPOT objectives")
    ax.set_title("SLO attainment vs offered rate (one line per system and round)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def markdown(result: dict) -> str:
    a = result["args"]
    o = workload.OBJECTIVES
    lines = [f"# Goodput under SLO ({result['started']})", "",
             f"Workload: benchmarks/serving/mixed_workload.py (seed {workload.SEED}), {a['requests']} requests per "
             f"rate, rates {a['start_rate']} x {a['factor']}^i. Objectives: TTFT <= {o.ttft_s:.1f} s + "
             f"{1000 * o.ttft_per_prompt_token_s:.0f} ms per prompt token, TPOT <= {1000 * o.tpot_s:.0f} ms; goodput = "
             f"the highest rate before the first with attainment < {ATTAINMENT_TARGET:.0%}. {a['rounds']} rounds, servers "
             f"restarted per round, order alternating. Machine: {result['machine']}. git {result['git']}.", "",
             "tokenfleet: `tokenfleet up --dtype bfloat16` (defaults otherwise). vLLM-CPU "
             f"{result.get('vllm_version', '?')}: `vllm serve --dtype bfloat16 --max-model-len 4096` in the named "
             "configuration (benchmarks/serving/vllm_configs.py).", "",
             "## Goodput (requests/s)", "", "| system | " + " | ".join(f"round {r}" for r in range(a["rounds"])) + " |",
             "|---|" + "---|" * a["rounds"]]
    for system in a["systems"]:
        cells = []
        for r in range(a["rounds"]):
            e = next((x for x in result["entries"] if x["system"] == system and x["round"] == r), None)
            cells.append("–" if e is None else (f"{e['goodput_rps']:.3f}" if e["goodput_rps"] else "< lowest rate"))
        lines.append(f"| {system} | " + " | ".join(cells) + " |")
    lines += ["", "## tokenfleet / peer (per round; median is the bar: >= 1.2)", ""]
    for peer, entry in result["ratios"].items():
        rounds = " · ".join(f"{x:.2f}" for x in entry["rounds"]) or "–"
        median = f"**{entry['median']:.2f}**" if entry["median"] is not None else "–"
        lines.append(f"- vs `{peer}`: {rounds} (median {median})")
    lines += ["", f"Curve: `{Path(result['plot']).name}`.", "", "## Every run", "",
              "| system | round | rate/s | attainment | met by class (chat, prefix, long) | TTFT p50/p90 s | "
              "TPOT p50/p90 ms | errors | CPU % |", "|---|---|---|---|---|---|---|---|---|"]
    for e in result["entries"]:
        for r in e["runs"]:
            k = r["by_kind"]
            kinds = ", ".join(f"{k[n]['met']}/{k[n]['of']}" if n in k else "–" for n in ("chat", "shared_prefix", "long"))
            cpu = ", ".join(f"{label} {v:.0f}" for label, v in r["cpu_pct"].items())
            att = f"{r['attainment']:.2f}" + (" (stopped early: at most)" if r["aborted"] else "")
            lines.append(f"| {e['system']} | {e['round']} | {r['rate']:.3f} | {att} | {kinds} | "
                         f"{r['ttft_p50_s'] or 0:.2f}/{r['ttft_p90_s'] or 0:.2f} | "
                         f"{1000 * (r['tpot_p50_s'] or 0):.0f}/{1000 * (r['tpot_p90_s'] or 0):.0f} | "
                         f"{r['num_errors']} | {cpu} |")
    wrong = [f"{e['system']} round {e['round']}" for e in result["entries"] if not e.get("paris", True)]
    lines += ["", "## Answers (greedy, first 16 tokens, checked before timing)", "",
              "France answers without Paris: " + (", ".join(wrong) if wrong else "none") + ".", ""]
    texts: dict[str, dict[str, str]] = {}
    for e in result["entries"]:
        texts.setdefault(e["system"], e.get("answers", {}))
    for system, answers in texts.items():
        for pid, text in answers.items():
            lines.append(f"- {system}, {pid}: {text!r}")
    if "answer_match" in result:
        lines += ["", f"Identical 16-token answers (round 0), tokenfleet vs each peer: {result['answer_match']}"]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vllm-python", default=os.environ.get("VLLM_PYTHON"), help="python of a vLLM-CPU virtualenv")
    parser.add_argument("--systems", nargs="+", default=["tokenfleet", "vllm:bind=0-1"])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--start-rate", type=float, default=0.3)
    parser.add_argument("--factor", type=float, default=1.25)
    parser.add_argument("--max-steps", type=int, default=12)
    parser.add_argument("--requests", type=int, default=30, help="requests offered per rate")
    parser.add_argument("--drain-s", type=float, default=120.0, help="after the last arrival, before a run is cut")
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "reports" / "goodput.json"))
    args = parser.parse_args()
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
                    "machine": machine_line(), "entries": []}
    if args.vllm_python:
        result["vllm_version"] = _vllm_version(args.vllm_python)
    out = Path(args.out)
    try:
        for r in range(args.rounds):
            for system in args.systems if r % 2 == 0 else args.systems[::-1]:
                result["entries"].append(run_system(args, children, system, r, model_dir, DEFAULT_MODEL_NAME, vocab))
                out.with_suffix(".partial.json").write_text(json.dumps(result, indent=2))
    finally:
        children.stop_all()
    result["ratios"] = ratios(result["entries"], args.systems, args.rounds)
    result["answer_match"] = answer_match(result["entries"])
    result["plot"] = str(out.with_suffix(".png"))
    plot(result, Path(result["plot"]))
    write_report(out, result, markdown(result))
    out.with_suffix(".partial.json").unlink(missing_ok=True)


def answer_match(entries: list[dict]) -> dict[str, str]:
    ours = [e for e in entries if e["system"] == "tokenfleet" and e.get("answers")]
    out = {}
    for peer in {e["system"] for e in entries} - {"tokenfleet"}:
        theirs = [e for e in entries if e["system"] == peer and e.get("answers")]
        if ours and theirs:
            a, b = ours[0]["answers"], theirs[0]["answers"]
            same = sum(a[k] == b.get(k) for k in a)
            out[peer] = f"{same}/{len(a)}"
    return out


if __name__ == "__main__":
    main()
