"""Resident bytes of quantized weights: the loader's tensor bytes and the worker process's resident set beside them,
per weight format, against the GGUF file's size (the bar: within 1.2x of it for the GGUF path).

Each config is built in a fresh process, as a worker builds it (build_engine_core: the weights, the kernels checked
at load, the tokenizer), with a KV pool of 16 blocks (a worker's pool is sized by --kv-pool-bytes, not by its
weights), and answers one 8-token request, which reads every weight. Its resident set (VmRSS, and the anonymous and
file-backed parts, from /proc/self/status) is read after the imports and again after that request; the difference
is what the model costs the process. The GGUF path memory-maps the file: its pages count as file-backed resident
pages once read, and a second worker on the machine shares them.

    .venv/bin/python benchmarks/quantized_memory.py [--out benchmarks/reports/DATE-cpu-quantized-memory.json]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from serving.report import git_head, machine_line, write_report

REPO = Path(__file__).resolve().parent.parent
CONFIGS = ["gguf:bfloat16", "gguf:float32", "int8:bfloat16", "none:bfloat16", "none:float32"]
MIB = 1 << 20

CHILD = r"""
import gc, json, sys
import torch
from tokenfleet.backends.torch.builder import build_engine_core
from tokenfleet.engine.config import EngineConfig
from tokenfleet.engine.request_spec import RequestSpec
from tokenfleet.engine.sampling_params import SamplingParams
from tokenfleet.models.ggml_quant import QuantRows
from tokenfleet.models.gguf_import import GGUF_FILE, QUANTIZED_SUFFIX, default_source, ensure_default_model, ensure_model


def status():
    out = {}
    for line in open("/proc/self/status"):
        key, _, value = line.partition(":")
        if key in ("VmRSS", "RssAnon", "RssFile"):
            out[key] = int(value.split()[0]) * 1024
    return out


def nbytes(t):
    return sum(nbytes(p) for p in t.parts) if isinstance(t, QuantRows) else t.nbytes


quantization, dtype = sys.argv[1].split(":")
base = ensure_default_model()
folder = ensure_model(base.name + QUANTIZED_SUFFIX) if quantization == "gguf" else base
gc.collect()
before = status()
core = build_engine_core(EngineConfig(model=str(folder), dtype=dtype, num_threads=1, num_blocks=16,
                                      quantization="" if quantization == "none" else quantization))
core.add_request(RequestSpec(list(range(100, 108)), SamplingParams(max_tokens=2, temperature=0.0), request_id="r"))
while core.has_unfinished():
    core.step()
gc.collect()
after = status()
w = core.runner.model.weights
tensors = {id(t): t for t in [w.embed, w.lm_head, w.norm] + [getattr(layer, f) for layer in w.layers for f in
                                                            ("qkv", "o_proj", "gate_up", "down", "input_norm", "post_norm")]}
print(json.dumps({"before": before, "after": after, "tensor_bytes": sum(nbytes(t) for t in tensors.values()),
                  "kv_bytes": core.runner.kv.k.nbytes + core.runner.kv.v.nbytes,
                  "gguf_bytes": default_source().path.stat().st_size}))
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--configs", nargs="+", default=CONFIGS)
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "reports" /
                                             f"{time.strftime('%Y-%m-%d')}-cpu-quantized-memory.json"))
    args = parser.parse_args()
    rows = []
    for config in args.configs:
        done = subprocess.run([sys.executable, "-c", CHILD, config], capture_output=True, text=True, cwd=REPO)
        if done.returncode != 0:
            raise SystemExit(f"{config}: {done.stderr[-3000:]}")
        row = {"config": config, **json.loads(done.stdout.strip().splitlines()[-1])}
        row["rss_delta"] = {k: row["after"][k] - row["before"][k] for k in row["after"]}
        rows.append(row)
        print(f"{config}: tensors {row['tensor_bytes'] / MIB:.1f} MiB, RSS +{row['rss_delta']['VmRSS'] / MIB:.1f} MiB "
              f"(anon +{row['rss_delta']['RssAnon'] / MIB:.1f}, file +{row['rss_delta']['RssFile'] / MIB:.1f})",
              flush=True)
    result = {"started": time.strftime("%Y-%m-%d %H:%M:%S"), "git": git_head(), "machine": machine_line(),
              "rows": rows}
    write_report(args.out, result, markdown(result))
    print(markdown(result))


def markdown(result: dict) -> str:
    gguf = result["rows"][0]["gguf_bytes"]
    lines = [f"# Resident bytes of the default model's weights per format ({result['started']})", "",
             f"Machine: {result['machine']}. git {result['git']}. SmolLM2-135M-Instruct; its GGUF file (Q4_1 layers, "
             f"Q8_0 embedding and tied LM head) is {gguf / MIB:.1f} MiB. Each config built in a fresh process as a "
             "worker builds it (kernels checked at load, a 16-block KV pool), one 8-token request answered (every "
             "weight read); the process's resident set read before the build and after the request.", "",
             "| config | tensor bytes MiB | x GGUF file | RSS growth MiB | x GGUF file | anonymous MiB | file-backed MiB |"
             " KV pool MiB |", "|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        d = r["rss_delta"]
        lines.append(f"| `{r['config']}` | {r['tensor_bytes'] / MIB:.1f} | {r['tensor_bytes'] / gguf:.2f}x | "
                     f"{d['VmRSS'] / MIB:.1f} | {d['VmRSS'] / gguf:.2f}x | {d['RssAnon'] / MIB:.1f} | "
                     f"{d['RssFile'] / MIB:.1f} | {r['kv_bytes'] / MIB:.1f} |")
    lines += ["", "The RSS growth holds more than the weights: the kernels' load checks, the tokenizer, the sampler's "
              "buffers and allocator slack; the KV pool's column is part of it."]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
