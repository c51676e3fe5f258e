"""Quantized weights in the engine (no service path): decode speed at one stream and at 32, per weight format.

Configs (QUANTIZATION:DTYPE; default: ``none:bfloat16``, ``none:float32``, ``gguf:bfloat16``, ``gguf:float32``,
``int8:bfloat16``): ``none`` the imported weights (``none:bfloat16`` the baseline), ``gguf`` the default model's GGUF
kept quantized (Q4_1 layers, Q8_0 embedding and LM head), ``int8`` the imported weights quantized at load. The
engine's CPU threads are --threads, steps of up to 4 tokens one fewer where those are every core (as a worker runs:
EngineConfig.small_step_threads). Quantized configs take int8 activations on decode steps unless
TOKENFLEET_QUANT_ACTIVATIONS=float. Before timing, every config answers the check prompts greedily and the quantized
ones are compared with their reference: with float activations ``gguf:float32`` must equal ``none:float32`` token for
token (the same weight values); with int8 activations its first tokens must, and every config's match rate against
``none:float32`` is reported.

Each round runs every config, in an order that alternates between rounds:

- c=1: one fresh --prompt-len prompt generating --output-len tokens (ignore_eos); TPOT = decode steps' mean time;
- c=32: 32 fresh prompts arriving together; output tok/s over the whole run (prefill included).

Ratios against ``none:bfloat16`` within each round; the median of the per-round ratios is reported. At c=1 the
decode step of each config is broken down once (outside the timed rounds) into the linear layers (weights read:
the quantized matmul or the dense one) and the rest (attention, norms, sampling, the engine's own work).

    .venv/bin/python benchmarks/quantized_engine.py [--rounds 3] [--threads 1]
        [--out benchmarks/reports/DATE-cpu-quantized-engine.json]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from pathlib import Path

import torch
from serving.report import git_head, machine_line, write_report

from tokenfleet import envs
from tokenfleet.engine.request_spec import RequestSpec
from tokenfleet.engine.sampling_params import SamplingParams
from tokenfleet.models.gguf_import import QUANTIZED_SUFFIX, ensure_default_model, ensure_model

REPO = Path(__file__).resolve().parent.parent
CHECK_PROMPTS = ["The capital of France is", "def fibonacci(n):", "Water boils at a temperature of",
                 "The three primary colors are"]


def build(config: str, threads: int):  # type: ignore[no-untyped-def]
    from tokenfleet.backends.torch.builder import build_engine_core
    from tokenfleet.engine.config import EngineConfig

    quantization, dtype = config.split(":")
    base = ensure_default_model()
    folder = ensure_model(base.name + QUANTIZED_SUFFIX) if quantization == "gguf" else base
    return build_engine_core(EngineConfig(model=str(folder), dtype=dtype, num_threads=threads, num_blocks=2048,
                                          quantization="" if quantization == "none" else quantization))


def run(core, prompts: list[list[int]], output_len: int, on_step=None) -> tuple[dict[str, list[int]], list[float], float]:  # type: ignore[no-untyped-def]
    """Every prompt to ``output_len`` tokens; (outputs, each step's seconds, wall seconds). ``on_step(i)``: called
    after step i."""
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    out: dict[str, list[int]] = {}
    for i, prompt in enumerate(prompts):
        rid = f"r{time.monotonic_ns()}-{i}"
        core.add_request(RequestSpec(prompt, params, request_id=rid))
        out[rid] = []
    steps: list[float] = []
    start = time.perf_counter()
    while core.has_unfinished():
        t = time.perf_counter()
        for o in core.step():
            out[o.request_id] += o.new_token_ids
        steps.append(time.perf_counter() - t)
        if on_step is not None:
            on_step(len(steps) - 1)
    return out, steps, time.perf_counter() - start


def fresh(n: int, length: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(200, 40_000) for _ in range(length)] for _ in range(n)]


def breakdown(core, prompt: list[int], output_len: int) -> dict:  # type: ignore[no-untyped-def]
    """A c=1 decode step split into the linear layers' time (the weights read), attention's and the rest (one
    untimed-round run; the model's linear kernel and the attention function wrapped with timers)."""
    import tokenfleet.models.llama as llama

    model = core.runner.model
    linear, attention = model.linear, llama.paged_attention
    spent = {"linear": 0.0, "attention": 0.0}

    def timer(part, fn):  # type: ignore[no-untyped-def]
        def timed(*args):  # type: ignore[no-untyped-def]
            t = time.perf_counter()
            y = fn(*args)
            spent[part] += time.perf_counter() - t
            return y
        return timed

    model.linear, llama.paged_attention = timer("linear", linear), timer("attention", attention)
    try:
        run(core, [prompt], 4)  # warm-up

        def after(i: int) -> None:
            if i == 0:  # the prefill: not counted
                spent.update(linear=0.0, attention=0.0)

        steps = run(core, [prompt], output_len, on_step=after)[1][1:]
    finally:
        model.linear, llama.paged_attention = linear, attention
    step_ms = 1000 * statistics.mean(steps)
    return {"step_ms": step_ms, "linear_ms": 1000 * spent["linear"] / len(steps),
            "attention_ms": 1000 * spent["attention"] / len(steps),
            "other_ms": step_ms - 1000 * (spent["linear"] + spent["attention"]) / len(steps),
            "linear_impl": getattr(linear, "name", type(linear).__name__)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--configs", nargs="+", default=["none:bfloat16", "none:float32", "gguf:bfloat16", "gguf:float32",
                                                        "int8:bfloat16"])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "reports" /
                                             f"{time.strftime('%Y-%m-%d')}-cpu-quantized-engine.json"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    base = args.configs[0]
    cores = {c: build(c, args.threads) for c in args.configs}
    tokenizer = cores[base].tokenizer
    checks = [tokenizer.encode(p) for p in CHECK_PROMPTS]
    answers = {c: list(run(core, checks, 16)[0].values()) for c, core in cores.items()}
    reference = answers.get("none:float32", answers[base])
    agreement = {c: sum(a == b for a, b in zip(ans, reference, strict=True)) / len(reference) for c, ans in answers.items()}
    if "gguf:float32" in answers and "none:float32" in answers:
        ours, ref = answers["gguf:float32"], answers["none:float32"]
        if envs.quant_activations() == "float" and ours != ref:
            raise SystemExit("gguf:float32 with float activations does not answer as none:float32 (the same weight "
                             "values): not timing a wrong path")
        if any(a[:1] != b[:1] for a, b in zip(ours, ref, strict=True)):  # int8 activations: the first tokens at least
            raise SystemExit("gguf:float32's first tokens differ from none:float32's: not timing a wrong path")
    result: dict = {"started": time.strftime("%Y-%m-%d %H:%M:%S"), "args": vars(args), "git": git_head(),
                    "machine": machine_line(), "check_agreement": agreement, "runs": [],
                    "breakdown": {c: breakdown(core, fresh(1, args.prompt_len, 99)[0], args.output_len)
                                  for c, core in cores.items()}}
    for rnd in range(args.rounds):
        order = args.configs if rnd % 2 == 0 else list(reversed(args.configs))
        for config in order:
            core = cores[config]
            _, steps, _ = run(core, fresh(1, args.prompt_len, 1000 + rnd), args.output_len)
            tpot_ms = 1000 * statistics.mean(steps[1:])
            outs, _, wall = run(core, fresh(args.batch, args.prompt_len, 2000 + rnd), args.output_len)
            tok_s = sum(len(v) for v in outs.values()) / wall
            result["runs"].append({"round": rnd + 1, "config": config, "tpot_ms": tpot_ms, "tok_s": tok_s})
            print(f"round {rnd + 1} {config}: c=1 TPOT {tpot_ms:.2f} ms, c={args.batch} {tok_s:.1f} tok/s", flush=True)
    ratios: dict[str, dict[str, float]] = {}
    for config in args.configs:
        per = [(r, next(b for b in result["runs"] if b["round"] == r["round"] and b["config"] == base))
               for r in result["runs"] if r["config"] == config]
        ratios[config] = {"tpot_vs_base": statistics.median(r["tpot_ms"] / b["tpot_ms"] for r, b in per),
                          "tok_s_vs_base": statistics.median(r["tok_s"] / b["tok_s"] for r, b in per),
                          "tpot_ms_median": statistics.median(r["tpot_ms"] for r, _ in per),
                          "tok_s_median": statistics.median(r["tok_s"] for r, _ in per)}
    result["ratios"] = ratios
    write_report(args.out, result, markdown(result))
    print(markdown(result))


def markdown(result: dict) -> str:
    a = result["args"]
    lines = [f"# Quantized weights in the engine ({result['started']})", "",
             f"Machine: {result['machine']}, {a['threads']} thread(s). git {result['git']}. In-process engine (no "
             f"service path), SmolLM2-135M-Instruct. c=1: one {a['prompt_len']}-token prompt, {a['output_len']} "
             f"tokens, TPOT = mean decode step; c={a['batch']}: {a['batch']} prompts arriving together, output tok/s "
             f"over the run. {a['rounds']} rounds, order alternating; ratios against `{a['configs'][0]}` per round, "
             "then their median.", "",
             "Greedy answers to the check prompts, share equal to `none:float32`'s: " +
             ", ".join(f"`{c}` {v:.0%}" for c, v in result["check_agreement"].items()) + ".", "",
             f"| config | c=1 TPOT ms (median) | vs {a['configs'][0]} | c={a['batch']} tok/s (median) | "
             f"vs {a['configs'][0]} |", "|---|---|---|---|---|"]
    for c, r in result["ratios"].items():
        lines.append(f"| `{c}` | {r['tpot_ms_median']:.2f} | {r['tpot_vs_base']:.2f}x | {r['tok_s_median']:.1f} | "
                     f"{r['tok_s_vs_base']:.2f}x |")
    lines += ["", "Every run:", "", "| round | config | c=1 TPOT ms | tok/s |", "|---|---|---|---|"]
    lines += [f"| {r['round']} | `{r['config']}` | {r['tpot_ms']:.2f} | {r['tok_s']:.1f} |" for r in result["runs"]]
    lines += ["", "c=1 decode step, split once outside the timed rounds (the linear layers and attention timed in "
              "place):", "",
              "| config | step ms | linear layers ms | attention ms | the rest ms | linear kernel |",
              "|---|---|---|---|---|---|"]
    lines += [f"| `{c}` | {b['step_ms']:.2f} | {b['linear_ms']:.2f} | {b.get('attention_ms', 0):.2f} | "
              f"{b['other_ms']:.2f} | {b['linear_impl']} |" for c, b in result["breakdown"].items()]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
