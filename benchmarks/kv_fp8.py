"""FP8 KV cache on the CPU (the GPU figures come from benchmarks/gpu_step.py): capacity, step
time and accuracy of ``kv_cache_dtype="fp8"`` against the bf16 cache, same model, same script.

- capacity: KV blocks the same ``kv_cache_bytes`` holds, bf16 vs FP8 (the engine's own sizing).
- decode step: for each --shapes BxC, B requests with distinct C-token prompts, then --steps timed engine steps
  (``EngineCore.step``, median); configurations alternate, --runs rounds. Configurations:
  - bf16: the serving default on CPU (the native C attention and layer kernels);
  - fp8: the FP8 cache (the native kernels' FP8 variants: attention reading FP8 rows, the RoPE + KV write
    quantizing);
  - fp8-torch: the FP8 cache read by the torch reference attention.
- accuracy: teacher-forced on tests/model/test_fp8_accuracy.py's text in 16-token chunks: top-1 agreement with
  bf16 and perplexity.

    .venv/bin/python benchmarks/kv_fp8.py --out benchmarks/reports/2026-11-26-cpu-kv-fp8.json
"""

from __future__ import annotations

import argparse
import gc
import math
import os
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.serving.report import git_head, write_report  # noqa: E402
from tokenfleet.backends.torch.builder import build_engine_core  # noqa: E402
from tokenfleet.engine.config import EngineConfig  # noqa: E402
from tokenfleet.engine.request_spec import RequestSpec
from tokenfleet.engine.sampling_params import SamplingParams  # noqa: E402
from tokenfleet.models.attention import TorchPagedAttention  # noqa: E402
from tokenfleet.models.gguf_import import ensure_default_model  # noqa: E402
from tokenfleet.models.tokenizer import Tokenizer  # noqa: E402

CONFIGS = {"bf16": "", "fp8": "fp8", "fp8-torch": "fp8"}


def build(model: str, name: str, threads: int, **options):
    core = build_engine_core(EngineConfig(model=model, dtype="bfloat16", num_threads=threads,
                                          kv_cache_dtype=CONFIGS[name], **options))
    if name.endswith("-torch"):
        core.runner.model.attention = TorchPagedAttention()
    return core


def decode_steps(core, batch: int, context: int, steps: int, seed: int) -> list[float]:
    rng = random.Random(seed)
    vocab = core.model.vocab_size
    params = SamplingParams(max_tokens=steps + 8, temperature=0.0, ignore_eos=True)
    for i in range(batch):
        core.add_request(RequestSpec([rng.randrange(200, vocab) for _ in range(context)], params, request_id=f"{seed}-{i}"))
    while core.scheduler.waiting or any(r.num_computed_tokens < r.num_prompt_tokens for r in core.scheduler.running):
        core.step()  # prefill, not timed
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        core.step()
        times.append(time.perf_counter() - t)
    for i in range(batch):
        core.abort(f"{seed}-{i}")
    while core.has_unfinished():
        core.step()
    return times


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default="8x512,4x2048", help="BATCHxCONTEXT decode shapes")
    p.add_argument("--steps", type=int, default=32)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--threads", type=int, default=int(os.environ.get("TOKENFLEET_NUM_THREADS", "2")))
    p.add_argument("--kv-cache-bytes", type=int, default=1 << 30)
    p.add_argument("--out", default="benchmarks/reports/cpu-kv-fp8.json")
    args = p.parse_args()
    model = str(ensure_default_model())

    capacity = {}
    for name in ("bf16", "fp8"):
        core = build(model, name, args.threads, kv_cache_bytes=args.kv_cache_bytes)
        capacity[name] = core.scheduler.block_manager.num_blocks
        del core
    gc.collect()

    shapes = [tuple(int(v) for v in shape.split("x")) for shape in args.shapes.split(",")]
    blocks = max(b * -(-(c + args.steps + 16) // 16) for b, c in shapes) + 8
    cores = {name: build(model, name, args.threads, num_blocks=blocks) for name in CONFIGS}
    runs: dict[str, dict[str, list[float]]] = {f"{b}x{c}": {name: [] for name in CONFIGS} for b, c in shapes}
    for batch, context in shapes:
        shape = f"{batch}x{context}"
        for r in range(args.runs):
            for name, core in cores.items():  # alternating: every round runs each configuration once
                times = decode_steps(core, batch, context, args.steps, seed=100 * r + 7)
                runs[shape][name].append(1000 * statistics.median(times))
                print(f"{shape} run {r + 1} {name:10s} step {runs[shape][name][-1]:.2f} ms", flush=True)

    from tests.model.test_fp8_accuracy import TEXT, teacher_forced

    prompt = Tokenizer(model).encode(TEXT)
    forced = {name: teacher_forced(build(model, name, args.threads, num_blocks=64, max_prefill_chunk=16), prompt)
              for name in ("bf16", "fp8")}
    agreement = sum(a.top[0][0] == b.top[0][0] for a, b in zip(forced["bf16"], forced["fp8"])) / len(prompt[1:])
    ppl = {name: math.exp(-sum(lp.logprob for lp in lps) / len(lps)) for name, lps in forced.items()}

    med = {shape: {name: statistics.median(v) for name, v in by_name.items()} for shape, by_name in runs.items()}
    result = {"commit": git_head(), "args": vars(args), "capacity_blocks": capacity, "step_ms_runs": runs,
              "step_ms_median": med, "top1_agreement": agreement, "perplexity": ppl, "positions": len(prompt) - 1}
    lines = [
        "# FP8 KV cache on the CPU: capacity, decode step, accuracy (SmolLM2-135M-Instruct, bf16 weights)",
        "",
        f"Commit {result['commit']}. `.venv/bin/python benchmarks/kv_fp8.py --out {args.out}`: {args.threads} torch "
        f"threads, block size 16.",
        "",
        f"**Capacity** ({args.kv_cache_bytes >> 20} MiB of KV): bf16 {capacity['bf16']} blocks, FP8 {capacity['fp8']} "
        f"blocks, **{capacity['fp8'] / capacity['bf16']:.2f}x** the tokens.",
        "",
        f"**Decode step** (median of {args.steps} engine steps; batch x prompt tokens; configurations alternate, "
        f"{args.runs} rounds):",
        "",
        "| shape | configuration | every run (ms) | median (ms) | vs bf16 |",
        "|---|---|---|---|---|",
    ]
    for shape, by_name in runs.items():
        for name in CONFIGS:
            lines.append(f"| {shape} | {name} | {', '.join(f'{v:.2f}' for v in by_name[name])} | {med[shape][name]:.2f} | "
                         f"{med[shape][name] / med[shape]['bf16']:.2f}x |")
    lines += [
        "",
        "bf16: the native C attention kernel (AVX-512 BF16 where the CPU has it) and layer ops; fp8: the same "
        "kernels' FP8 variants (key tiles converted from e4m3 to bf16 exactly, scales applied per key and value; "
        "the RoPE + KV write quantizes in C); fp8-torch: the torch reference attention over the same rows. The GPU "
        "reads FP8 rows with the Triton kernel: benchmarks/gpu_step.py's graphs-fp8kv modes.",
        "",
        f"**Accuracy** (teacher-forced, {result['positions']} positions, 16-token prefill chunks so each chunk reads "
        f"the text before it from the cache): top-1 agreement with bf16 **{agreement:.1%}**, perplexity bf16 "
        f"{ppl['bf16']:.3f}, FP8 KV {ppl['fp8']:.3f} ({ppl['fp8'] / ppl['bf16'] - 1:+.1%}).",
    ]
    write_report(args.out, result, "\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
