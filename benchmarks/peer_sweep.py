"""vLLM-CPU's best configuration on this machine, found by a pruned sweep of its documented knobs.

Closed loop at c=32 (the serving benchmark's client: `vllm bench serve --backend openai-chat`, random
256-token prompts, 64 output tokens, 64 requests, `--ignore-eos`), the same seed for every configuration,
vLLM restarted for each (nothing cached carries over), an untimed warm-up run first. Stages, each
keeping the best so far by output tok/s:

0. the dtype (--dtypes: bf16, fp32) with both cores bound: on a CPU without AVX-512 BF16 bf16 GEMMs are
   far slower than fp32, so the dtype is a knob there (a machine with it can pass --dtypes bfloat16);
1. the best dtype's binding (`bind=default` / `bind=0-1` / `bind=reserved0`) x TCMalloc off / on; on a CPU with
   AMX, the best of those with VLLM_CPU_SGL_KERNEL=1 too (`sgl`);
2. the best of 1 with --max-num-batched-tokens at each of --mnbt (3 values);
3. the best of 2 with --max-num-seqs at each of --seqs (3 values); a value at or above the concurrency
   cannot change a closed loop of that many requests, and is reported as not run.

Every configuration is reported, failures included (a configuration that does not start is a row).
The specs are those of benchmarks/serving/vllm_configs.py; pass the winners to benchmarks/goodput.py
(`--systems vllm:SPEC`) and benchmarks/serve_peer.py (`--vllm-config SPEC`).

    .venv/bin/python benchmarks/peer_sweep.py --vllm-python VLLM_VENV/bin/python
        [--mnbt 1024 4096 8192] [--seqs 8 16 24] [--out benchmarks/reports/DATE-cpu-peer-sweep.json]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import tempfile
import time
import traceback
from pathlib import Path

from serve_peer import _git_head, _vllm_version, bench, start_vllm, summarize
from serving.cores import CoreMonitor
from serving.procs import Children
from serving.report import machine_line, write_report
from serving.vllm_configs import parse

REPO = Path(__file__).resolve().parent.parent


def measure(args: argparse.Namespace, children: Children, spec: str, model_dir: str, model_name: str,
            out_dir: Path) -> dict:
    row: dict = {"spec": spec}
    started = time.monotonic()
    try:
        child, url = start_vllm(children, args.vllm_python, model_dir, model_name, parse(spec))
    except Exception as e:  # noqa: BLE001 - a configuration that cannot start is a result too
        row["error"] = f"{type(e).__name__}: {str(e)[-600:]}"
        print(f"{spec:40} did not start: {row['error'][:200]}", flush=True)
        return row
    row["startup_s"] = time.monotonic() - started
    try:
        bench(args, url, model_name, model_dir, 8, 16, args.seed + 999_000, out_dir)  # warm-up
        with CoreMonitor({"vllm": child.proc.pid, "client": os.getpid()}) as monitor:
            raw = bench(args, url, model_name, model_dir, args.concurrency, args.num_prompts, args.seed, out_dir)
        row.update(summarize(raw))
        row["cpu_pct"] = sum(p["cpu_pct"] for p in monitor.report()["processes"] if p["label"].startswith("vllm"))
    except Exception as e:  # noqa: BLE001
        row["error"] = f"{type(e).__name__}: {str(e)[-600:]}"
        traceback.print_exc()
    finally:
        children.stop(child, timeout=60)
    if "error" not in row:
        print(f"{spec:40} {row['out_tok_s']:7.1f} tok/s  TTFT p99 {row['ttft_p99_ms']:.0f} ms  "
              f"TPOT p50/p99 {row['tpot_p50_ms']:.1f}/{row['tpot_p99_ms']:.1f} ms  vLLM CPU {row['cpu_pct']:.0f}%",
              flush=True)
    return row


def best(rows: list[dict]) -> str | None:
    ok = [r for r in rows if "error" not in r and r.get("failed", 0) == 0]
    return max(ok, key=lambda r: r["out_tok_s"])["spec"] if ok else None


def with_setting(spec: str, key: str, value: str) -> str:
    items = [s for s in spec.split(",") if s and not s.startswith(f"{key}=")]
    return ",".join([*items, f"{key}={value}"])


def markdown(result: dict) -> str:
    a = result["args"]
    lines = [f"# vLLM-CPU configuration sweep ({result['started']})", "",
             f"Closed loop: `vllm bench serve --backend openai-chat`, random {a['input_len']}-token prompts, "
             f"{a['output_len']} output tokens, {a['num_prompts']} requests at c={a['concurrency']}, `--ignore-eos`, "
             f"seed {a['seed']} for every configuration, vLLM {result['vllm_version']} restarted per configuration "
             f"(--max-model-len 4096, 4 GiB KV). Machine: {result['machine']}. git {result['git']}. "
             "One run per configuration: a coarse sweep; the winners are measured again, in alternating rounds "
             "against tokenfleet, by benchmarks/goodput.py and benchmarks/serve_peer.py.", "",
             "| stage | configuration | out tok/s | TTFT p50/p99 ms | TPOT p50/p99 ms | vLLM CPU % | startup s | note |",
             "|---|---|---|---|---|---|---|---|"]
    for r in result["runs"]:
        if "error" in r:
            lines.append(f"| {r['stage']} | `{r['spec']}` | – | – | – | – | – | {r['error'][:120]} |")
            continue
        lines.append(f"| {r['stage']} | `{r['spec']}` | {r['out_tok_s']:.1f} | {r['ttft_p50_ms']:.0f}/"
                     f"{r['ttft_p99_ms']:.0f} | {r['tpot_p50_ms']:.1f}/{r['tpot_p99_ms']:.1f} | {r['cpu_pct']:.0f} | "
                     f"{r['startup_s']:.0f} | {'failed ' + str(r['failed']) if r['failed'] else ''} |")
    lines += ["", "## Ranking (output tok/s at c=32)", ""]
    ranked = sorted((r for r in result["runs"] if "error" not in r), key=lambda r: -r["out_tok_s"])
    lines += [f"{i + 1}. `{r['spec']}`: {r['out_tok_s']:.1f} tok/s" for i, r in enumerate(ranked)]
    return "\n".join(lines) + "\n"


def _has_amx() -> bool:
    try:
        return "amx_bf16" in Path("/proc/cpuinfo").read_text()
    except OSError:
        return False


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vllm-python", default=os.environ.get("VLLM_PYTHON"), help="python of a vLLM-CPU virtualenv")
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--seed", type=int, default=20261128)
    parser.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"])
    parser.add_argument("--bindings", nargs="+", default=["default", "0-1", "reserved0"])
    parser.add_argument("--mnbt", nargs="+", default=["1024", "4096", "8192"],
                        help="--max-num-batched-tokens values (vLLM-CPU's server default: 2048)")
    parser.add_argument("--seqs", nargs="+", default=["8", "16", "24"],
                        help="--max-num-seqs values (vLLM-CPU's server default: 128)")
    parser.add_argument("--out",
                        default=str(REPO / "benchmarks" / "reports" / f"{time.strftime('%Y-%m-%d')}-cpu-peer-sweep.json"))
    args = parser.parse_args()
    if not args.vllm_python:
        parser.error("--vllm-python (or $VLLM_PYTHON)")

    from tokenfleet.models.gguf_import import DEFAULT_MODEL_NAME, ensure_default_model

    model_dir = str(Path(ensure_default_model()).resolve())
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    children = Children(insecure=True)
    out_dir = Path(tempfile.mkdtemp(prefix="peer-sweep-"))
    result: dict = {"started": time.strftime("%Y-%m-%d %H:%M:%S"), "args": vars(args), "git": _git_head(),
                    "machine": machine_line(), "vllm_version": _vllm_version(args.vllm_python), "runs": []}

    def run(stage: int, spec: str) -> None:
        if any(r["spec"] == spec for r in result["runs"]):
            return
        row = measure(args, children, spec, model_dir, DEFAULT_MODEL_NAME, out_dir)
        result["runs"].append({"stage": stage, **row})
        Path(args.out).with_suffix(".partial.json").write_text(json.dumps(result, indent=2))

    try:
        for dtype in args.dtypes:
            run(0, f"bind=0-1,dtype={dtype}")
        top_dtype = (best(result["runs"]) or "dtype=bfloat16").split("dtype=")[1]
        for binding in args.bindings:
            for tcmalloc in ("", ",tcmalloc"):
                run(1, f"bind={binding}{tcmalloc},dtype={top_dtype}")
        if (top := best(result["runs"])) is not None and _has_amx():
            run(1, f"{top},sgl")  # the AMX small-batch kernels (vLLM's CPU guide: AMX machines only)
        if (top := best(result["runs"])) is not None:
            for value in args.mnbt:
                run(2, with_setting(top, "mnbt", value))
            top = best(result["runs"]) or top
            for value in args.seqs:
                if int(value) >= args.concurrency:
                    result["runs"].append({"stage": 3, "spec": with_setting(top, "seqs", value),
                                           "error": f"not run: no more than {args.concurrency} requests at once"})
                    continue
                run(3, with_setting(top, "seqs", value))
    finally:
        children.stop_all()
    result["best"] = best(result["runs"])
    write_report(args.out, result, markdown(result))
    Path(args.out).with_suffix(".partial.json").unlink(missing_ok=True)


if __name__ == "__main__":
    main()
