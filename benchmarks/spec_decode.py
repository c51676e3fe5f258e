"""Speculative decoding through `tokenfleet up` (gateway -> router -> worker, the real HTTP API): what it gains
where it can, and that it costs nothing where it cannot.

Clusters (launcher.up, one worker each, `--threads` torch threads, --dtype), started once and used in turn:
- on: the model's record has speculative_config {"decoding_type": "NGram", "max_draft_len": --draft-len}: prompt
  lookup, verified only when the policy (switched by load) predicts it pays;
- off: no speculative_config;
- always (chat part only): the same proposer with "adaptive": false, verifying every proposal: shows the workload's
  acceptance rate (the proposer proposes; how often it is right) and what speculation without the switch costs.

Edit part (bar: TPOT p50 on <= 0.7 x off, median of per-run ratios, on the evaluation half; greedy outputs identical):
the committed prompts of benchmarks/data/spec_edit_prompts.json (code to return with a small change or renamed
identifiers, scripts with a variable renamed, paragraphs to repeat with one number changed, documents to quote, JSON
to return with one field changed), split in halves by the SHA-256 of the prompt text (`--split`: eval, tune or all;
the rule was committed with the prompts before any tuning), chat completions, stream, temperature 0,
--edit-max-tokens, one at a time (c=1); every prompt goes to on and to off, alternating which goes first; --runs runs.
TPOT per request = (last content chunk - first) / (completion tokens - 1) (several tokens can arrive in one chunk when
a verification accepts them). Reported per run: TPOT p50 on and off and their ratio; outputs equal on/off (count); the
on worker's proposed/accepted tokens and verifications (acceptance rate, mean accepted length), the mean time of a
verification step and of a plain decode step; and per prompt the same, from the worker's counters around that prompt's
request.

Chat part (bar: output tok/s on >= 0.97 x off at c=32): benchmarks/data/spec_chat_prompts.json cycled to
--chat-requests requests, chat completions, stream, temperature --chat-temperature, ignore_eos, --chat-max-tokens,
--chat-concurrency at a time; runs alternate on, off, always (the first of each run rotates); the bar is the median
of the per-run ratios on/off. The always runs give the acceptance rate (must be under 30 % for this bar's premise).

    .venv/bin/python benchmarks/spec_decode.py [--runs 3] [--dtype bfloat16] [--out benchmarks/reports/spec.json]
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
from serving.load import httpx
from serving.report import git_head, machine_line, write_report

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from tokenfleet import envs  # noqa: E402
from tokenfleet.cli import launcher  # noqa: E402
from tokenfleet.models.gguf_import import ensure_default_model  # noqa: E402
from tokenfleet.security.identity import Identity  # noqa: E402
from tokenfleet.security.plane import Plane  # noqa: E402
from tokenfleet.v1 import engine_pb2, engine_pb2_grpc  # noqa: E402

SPEC_FIELDS = ("num_spec_proposed_tokens", "num_spec_accepted_tokens", "num_spec_verifications", "num_spec_steps",
               "spec_step_seconds", "num_plain_decode_steps", "plain_decode_step_seconds")


def spec_counters(cluster: launcher.Cluster) -> dict[str, float]:
    """The worker's speculation counters, from its Load stream (as a router reads it)."""
    plane = Plane(Identity(envs.certs_dir(), "router"))
    with plane.sync_channel(cluster.addresses["worker-0"], "worker") as channel:
        stream = engine_pb2_grpc.EngineServiceStub(channel).Load(engine_pb2.LoadRequest(interval_ms=50))
        report = next(iter(stream))
        stream.cancel()
    return {f: getattr(report, f) for f in SPEC_FIELDS}


def delta(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    d = {k: after[k] - before[k] for k in after}
    d["acceptance_rate"] = d["num_spec_accepted_tokens"] / d["num_spec_proposed_tokens"] if d["num_spec_proposed_tokens"] else 0.0
    d["mean_accepted_length"] = 1 + d["num_spec_accepted_tokens"] / d["num_spec_verifications"] \
        if d["num_spec_verifications"] else 0.0
    return d


async def chat(client: httpx.AsyncClient, prompt: str, max_tokens: int, temperature: float, ignore_eos: bool) -> dict:
    body = {"model": "smol", "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "temperature": temperature, "stream": True, "stream_options": {"include_usage": True},
            "ignore_eos": ignore_eos}
    start = time.perf_counter()
    first = last = None
    text, tokens = [], 0
    async with client.stream("POST", "/v1/chat/completions", json=body) as response:
        if response.status_code != 200:
            raise RuntimeError(f"HTTP {response.status_code}: {(await response.aread())[:200]!r}")
        async for line in response.aiter_lines():
            if not line.startswith("data:") or line[5:].strip() == "[DONE]":
                continue
            event = json.loads(line[5:])
            for choice in event.get("choices") or []:
                content = choice.get("delta", {}).get("content")
                if content:
                    now = time.perf_counter()
                    first = now if first is None else first
                    last = now
                    text.append(content)
            if event.get("usage"):
                tokens = int(event["usage"]["completion_tokens"])
    tpot = (last - first) / (tokens - 1) if first is not None and last is not None and tokens > 1 else None
    return {"text": "".join(text), "tokens": tokens, "tpot_s": tpot, "ttft_s": (first - start) if first else None}


async def load(url: str, prompts: list[str], concurrency: int, max_tokens: int, temperature: float,
               ignore_eos: bool) -> tuple[list[dict], float]:
    gate = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency + 4)
    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(600.0), limits=limits) as client:
        async def one(p: str) -> dict:
            async with gate:
                return await chat(client, p, max_tokens, temperature, ignore_eos)

        start = time.perf_counter()
        results = await asyncio.gather(*(one(p) for p in prompts))
        return list(results), time.perf_counter() - start


def p50(values: list[float]) -> float:
    return float(np.percentile(values, 50))


def edit_prompts(split: str) -> list[dict]:
    """The committed edit prompts of ``split``: "eval" (the half with the lower SHA-256 of the prompt text: the bar is
    judged there), "tune" (the other half: for tuning the policy) or "all". The rule was committed with the prompts,
    before any tuning run."""
    prompts = json.loads((REPO / "benchmarks/data/spec_edit_prompts.json").read_text())
    ranked = sorted(prompts, key=lambda p: hashlib.sha256(p["prompt"].encode()).hexdigest())
    half = {id(p): ("eval" if i < len(ranked) // 2 else "tune") for i, p in enumerate(ranked)}
    return [{**p, "split": half[id(p)]} for p in prompts if split in ("all", half[id(p)])]


def per_step_ms(c: dict[str, float]) -> tuple[float | None, float | None]:
    """(ms per verification step, ms per plain decode step) from a counter delta."""
    spec = 1000 * c["spec_step_seconds"] / c["num_spec_steps"] if c["num_spec_steps"] else None
    plain = 1000 * c["plain_decode_step_seconds"] / c["num_plain_decode_steps"] if c["num_plain_decode_steps"] else None
    return spec, plain


def edit_part(args: argparse.Namespace, on: launcher.Cluster, off: launcher.Cluster) -> dict:
    prompts = edit_prompts(args.split)
    runs = []
    for run in range(args.runs):
        results: dict[str, list[dict]] = {"on": [], "off": []}
        before = spec_counters(on)
        per_prompt = []
        for i, p in enumerate(prompts):
            order = [("on", on), ("off", off)] if (run + i) % 2 == 0 else [("off", off), ("on", on)]
            mine: dict[str, float] = {}  # the on worker's counters for this prompt's request
            for name, cluster in order:
                start = spec_counters(on) if name == "on" else None
                got, _ = asyncio.run(load(cluster.gateway_url, [p["prompt"]], 1, args.edit_max_tokens, 0.0, False))
                results[name].append(got[0])
                if start is not None:  # c=1: the worker's counters moved for this request alone
                    mine = delta(spec_counters(on), start)
            tpot_on, tpot_off = results["on"][-1]["tpot_s"], results["off"][-1]["tpot_s"]
            verify_ms, plain_ms = per_step_ms(mine)
            per_prompt.append({"kind": p["kind"], "split": p["split"], "tokens": results["on"][-1]["tokens"],
                               "tpot_on_ms": tpot_on and 1000 * tpot_on, "tpot_off_ms": tpot_off and 1000 * tpot_off,
                               "ratio": tpot_on / tpot_off if tpot_on and tpot_off else None,
                               "equal": results["on"][-1]["text"] == results["off"][-1]["text"],
                               "acceptance_rate": mine["acceptance_rate"],
                               "mean_accepted_length": mine["mean_accepted_length"],
                               "verifications": mine["num_spec_verifications"],
                               "verify_step_ms": verify_ms, "plain_step_ms": plain_ms})
        counters = delta(spec_counters(on), before)
        tpot = {k: p50([r["tpot_s"] * 1000 for r in v if r["tpot_s"] is not None]) for k, v in results.items()}
        equal = sum(a["text"] == b["text"] for a, b in zip(results["on"], results["off"]))
        verify_ms, plain_ms = per_step_ms(counters)
        runs.append({"tpot_p50_ms": tpot, "ratio": tpot["on"] / tpot["off"], "equal_outputs": equal,
                     "prompts": len(prompts), "counters_on": counters, "verify_step_ms": verify_ms,
                     "plain_step_ms": plain_ms, "per_prompt": per_prompt,
                     "tokens": {k: sum(r["tokens"] for r in v) for k, v in results.items()}})
        print(f"edit run {run + 1}: TPOT p50 on {tpot['on']:.2f} ms, off {tpot['off']:.2f} ms, ratio "
              f"{runs[-1]['ratio']:.3f}; equal {equal}/{len(prompts)}; acceptance {counters['acceptance_rate']:.2f}, "
              f"mean accepted length {counters['mean_accepted_length']:.2f}", flush=True)
    return {"split": args.split, "runs": runs, "ratio_median": statistics.median(r["ratio"] for r in runs)}


def chat_part(args: argparse.Namespace, clusters: dict[str, launcher.Cluster]) -> dict:
    base = json.loads((REPO / "benchmarks/data/spec_chat_prompts.json").read_text())
    prompts = [base[i % len(base)] for i in range(args.chat_requests)]
    names = list(clusters)
    runs = []
    for run in range(args.runs):
        order = names[run % len(names):] + names[: run % len(names)]
        row: dict[str, dict] = {}
        for name in order:
            before = spec_counters(clusters[name])
            results, wall = asyncio.run(load(clusters[name].gateway_url, prompts, args.chat_concurrency,
                                             args.chat_max_tokens, args.chat_temperature, True))
            tokens = sum(r["tokens"] for r in results)
            row[name] = {"out_tok_s": tokens / wall, "wall_s": wall, "tokens": tokens,
                         "tpot_p50_ms": p50([r["tpot_s"] * 1000 for r in results if r["tpot_s"] is not None]),
                         "counters": delta(spec_counters(clusters[name]), before)}
            print(f"chat run {run + 1} {name}: {row[name]['out_tok_s']:.1f} tok/s ({tokens} tokens, {wall:.1f} s), "
                  f"acceptance {row[name]['counters']['acceptance_rate']:.2f}, verifications "
                  f"{row[name]['counters']['num_spec_verifications']:.0f}", flush=True)
        row["ratio_on_off"] = {"value": row["on"]["out_tok_s"] / row["off"]["out_tok_s"]}  # type: ignore[assignment]
        runs.append(row)
    always = [r["always"]["counters"] for r in runs if "always" in r]
    proposed = sum(c["num_spec_proposed_tokens"] for c in always)
    accepted = sum(c["num_spec_accepted_tokens"] for c in always)
    return {"runs": runs, "ratio_median": statistics.median(r["ratio_on_off"]["value"] for r in runs),
            "always_acceptance_rate": accepted / proposed if proposed else None,
            "always_ratio_median": statistics.median(r["always"]["out_tok_s"] / r["off"]["out_tok_s"] for r in runs)
            if always else None}


def fmt(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def markdown(result: dict, args: argparse.Namespace) -> str:
    lines = [f"# Speculative decoding through `tokenfleet up` ({args.dtype}, {args.threads} torch thread(s) per worker)",
             "", f"git {result['git']}, {result['date']}. Command: `{result['command']}`. Machine: "
             f"{result.get('machine', 'not recorded')}.", ""]
    if "edit" in result:
        e = result["edit"]
        lines += [f"## Edit / quote workload, c=1, {e.get('split', 'all')} prompts (bar: TPOT p50 on <= 0.7 x off, "
                  "median of per-run ratios; greedy outputs identical)", "",
                  "| run | TPOT p50 on (ms) | off (ms) | on/off | equal outputs | acceptance | mean accepted length "
                  "| ms per verification step | ms per plain step |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for i, r in enumerate(e["runs"]):
            c = r["counters_on"]
            lines.append(f"| {i + 1} | {r['tpot_p50_ms']['on']:.2f} | {r['tpot_p50_ms']['off']:.2f} | {r['ratio']:.3f} | "
                         f"{r['equal_outputs']}/{r['prompts']} | {c['acceptance_rate']:.2f} | {c['mean_accepted_length']:.2f} "
                         f"| {fmt(r.get('verify_step_ms'))} | {fmt(r.get('plain_step_ms'))} |")
        verdict = "PASS" if e["ratio_median"] <= 0.7 else "FAIL"
        lines += ["", f"Median on/off TPOT p50 ratio: **{e['ratio_median']:.3f}** ({verdict})", ""]
        if e["runs"] and "per_prompt" in e["runs"][0]:
            lines += ["### Per prompt (every run)", "",
                      "| run | # | kind | tokens | TPOT on (ms) | off (ms) | on/off | equal | acceptance | accepted length "
                      "| verifications | ms per verification | ms per plain step |",
                      "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
            for i, r in enumerate(e["runs"]):
                for j, q in enumerate(r["per_prompt"]):
                    lines.append(f"| {i + 1} | {j + 1} | {q['kind']} | {q['tokens']} | {fmt(q['tpot_on_ms'])} | "
                                 f"{fmt(q['tpot_off_ms'])} | {fmt(q['ratio'], 3)} | {'yes' if q['equal'] else 'NO'} | "
                                 f"{q['acceptance_rate']:.2f} | {q['mean_accepted_length']:.2f} | "
                                 f"{q['verifications']:.0f} | {fmt(q['verify_step_ms'])} | {fmt(q['plain_step_ms'])} |")
            lines.append("")
    if "chat" in result:
        c = result["chat"]
        lines += [f"## Chat workload, c={args.chat_concurrency} (bar: output tok/s on >= 0.97 x off)", "",
                  "| run | on tok/s | off tok/s | always tok/s | on/off | always/off | acceptance (always) "
                  "| verifications (on) |",
                  "|---|---|---|---|---|---|---|---|"]
        for i, r in enumerate(c["runs"]):
            a = r.get("always", {})
            lines.append(f"| {i + 1} | {r['on']['out_tok_s']:.1f} | {r['off']['out_tok_s']:.1f} | "
                         f"{a.get('out_tok_s', float('nan')):.1f} | {r['ratio_on_off']['value']:.3f} | "
                         f"{a.get('out_tok_s', float('nan')) / r['off']['out_tok_s']:.3f} | "
                         f"{a.get('counters', {}).get('acceptance_rate', float('nan')):.2f} | "
                         f"{r['on']['counters']['num_spec_verifications']:.0f} |")
        verdict = "PASS" if c["ratio_median"] >= 0.97 else "FAIL"
        acc = c["always_acceptance_rate"]
        lines += ["", f"Median on/off: **{c['ratio_median']:.3f}** ({verdict}); acceptance when every proposal is "
                  f"verified: {acc:.1%}" if acc is not None else "", ""]
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--threads", type=int, default=1, help="torch threads per worker (one core left to the rest)")
    p.add_argument("--draft-len", type=int, default=5)
    p.add_argument("--edit-max-tokens", type=int, default=160)
    p.add_argument("--split", default="eval", choices=["eval", "tune", "all"],
                   help="which half of the edit prompts (by SHA-256 of the text): the bar is judged on eval")
    p.add_argument("--chat-requests", type=int, default=64)
    p.add_argument("--chat-concurrency", type=int, default=32)
    p.add_argument("--chat-max-tokens", type=int, default=96)
    p.add_argument("--chat-temperature", type=float, default=0.7)
    p.add_argument("--parts", default="edit,chat")
    p.add_argument("--out", default="benchmarks/reports/spec-decode.json")
    args = p.parse_args()
    model = str(ensure_default_model())
    ngram = {"decoding_type": "NGram", "max_draft_len": args.draft_len}
    configs = {"on": json.dumps(ngram), "off": "", "always": json.dumps({**ngram, "adaptive": False})}
    parts = args.parts.split(",")
    wanted = ["on", "off"] + (["always"] if "chat" in parts else [])
    clusters = {}
    result: dict = {"git": git_head(), "date": time.strftime("%Y-%m-%d %H:%M:%S"), "command": " ".join(sys.argv),
                    "machine": machine_line(), "args": vars(args),
                    "configs": {k: configs[k] for k in wanted}}
    try:
        for name in wanted:
            clusters[name] = launcher.up(1, model, "smol", args.threads, 0, dtype=args.dtype, record=False,
                                         speculative_config=configs[name])
            print(f"{name}: {clusters[name].gateway_url}", flush=True)
        if "edit" in parts:
            result["edit"] = edit_part(args, clusters["on"], clusters["off"])
        if "chat" in parts:
            result["chat"] = chat_part(args, clusters)
    finally:
        for c in clusters.values():
            c.stop()
    write_report(args.out, result, markdown(result, args))


if __name__ == "__main__":
    main()
