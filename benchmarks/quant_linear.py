"""Quantized linear layers (models.quant_linear, csrc/quant_linear.c) against the dense CPU matmuls, matmul by matmul.

SmolLM2-135M's layer shapes in the default GGUF's types: qkv, o_proj, gate_up and down in Q4_1, the (tied) LM head
in Q8_0 (or ``--model gemma3-270m``: Q5_0, Q4_K, Q6_K, Q8_0), each layer shape as one distinct weight per layer of
the model (each pass reads them from memory, as a decode step does), the LM head once. Implementations, each on
its own copy of the same weights:

- ``quant``: QuantLinear with the native kernel (x fp32; steps of up to 32 rows), the quantized bytes in memory;
- ``quant bf16 x``: the same with bf16 x (one row: the fp32 kernel; more: the AVX-512 BF16 kernel, weights rounded
  to bf16; up to 32 rows, then dequantize and oneDNN);
- ``quant int8``: the same with int8 activations (Q4_1 and Q8_0: x quantized per 32 values, integer dot products;
  steps of up to 4 rows, more rows: the fp32 kernel);
- ``quant dequant+mm``: the same weights through QuantLinear's prefill path (dequantize, then F.linear in fp32);
- ``quant dequant+mm bf16``: the same with bf16 x (weights dequantized to bf16, F.linear in bf16: oneDNN);
- ``bf16 oneDNN``: PackedOneDNNLinear on the dequantized weights in bf16 (x bf16), the bf16 engine's matmul;
- ``fp32 F.linear``: F.linear (MKL) on the dequantized weights in fp32;
- ``fp32 few-row``: the fp32 engine's matmul (csrc/skinny_linear.c up to 32 rows).

Before timing, each output is compared with the float64 reference (dequantize, then matmul): ``quant`` must be
within the fp32 summation bound (k 2^-24 sum |x w|), the other ``quant`` paths within 2% of the outputs' scale; every
implementation's largest error relative to the outputs' scale is reported. Each round times every
implementation (order alternating between rounds) over ``--passes`` passes; reported: per-call milliseconds per
round (the median of its passes: on a shared machine a pass another process interrupts does not count), the
weight bytes streamed per second, and the median over rounds of the per-round speedups of ``quant`` and ``quant
int8``.

    .venv/bin/python benchmarks/quant_linear.py [--rows 1,32] [--rounds 3] [--out benchmarks/reports/DATE-quant-linear.json]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from serving.report import git_head, machine_line, write_report

from tokenfleet.models.ggml_quant import QuantTensor, dequantize, random_quant
from tokenfleet.models.linear import DenseLinear, PackedOneDNNLinear, native_few_rows
from tokenfleet.models.quant_linear import QuantLinear, native_quant_matmul

MODELS = {  # (layers, [(layer, ggml type, out, in)])
    "smollm2-135m": (30, (("qkv", "Q4_1", 960, 576), ("o_proj", "Q4_1", 576, 576), ("gate_up", "Q4_1", 3072, 576),
                          ("down", "Q4_1", 576, 1536), ("lm_head", "Q8_0", 49152, 576))),
    # Gemma 3 270M in a K-quant mix: rows of 640 are not whole 256-blocks, so those layers fall back to Q5_0 / Q8_0
    "gemma3-270m": (18, (("qkv", "Q5_0", 1536, 640), ("o_proj", "Q4_K", 640, 1024), ("gate_up", "Q5_0", 4096, 640),
                         ("down", "Q6_K", 640, 2048), ("lm_head", "Q8_0", 262144, 640))),
}
BASELINES = ("bf16 oneDNN", "fp32 F.linear")


def implementations(quant: QuantLinear) -> dict[str, tuple[Callable, Callable, torch.dtype]]:
    """name -> (prepare(quantized, fp32 values) -> weight, call(x, weight) -> y, x dtype)."""
    impls: dict[str, tuple[Callable, Callable, torch.dtype]] = {
        "quant": (lambda q, v: quant.prepare(q), quant, torch.float32),
        "quant bf16 x": (lambda q, v: quant.prepare(q), quant, torch.bfloat16),
        "quant int8": (lambda q, v: quant.prepare(q), QuantLinear(quant.native, int8_activations=True), torch.float32),
        "quant dequant+mm": (lambda q, v: q, QuantLinear(quant.native, few_rows=0), torch.float32),
        "quant dequant+mm bf16": (lambda q, v: q, QuantLinear(quant.native, few_rows=0), torch.bfloat16),
        "bf16 oneDNN": (lambda q, v: PackedOneDNNLinear().prepare(v.bfloat16()), PackedOneDNNLinear(), torch.bfloat16),
        "fp32 F.linear": (lambda q, v: v.clone(), F.linear, torch.float32),
    }
    few = native_few_rows()
    if few is not None:
        impls["fp32 few-row"] = (lambda q, v: v.clone(), DenseLinear(few), torch.float32)
    return impls


def check(name: str, got: torch.Tensor, x: torch.Tensor, values: torch.Tensor) -> float:
    """max |got - reference| / max |reference|; ``quant`` must be within the fp32 summation bound, ``quant int8``
    within 2% of the outputs' scale (its activation rounding is ~0.5%: models.quant_linear.QuantLinear)."""
    want = F.linear(x.double(), values.double())
    error = (got.double() - want).abs()
    bound = x.shape[1] * 2.0**-24 * F.linear(x.double().abs(), values.double().abs()) + 1e-30
    relative = float(error.max() / want.abs().max())
    if name == "quant" and float((error / bound).max()) > 1 or name != "quant" and name.startswith("quant") and relative > 0.02:
        raise SystemExit(f"{name}: off by {relative:.3g} of the outputs' scale: the kernel is wrong here, nothing timed")
    return relative


def bench_shape(label: str, kind: str, n: int, k: int, rows: int, args: argparse.Namespace,
                impls: dict[str, tuple[Callable, Callable, torch.dtype]]) -> dict:
    g = torch.Generator().manual_seed(n * 7 + k)
    copies = 1 if label == "lm_head" else MODELS[args.model][0]
    quantized: list[QuantTensor] = [random_quant(kind, n, k, g) for _ in range(copies)]
    x32 = torch.randn(rows, k, generator=g)
    weights: dict[str, list] = {}
    errors: dict[str, float] = {}
    for name, (prepare, call, dtype) in impls.items():
        weights[name] = [prepare(q, dequantize(q)) for q in quantized]
        x = x32.to(dtype)
        errors[name] = check(name, call(x, weights[name][0]).float(), x, dequantize(quantized[0]))
    runs: dict[str, list[float]] = {name: [] for name in impls}
    for r in range(args.rounds):
        for name in (list(impls) if r % 2 == 0 else list(reversed(impls))):
            _, call, dtype = impls[name]
            x = x32.to(dtype)
            for w in weights[name][:2]:
                call(x, w)  # warm-up
            passes = []
            for _ in range(args.passes):
                start = time.perf_counter()
                for w in weights[name]:
                    call(x, w)
                passes.append((time.perf_counter() - start) * 1e3 / copies)
            runs[name].append(statistics.median(passes))  # a pass the scheduler interrupted does not count
    nbytes = quantized[0].nbytes
    def speedups(of: str) -> dict[str, float]:
        return {base: statistics.median(runs[base][i] / runs[of][i] for i in range(args.rounds)) for base in BASELINES}

    return {"shape": label, "kind": kind, "n": n, "k": k, "rows": rows, "copies": copies, "weight_bytes": nbytes,
            "runs_ms": runs, "median_ms": {name: statistics.median(v) for name, v in runs.items()},
            "quant_gb_s": nbytes / statistics.median(runs["quant"]) / 1e6,
            "int8_gb_s": nbytes / statistics.median(runs["quant int8"]) / 1e6,
            "speedup_of_quant": speedups("quant"), "speedup_of_int8": speedups("quant int8"),
            "error_over_fp32_bound": errors}


def markdown(res: dict) -> str:
    names = list(res["results"][0]["median_ms"])
    lines = [f"# Quantized linear layers: native kernel vs dense CPU matmuls ({res['date']})", "",
             f"Shapes: {res['model']}. Machine: {res['machine']}. Threads: {res['threads']}. Kernel: {res['kernel']}. "
             f"Commit {res['commit']}.",
             f"Rounds: {res['rounds']} (alternating order), {res['passes']} passes each (a round: the median pass); "
             "per-call ms, median over rounds; "
             "speedup = median over rounds of (baseline ms / quant ms).", ""]
    for rows in res["rows"]:
        lines += [f"## {rows} row(s) of x", "",
                  "| layer | type | [n, k] | " + " | ".join(f"{n} ms" for n in names)
                  + " | quant GB/s | int8 GB/s | quant / int8 x vs bf16 | quant / int8 x vs fp32 |",
                  "|" + "---|" * (len(names) + 7)]
        for r in (r for r in res["results"] if r["rows"] == rows):
            s, i = r["speedup_of_quant"], r["speedup_of_int8"]
            lines.append(f"| {r['shape']} | {r['kind']} | [{r['n']}, {r['k']}] | "
                         + " | ".join(f"{r['median_ms'][n]:.4f}" for n in names)
                         + f" | {r['quant_gb_s']:.1f} | {r['int8_gb_s']:.1f} | {s['bf16 oneDNN']:.2f} / {i['bf16 oneDNN']:.2f}"
                         f" | {s['fp32 F.linear']:.2f} / {i['fp32 F.linear']:.2f} |")
        step = {n: sum(r["median_ms"][n] * r["copies"] for r in res["results"] if r["rows"] == rows) for n in names}
        total = ", ".join(f"{n} {v:.2f}" for n, v in step.items())
        lines += ["", f"Whole model ({res['layers']} layers + LM head), ms: {total}", ""]
    errors = ("; ".join(f"{r['shape']} x{r['rows']}: " + ", ".join(f"{n} {e:.3g}" for n, e in r["error_over_fp32_bound"].items())
                        for r in res["results"]))
    lines += ["Largest |error| / max |reference| (float64, dequantized weights): " + errors, ""]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="1,32")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--passes", type=int, default=5)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--model", choices=sorted(MODELS), default="smollm2-135m", help="whose layer shapes and types")
    ap.add_argument("--shapes", default="qkv,o_proj,gate_up,down,lm_head")
    ap.add_argument("--out", default=f"benchmarks/reports/{time.strftime('%Y-%m-%d')}-quant-linear.json")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    native = native_quant_matmul()
    if native is None:
        raise SystemExit("the native quantized matmul cannot be built here")
    impls = implementations(QuantLinear(native))
    rows_list = [int(r) for r in args.rows.split(",")]
    wanted = args.shapes.split(",")
    results = [bench_shape(label, kind, n, k, rows, args, impls)
               for rows in rows_list for label, kind, n, k in MODELS[args.model][1] if label in wanted]
    res = {"date": time.strftime("%Y-%m-%d %H:%M"), "machine": machine_line(), "threads": torch.get_num_threads(),
           "kernel": native.name, "commit": git_head(), "model": args.model,
           "layers": MODELS[args.model][0], "rounds": args.rounds, "passes": args.passes,
           "rows": rows_list, "results": results}
    write_report(Path(args.out), res, markdown(res))


if __name__ == "__main__":
    main()
