"""LoRA adapters' cost: output tok/s of 16 concurrent requests spread over 4 adapters on one engine, against the
same load with no adapter (bar: >= 0.7x).

The adapters are made here with `peft` (rank --rank on every linear layer of the default model, small seeded random
weights), saved as PEFT folders and loaded into one engine (bf16, --threads torch threads). A run adds --requests
requests at once (request i uses adapter i mod 4, or none in the baseline), each a distinct chat prompt, greedy,
ignore_eos, --max-tokens tokens, and steps the engine until all finish; tok/s = output tokens / wall time. Runs
alternate baseline and adapters (--runs each, the first of each pair alternating); the ratio is the median of the
per-pair ratios.

    .venv/bin/python benchmarks/lora_throughput.py [--runs 3] [--out benchmarks/reports/lora.json]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from serving.report import git_head, write_report

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from tokenfleet.api.chat_template import render_chat  # noqa: E402
from tokenfleet.backends.torch.builder import build_engine_core  # noqa: E402
from tokenfleet.engine.config import EngineConfig  # noqa: E402
from tokenfleet.engine.request_spec import RequestSpec  # noqa: E402
from tokenfleet.engine.sampling_params import SamplingParams  # noqa: E402
from tokenfleet.models.gguf_import import ensure_default_model  # noqa: E402

TOPICS = ["apples", "rivers", "trains", "libraries", "mountains", "violins", "gardens", "bridges", "clouds",
          "bicycles", "lighthouses", "markets", "forests", "deserts", "harbours", "castles"]


def make_adapters(base: Path, folder: Path, count: int, rank: int) -> list[Path]:
    import peft
    import transformers

    out = []
    for i in range(count):
        torch.manual_seed(100 + i)
        model = peft.get_peft_model(transformers.AutoModelForCausalLM.from_pretrained(base, torch_dtype=torch.float32),
                                    peft.LoraConfig(r=rank, lora_alpha=2 * rank, target_modules="all-linear"))
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_" in name:
                    p.normal_(0.0, 0.02)
        model.save_pretrained(folder / f"adapter{i}")
        out.append(folder / f"adapter{i}")
    return out


def run(core, prompts: list[list[int]], adapters: list[str], max_tokens: int) -> tuple[float, int]:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        core.add_request(RequestSpec(prompt, params, request_id=f"r{time.monotonic_ns()}-{i}",
                                     adapter=adapters[i % len(adapters)] if adapters else ""))
    start = time.perf_counter()
    tokens = 0
    while core.has_unfinished():
        tokens += sum(len(o.new_token_ids) for o in core.step())
    return tokens / (time.perf_counter() - start), tokens


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--adapters", type=int, default=4)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--out", default="benchmarks/reports/lora-throughput.json")
    args = p.parse_args()
    base = ensure_default_model()
    with tempfile.TemporaryDirectory() as tmp:
        folders = make_adapters(base, Path(tmp), args.adapters, args.rank)
        core = build_engine_core(EngineConfig(model=str(base), dtype=args.dtype, num_threads=args.threads,
                                              enable_prefix_caching=False))
        names = []
        for i, folder in enumerate(folders):
            core.runner.load_adapter(f"a{i}", str(folder))  # type: ignore[attr-defined]
            names.append(f"a{i}")
        prompts = [core.tokenizer.encode(render_chat(core.tokenizer, [{"role": "user", "content":  # type: ignore[union-attr]
                                                                       f"Write a short paragraph about {t}."}]))
                   for t in TOPICS[: args.requests]]
        run(core, prompts[:2], names, 4)  # warm up both paths
        run(core, prompts[:2], [], 4)
        rows = []
        for r in range(args.runs):
            order = [("none", []), ("lora", names)] if r % 2 == 0 else [("lora", names), ("none", [])]
            row = {}
            for label, adapters in order:
                rate, tokens = run(core, prompts, adapters, args.max_tokens)
                row[label] = {"tok_s": rate, "tokens": tokens}
                print(f"run {r + 1} {label}: {rate:.1f} tok/s ({tokens} tokens)", flush=True)
            row["ratio"] = row["lora"]["tok_s"] / row["none"]["tok_s"]
            rows.append(row)
    median = statistics.median(r["ratio"] for r in rows)
    result = {"git": git_head(), "date": time.strftime("%Y-%m-%d %H:%M:%S"), "command": " ".join(sys.argv),
              "args": vars(args), "runs": rows, "ratio_median": median}
    lines = [f"# LoRA adapters: {args.requests} concurrent requests over {args.adapters} adapters vs none",
             "", f"git {result['git']}, {result['date']}. Command: `{result['command']}`", "",
             f"One engine ({args.dtype}, {args.threads} torch threads), adapters of rank {args.rank} on every linear "
             f"layer (made with peft, seeded), request i on adapter i mod {args.adapters}; {args.max_tokens} tokens "
             "each, greedy, ignore_eos, all added at once.", "",
             "| run | no adapters tok/s | adapters tok/s | ratio |", "|---|---|---|---|"]
    lines += [f"| {i + 1} | {r['none']['tok_s']:.1f} | {r['lora']['tok_s']:.1f} | {r['ratio']:.3f} |"
              for i, r in enumerate(rows)]
    lines += ["", f"Median ratio: **{median:.3f}** (bar >= 0.7: {'PASS' if median >= 0.7 else 'FAIL'})", ""]
    write_report(args.out, result, "\n".join(lines))


if __name__ == "__main__":
    main()
