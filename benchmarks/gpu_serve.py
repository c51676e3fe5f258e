"""End to end on a GPU machine: `tokenfleet up` serving a SmolLM2-shaped model, streamed load through
the gateway at concurrency 1 and 64, TTFT and TPOT p50/p99.

The cluster is the README's `tokenfleet up` (etcd, registry, router, gateway, one engine worker on the GPU),
started as a child process on a free port, one variant at a time (``--variants``: ``default`` is `up` as shipped,
``async`` adds ``--async-scheduling``, ``mixed`` sets TOKENFLEET_CUDA_GRAPHS_MIXED=1 (steps with prefill chunks
replayed from graphs), ``async-mixed`` both). Each variant: wait until a one-token completion succeeds, warm up (a
short run at the largest concurrency, not reported), then for each C in --concurrency send --num-prompts fresh
random prompts (token ids; no prefix-cache hits) of --input-len tokens to /v1/completions (stream, temperature 0,
ignore_eos, max_tokens --output-len) with at most C in flight, in the style of `vllm bench serve`'s random
dataset. TTFT is request sent -> first streamed token chunk; TPOT is (last chunk - first) / (tokens - 1); output
tok/s is completion tokens / the run's wall time.

``--rounds R`` (R >= 3) starts every variant's cluster at once instead (each on its own ports, with its own cache
folder), warms each, then runs every variant's concurrencies in turn R times, odd rounds in reverse: each figure
is then the median over the rounds of alternating runs (every run is reported), so two variants are compared run
against run on the same machine minutes apart. Only one cluster is under load at a time.

Where the real weights cannot go (the GPU machines have no network), ``--model`` is a folder written by
`tokenfleet models random LIKE OUT`: random weights in SmolLM2's shape with its real tokenizer.

    PYTHONPATH=$PWD python3 benchmarks/gpu_serve.py --model FOLDER --out DIR [--variants default,async]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from serving.load import fresh_prompts, http_load, summarize  # noqa: E402
from serving.procs import free_port, wait_completion  # noqa: E402

VARIANTS = {"default": [], "async": ["--async-scheduling"], "mixed": [], "async-mixed": ["--async-scheduling"]}
# what a variant sets in `up`'s environment (its services inherit it)
VARIANT_ENV = {"default": {"TOKENFLEET_CUDA_GRAPHS_MIXED": "0"}, "async": {"TOKENFLEET_CUDA_GRAPHS_MIXED": "0"},
               "mixed": {"TOKENFLEET_CUDA_GRAPHS_MIXED": "1"}, "async-mixed": {"TOKENFLEET_CUDA_GRAPHS_MIXED": "1"}}


def start_up(model: str, name: str, port: int, extra: list[str], log, cache_dir: str = "",  # type: ignore[no-untyped-def]
             variant_env: dict[str, str] | None = None) -> subprocess.Popen:
    variant_env = variant_env or {}
    argv = [sys.executable, "-m", "tokenfleet.cli", "up", "--model", model, "--model-name", name, "--port", str(port),
            *extra]
    log.write(f"$ {' '.join(argv)}\n")
    log.flush()
    env = {**os.environ, **variant_env, **({"TOKENFLEET_CACHE_DIR": cache_dir} if cache_dir else {})}  # cache: its
    return subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=env)  # state, ledger


def stop_up(proc: subprocess.Popen) -> None:
    """Ctrl-C, as a user stops `up` (it stops every service it started), then SIGKILL to the group if it hangs."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(timeout=40)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def run_variant(args, out: dict, log, deadline: float, save) -> None:  # type: ignore[no-untyped-def]
    """Fills ``out`` (the variant's record) run by run; ``save()`` after each."""
    variant = out["variant"]
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    t0 = time.monotonic()
    proc = start_up(args.model, args.model_name, port, out["up_args"], log, variant_env=VARIANT_ENV.get(variant))
    try:
        wait_completion(url, args.model_name, timeout=args.start_timeout, alive=lambda: proc.poll() is None)
        out["ready_s"] = time.monotonic() - t0
        print(f"[{variant}] serving after {out['ready_s']:.1f} s", flush=True)
        warm = fresh_prompts(max(args.concurrency), args.input_len, args.vocab, seed=1)
        asyncio.run(http_load(url, args.model_name, warm, max(args.concurrency), 16))
        for i, c in enumerate(args.concurrency):
            if time.monotonic() > deadline:
                out["skipped"] = f"c={c} and later: past the deadline"
                break
            out["runs"].append(one_run(args, url, variant, c, seed=100 + 10 * i + len(variant)))
            save()
    except Exception as e:  # one variant failing must not cost the others' figures
        out["error"] = f"{type(e).__name__}: {e}"
        print(f"[{variant}] {out['error']}", flush=True)
    finally:
        stop_up(proc)


def one_run(args, url: str, variant: str, c: int, seed: int) -> dict:  # type: ignore[no-untyped-def]
    n = args.num_prompts or max(16, 4 * c)
    prompts = fresh_prompts(n, args.input_len, args.vocab, seed=seed)
    results, wall = asyncio.run(http_load(url, args.model_name, prompts, c, args.output_len))
    row = {"concurrency": c, **summarize(results, wall, args.output_len)}
    print(f"[{variant}] c={c:3d} n={n}: {row['completed']}/{row['requests']} ok, {row['out_tok_s']:.0f} out tok/s, "
          f"TTFT p50 {ms(row['ttft_ms']['p50'])} p99 {ms(row['ttft_ms']['p99'])} ms, "
          f"TPOT p50 {ms(row['tpot_ms']['p50'], 2)} p99 {ms(row['tpot_ms']['p99'], 2)} ms, errors {row['errors']}",
          flush=True)
    return row


def run_rounds(args, records: list[dict], log, deadline: float, save) -> None:  # type: ignore[no-untyped-def]
    """--rounds: every variant's cluster up at once, then their runs alternate round by round."""
    live: dict[str, tuple[subprocess.Popen, str]] = {}
    try:
        for record in records:  # started together: each loads its model while the others do
            port = free_port()
            cache = tempfile.mkdtemp(prefix=f"gpu-serve-{record['variant']}-")  # its own state file and ledger
            live[record["variant"]] = (start_up(args.model, args.model_name, port, record["up_args"], log, cache,
                                                VARIANT_ENV.get(record["variant"])),
                                       f"http://127.0.0.1:{port}")
        t0 = time.monotonic()
        for record in records:
            proc, url = live[record["variant"]]
            try:
                wait_completion(url, args.model_name, timeout=args.start_timeout, alive=lambda: proc.poll() is None)
                record["ready_s"] = time.monotonic() - t0
                warm = fresh_prompts(max(args.concurrency), args.input_len, args.vocab, seed=1)
                asyncio.run(http_load(url, args.model_name, warm, max(args.concurrency), 16))
                print(f"[{record['variant']}] serving and warm after {record['ready_s']:.1f} s", flush=True)
            except Exception as e:  # noqa: BLE001 - the other variants still run
                record["error"] = f"{type(e).__name__}: {e}"
                print(f"[{record['variant']}] {record['error']}", flush=True)
        ready = [r for r in records if "error" not in r]
        for rnd in range(args.rounds):
            for record in (ready if rnd % 2 == 0 else ready[::-1]):
                for i, c in enumerate(args.concurrency):
                    if time.monotonic() > deadline:
                        record["skipped"] = f"round {rnd} c={c} and later: past the deadline"
                        return
                    try:
                        row = one_run(args, live[record["variant"]][1], f"{record['variant']} r{rnd}", c,
                                      seed=1000 * rnd + 100 + 10 * i + len(record["variant"]))
                    except Exception as e:  # noqa: BLE001 - keep the rounds already measured
                        record["error"] = f"round {rnd} c={c}: {type(e).__name__}: {e}"
                        print(f"[{record['variant']}] {record['error']}", flush=True)
                        continue
                    record["runs"].append({**row, "round": rnd})
                    save()
    finally:
        for proc, _ in live.values():
            stop_up(proc)


def medians(runs: list[dict]) -> list[dict]:
    """Per concurrency, each figure's median over the rounds (the runs' own p50s and p99s)."""
    out = []
    for c in sorted({r["concurrency"] for r in runs}):
        rows = [r for r in runs if r["concurrency"] == c]

        def med(*path: str) -> float | None:
            values = []
            for r in rows:
                v: Any = r
                for key in path:
                    v = v[key]
                if v is not None:
                    values.append(v)
            return statistics.median(values) if values else None

        out.append({"concurrency": c, "rounds": len(rows), "requests": sum(r["requests"] for r in rows),
                    "completed": sum(r["completed"] for r in rows), "out_tok_s": med("out_tok_s"),
                    "ttft_ms": {"p50": med("ttft_ms", "p50"), "p99": med("ttft_ms", "p99")},
                    "tpot_ms": {"p50": med("tpot_ms", "p50"), "p99": med("tpot_ms", "p99")}})
    return out


def ms(value: float | None, digits: int = 1) -> str:
    """A percentile, or "-" when no request of the run succeeded."""
    return "-" if value is None else f"{value:.{digits}f}"


def report(result: dict) -> str:
    lines = [f"## `tokenfleet up` on {result['device']} (torch {result['torch']}): streamed load through the gateway",
             "", f"Model: `{result['model']}`; {result['input_len']} prompt tokens (random ids, fresh per run), "
             f"{result['output_len']} output tokens (ignore_eos), temperature 0.", "",
             "| variant | C | requests | ok | out tok/s | TTFT p50 ms | TTFT p99 ms | TPOT p50 ms | TPOT p99 ms |",
             "|---|---|---|---|---|---|---|---|---|"]
    rounds = result.get("rounds", 1) > 1
    for v in result["variants"]:
        for r in (medians(v["runs"]) if rounds else v["runs"]):
            tok_s = "-" if r["out_tok_s"] is None else f"{r['out_tok_s']:.0f}"
            label = f"{v['variant']} (median of {r['rounds']})" if rounds else v["variant"]
            lines.append(f"| {label} | {r['concurrency']} | {r['requests']} | {r['completed']} | {tok_s} "
                         f"| {ms(r['ttft_ms']['p50'])} | {ms(r['ttft_ms']['p99'])} | {ms(r['tpot_ms']['p50'], 2)} "
                         f"| {ms(r['tpot_ms']['p99'], 2)} |")
        if v.get("error"):
            lines.append(f"\n{v['variant']}: {v['error']}\n")
    if rounds:
        lines += ["", "Every run, in the order run (odd rounds ran the variants in reverse): TTFT p50 / TPOT p50 ms", ""]
        for v in result["variants"]:
            for c in result["concurrency"]:
                runs = [r for r in v["runs"] if r["concurrency"] == c]
                lines.append(f"- {v['variant']} c={c}: " + ", ".join(
                    f"{ms(r['ttft_ms']['p50'])} / {ms(r['tpot_ms']['p50'], 2)}" for r in runs))
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True, help="a model folder (e.g. from `tokenfleet models random`)")
    p.add_argument("--model-name", default="smollm2")
    p.add_argument("--variants", default="default", help=f"comma-separated: {', '.join(VARIANTS)}")
    p.add_argument("--up-arg", action="append", default=[], help="one more argument for `tokenfleet up` (repeat)")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 64])
    p.add_argument("--num-prompts", type=int, default=0, help="per run (default: max(16, 4 x C))")
    p.add_argument("--input-len", type=int, default=512)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--vocab", type=int, default=49152)
    p.add_argument("--start-timeout", type=float, default=300)
    p.add_argument("--budget-s", type=float, default=0, help="start no run after this many seconds (0 = none)")
    p.add_argument("--out", default="benchmarks/reports")
    p.add_argument("--name", default="gpu-serve")
    p.add_argument("--log", default="", help="the services' output (default: NAME-up.log in --out)")
    p.add_argument("--rounds", type=int, default=1, help="3 or more: every variant's cluster up at once, their runs "
                   "alternating that many rounds; figures are medians over the rounds")
    args = p.parse_args()
    if args.rounds == 2:
        p.error("--rounds 2 has no median: 1, or 3 and more")
    import torch

    start = time.monotonic()
    deadline = start + args.budget_s if args.budget_s else float("inf")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result = {"device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu", "torch": torch.__version__,
              "model": args.model, "input_len": args.input_len, "output_len": args.output_len,
              "concurrency": args.concurrency, "rounds": args.rounds, "variants": []}
    stamp = time.strftime("%Y-%m-%d")

    def save() -> None:
        (out / f"{stamp}-{args.name}.json").write_text(json.dumps(result, indent=1))

    def interrupted(*_: object) -> None:  # `timeout` or the device tool: stop the cluster, keep what was measured
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, interrupted)
    try:
        with open(args.log or out / f"{args.name}-up.log", "a") as log:
            if args.rounds > 1:
                result["variants"] = [{"variant": v, "up_args": [*VARIANTS[v], *args.up_arg], "runs": []}
                                      for v in args.variants.split(",")]
                run_rounds(args, result["variants"], log, deadline, save)
            for variant in args.variants.split(",") if args.rounds <= 1 else ():
                record: dict = {"variant": variant, "up_args": [*VARIANTS[variant], *args.up_arg], "runs": []}
                result["variants"].append(record)
                if time.monotonic() > deadline:
                    record["error"] = "skipped: past the deadline"
                    continue
                run_variant(args, record, log, deadline, save)
                save()
    except KeyboardInterrupt:
        result["interrupted"] = True
    finally:
        save()
        (out / f"{stamp}-{args.name}.md").write_text(report(result))
    print(report(result))


if __name__ == "__main__":
    main()
