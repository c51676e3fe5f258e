"""End to end on a GPU machine (issue 25): `tokenfleet up` serving a SmolLM2-shaped model, streamed load through
the gateway at concurrency 1 and 64, TTFT and TPOT p50/p99.

The cluster is the README's `tokenfleet up` (etcd, registry, router, gateway, one engine worker on the GPU),
started as a child process on a free port, one variant at a time (``--variants``: ``default`` is `up` as shipped,
``async`` adds ``--async-scheduling``). Each variant: wait until a one-token completion succeeds, warm up (a
short run at the largest concurrency, not reported), then for each C in --concurrency send --num-prompts fresh
random prompts (token ids; no prefix-cache hits) of --input-len tokens to /v1/completions (stream, temperature 0,
ignore_eos, max_tokens --output-len) with at most C in flight, in the style of `vllm bench serve`'s random
dataset. TTFT is request sent -> first streamed token chunk; TPOT is (last chunk - first) / (tokens - 1); output
tok/s is completion tokens / the run's wall time.

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
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from serving.load import fresh_prompts, http_load, summarize  # noqa: E402
from serving.procs import free_port, wait_completion  # noqa: E402

VARIANTS = {"default": [], "async": ["--async-scheduling"]}


def start_up(model: str, name: str, port: int, extra: list[str], log) -> subprocess.Popen:  # type: ignore[no-untyped-def]
    argv = [sys.executable, "-m", "tokenfleet.cli", "up", "--model", model, "--model-name", name, "--port", str(port),
            *extra]
    log.write(f"$ {' '.join(argv)}\n")
    log.flush()
    return subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


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
    proc = start_up(args.model, args.model_name, port, out["up_args"], log)
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
            n = args.num_prompts or max(16, 4 * c)
            prompts = fresh_prompts(n, args.input_len, args.vocab, seed=100 + 10 * i + len(variant))
            results, wall = asyncio.run(http_load(url, args.model_name, prompts, c, args.output_len))
            row = {"concurrency": c, **summarize(results, wall, args.output_len)}
            out["runs"].append(row)
            save()
            print(f"[{variant}] c={c:3d} n={n}: {row['completed']}/{row['requests']} ok, {row['out_tok_s']:.0f} out tok/s, "
                  f"TTFT p50 {ms(row['ttft_ms']['p50'])} p99 {ms(row['ttft_ms']['p99'])} ms, "
                  f"TPOT p50 {ms(row['tpot_ms']['p50'], 2)} p99 {ms(row['tpot_ms']['p99'], 2)} ms, errors {row['errors']}",
                  flush=True)
    except Exception as e:  # one variant failing must not cost the others' figures
        out["error"] = f"{type(e).__name__}: {e}"
        print(f"[{variant}] {out['error']}", flush=True)
    finally:
        stop_up(proc)


def ms(value: float | None, digits: int = 1) -> str:
    """A percentile, or "-" when no request of the run succeeded."""
    return "-" if value is None else f"{value:.{digits}f}"


def report(result: dict) -> str:
    lines = [f"## `tokenfleet up` on {result['device']} (torch {result['torch']}): streamed load through the gateway",
             "", f"Model: `{result['model']}`; {result['input_len']} prompt tokens (random ids, fresh per run), "
             f"{result['output_len']} output tokens (ignore_eos), temperature 0.", "",
             "| variant | C | requests | ok | out tok/s | TTFT p50 ms | TTFT p99 ms | TPOT p50 ms | TPOT p99 ms |",
             "|---|---|---|---|---|---|---|---|---|"]
    for v in result["variants"]:
        for r in v["runs"]:
            lines.append(f"| {v['variant']} | {r['concurrency']} | {r['requests']} | {r['completed']} | {r['out_tok_s']:.0f} "
                         f"| {ms(r['ttft_ms']['p50'])} | {ms(r['ttft_ms']['p99'])} | {ms(r['tpot_ms']['p50'], 2)} "
                         f"| {ms(r['tpot_ms']['p99'], 2)} |")
        if v.get("error"):
            lines.append(f"\n{v['variant']}: {v['error']}\n")
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
    args = p.parse_args()
    import torch

    start = time.monotonic()
    deadline = start + args.budget_s if args.budget_s else float("inf")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result = {"device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu", "torch": torch.__version__,
              "model": args.model, "input_len": args.input_len, "output_len": args.output_len,
              "concurrency": args.concurrency, "variants": []}
    stamp = time.strftime("%Y-%m-%d")

    def save() -> None:
        (out / f"{stamp}-{args.name}.json").write_text(json.dumps(result, indent=1))

    def interrupted(*_: object) -> None:  # `timeout` or the device tool: stop the cluster, keep what was measured
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, interrupted)
    try:
        with open(args.log or out / f"{args.name}-up.log", "a") as log:
            for variant in args.variants.split(","):
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
