"""bf16 numerics: how far the engine's bf16 logprobs are from fp32, next to HF transformers' own bf16.

The engine (in-process, bf16, the kernels this machine chooses: the native ones where a compiler is present)
decodes the chats of tests/model/test_bf16_numerics.py greedily, 32 tokens, reporting each token's logprob and the
prompt's. HF transformers teacher-forces the same tokens in fp32 (the reference) and in bf16. Reported: the mean
|logprob - fp32| of ours and of HF bf16's, in decode and in prefill, and their ratio (the test's bar: at most 1.1x).

    .venv/bin/python benchmarks/bf16_numerics.py [--out benchmarks/reports/bf16-numerics.json]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
from serving.report import git_head, machine_line, write_report

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "reports" / "bf16-numerics.json"))
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    from transformers import AutoModelForCausalLM

    from tests.model.helpers import make_core
    from tests.model.test_bf16_numerics import CHATS_WITH_FACTS, MORE_CHATS, ours, teacher_forced_logprobs
    from tests.model.test_hf_parity import chat_ids
    from tokenfleet.models.gguf_import import ensure_default_model

    model_dir = ensure_default_model()
    core = make_core(model_dir, dtype="bfloat16", num_blocks=256, num_threads=args.threads)
    hf = {d: AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=d).eval() for d in (torch.float32, torch.bfloat16)}
    errors: dict[str, dict[str, list[float]]] = {k: {"ours": [], "hf_bf16": []} for k in ("decode", "prefill")}
    for index, messages in enumerate(CHATS_WITH_FACTS + MORE_CHATS):
        prompt = chat_ids(core, messages)
        tokens, logprobs, prompt_lps = ours(core, prompt, f"numerics-{index}")
        ids = prompt + tokens
        ref = teacher_forced_logprobs(hf[torch.float32], ids)
        theirs = teacher_forced_logprobs(hf[torch.bfloat16], ids)
        n = len(prompt) - 1
        errors["decode"]["ours"] += (torch.tensor(logprobs[1:]) - ref[n + 1:]).abs().tolist()
        errors["decode"]["hf_bf16"] += (theirs[n + 1:] - ref[n + 1:]).abs().tolist()
        errors["prefill"]["ours"] += (torch.tensor(prompt_lps + logprobs[:1]) - ref[: n + 1]).abs().tolist()
        errors["prefill"]["hf_bf16"] += (theirs[: n + 1] - ref[: n + 1]).abs().tolist()
    result: dict = {"started": time.strftime("%Y-%m-%d %H:%M:%S"), "machine": machine_line(), "commit": git_head(),
                    "kernels": [c.serving for c in core.model.kernel_checks]}
    for phase, e in errors.items():
        ours_mean, hf_mean = sum(e["ours"]) / len(e["ours"]), sum(e["hf_bf16"]) / len(e["hf_bf16"])
        result[phase] = {"tokens": len(e["ours"]), "ours": ours_mean, "hf_bf16": hf_mean, "ratio": ours_mean / hf_mean}
    write_report(args.out, result, markdown(result))


def markdown(r: dict) -> str:
    lines = [f"# bf16 numerics: mean |logprob - fp32|, ours vs HF bf16 ({r['started']})", "",
             f"Machine: {r['machine']}; commit {r['commit']}; kernels serving: {', '.join(r['kernels'])}.", "",
             "| phase | tokens | ours | HF bf16 | ours / HF bf16 (bar 1.1) |", "|---|---|---|---|---|"]
    for phase in ("decode", "prefill"):
        p = r[phase]
        lines.append(f"| {phase} | {p['tokens']} | {p['ours']:.4f} | {p['hf_bf16']:.4f} | {p['ratio']:.2f} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
