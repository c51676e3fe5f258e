"""Engine throughput: tokenfleet's engine vs HF transformers `generate`, same prompts, same run.

For each batch size, B fresh random prompts of --prompt-len tokens arrive together and each
generates exactly --output-len tokens (ignore_eos). Output tok/s = B * output_len / wall time
(prefill included, for both). Also a single --prefill-len prompt's prefill tok/s.

    .venv/bin/python benchmarks/engine_throughput.py [--batches 1,8,32,64] [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import time
from pathlib import Path

import torch

from tokenfleet.engine.sampling_params import SamplingParams
from tokenfleet.llm import LLM
from tokenfleet.models.gguf_import import ensure_default_model


def fresh_prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(200, vocab) for _ in range(length)] for _ in range(n)]


def run_ours(llm: LLM, prompts: list[list[int]], output_len: int) -> dict:
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    before = llm.core.snapshot()
    start = time.perf_counter()
    results = llm.generate(prompts, params)
    wall = time.perf_counter() - start
    after = llm.core.snapshot()
    steps = after.num_steps - before.num_steps
    produced = sum(len(r.token_ids) for r in results)
    if produced != len(prompts) * output_len:
        raise RuntimeError(f"expected {len(prompts) * output_len} tokens, got {produced}")
    return {
        "wall_s": wall,
        "out_tok_s": produced / wall,
        "mean_step_ms": 1000 * (after.total_step_seconds - before.total_step_seconds) / max(steps, 1),
        "steps": steps,
    }


def run_hf(model, prompts: list[list[int]], output_len: int) -> dict:
    ids = torch.tensor(prompts, device=model.device)  # equal lengths: the padded batch needs no padding
    _sync(model.device)
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=output_len,
            min_new_tokens=output_len, do_sample=False, pad_token_id=0,
        )
    _sync(model.device)
    wall = time.perf_counter() - start
    produced = (out.shape[1] - ids.shape[1]) * ids.shape[0]
    return {"wall_s": wall, "out_tok_s": produced / wall, "mean_step_ms": 1000 * wall / output_len}


def run_vllm(python: str, model_dir: str, dtype: str, batches: list[list[list[int]]], output_len: int) -> list[dict]:
    """vLLM-CPU's offline API on the same prompts, in its own virtualenv (a subprocess)."""
    spec = {"model": model_dir, "dtype": dtype, "output_len": output_len, "batches": batches}
    script = Path(__file__).parent / "peers" / "vllm_offline.py"
    # both cores compute, as ours do: vLLM's default CPU binding keeps one core for an API server this offline
    # run does not have, and would leave it idle
    env = {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": f"0-{len(os.sched_getaffinity(0)) - 1}"}
    done = subprocess.run([python, str(script)], input=json.dumps(spec), capture_output=True, text=True, timeout=1800,
                          env=env)
    for line in done.stdout.splitlines():
        if line.startswith("VLLM_RESULT "):
            return json.loads(line.removeprefix("VLLM_RESULT "))
    raise RuntimeError(f"vLLM run failed (exit {done.returncode}):\n{done.stderr[-3000:]}")


def prefill_ours(llm: LLM, prompt: list[int]) -> float:
    start = time.perf_counter()
    llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
    return len(prompt) / (time.perf_counter() - start)


def prefill_hf(model, prompt: list[int]) -> float:
    ids = torch.tensor([prompt], device=model.device)
    _sync(model.device)
    start = time.perf_counter()
    with torch.inference_mode():
        model(ids, attention_mask=torch.ones_like(ids))
    _sync(model.device)
    return len(prompt) / (time.perf_counter() - start)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", default="1,8,32,64")
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--prefill-len", type=int, default=1024)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--skip-hf", action="store_true")
    parser.add_argument("--model", help="HF folder (default: the imported SmolLM2-135M-Instruct)")
    parser.add_argument("--device", default="auto", help="auto | cpu | cuda")
    parser.add_argument("--json", help="write results to this file")
    parser.add_argument("--vllm-python", help="python of a vLLM-CPU virtualenv: also run vLLM on the same prompts")
    args = parser.parse_args()

    model_dir = args.model or str(ensure_default_model())
    llm = LLM(model_dir, dtype=args.dtype, num_threads=args.threads, device=args.device,
              max_num_batched_tokens=args.max_num_batched_tokens)
    device = llm.core.runner.device
    vocab = llm.core.model.vocab_size
    hf = None
    if not args.skip_hf:
        from transformers import AutoModelForCausalLM

        hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, args.dtype)).to(device)
        hf.eval()
    print(f"device={device} threads={torch.get_num_threads()} dtype={args.dtype} "
          f"prompt={args.prompt_len} output={args.output_len}")

    # Warm up both (first calls allocate and pick kernels).
    warm = fresh_prompts(2, 32, vocab, seed=999)
    run_ours(llm, warm, 4)
    if hf is not None:
        run_hf(hf, warm, 4)

    batches = [int(b) for b in args.batches.split(",")]
    all_prompts = [fresh_prompts(b, args.prompt_len, vocab, seed=1000 + i) for i, b in enumerate(batches)]
    rows = []
    for batch, prompts in zip(batches, all_prompts):
        ours = run_ours(llm, prompts, args.output_len)
        base = run_hf(hf, prompts, args.output_len) if hf is not None else None
        ratio = ours["out_tok_s"] / base["out_tok_s"] if base else float("nan")
        rows.append({"batch": batch, "ours": ours, "hf": base, "ratio": ratio})
    if args.vllm_python:
        for row, peer in zip(rows, run_vllm(args.vllm_python, model_dir, args.dtype, all_prompts, args.output_len)):
            row["vllm"] = peer
    header = (
        f"{'batch':>5} | {'ours tok/s':>10} {'step ms':>8} | {'HF tok/s':>9} {'step ms':>8} | {'ratio':>5} | {'vLLM tok/s':>10}"
    )
    print(header)
    print("-" * len(header))
    for row in rows:
        ours, base = row["ours"], row["hf"]
        hf_cols = f"{base['out_tok_s']:>9.1f} {base['mean_step_ms']:>8.1f} | {row['ratio']:>5.2f}" if base else "-"
        peer = f"{row['vllm']['out_tok_s']:>10.1f}" if "vllm" in row else "-"
        print(f"{row['batch']:>5} | {ours['out_tok_s']:>10.1f} {ours['mean_step_ms']:>8.1f} | {hf_cols} | {peer}")

    prompt = fresh_prompts(1, args.prefill_len, vocab, seed=7)[0]
    ours_prefill = prefill_ours(llm, prompt)
    hf_prefill = prefill_hf(hf, prompt) if hf is not None else float("nan")
    print(f"prefill {args.prefill_len} tokens: ours {ours_prefill:.0f} tok/s, HF {hf_prefill:.0f} tok/s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "rows": rows, "prefill": {"ours": ours_prefill, "hf": hf_prefill}}, f, indent=2)


if __name__ == "__main__":
    main()
