"""Greedy chat parity: `tokenfleet up` (bf16, or --up-arg=--dtype --up-arg=float32) vs HF transformers' greedy
output in fp32 and in bf16.

The chats of tests/model/test_hf_parity.py plus "What is the boiling point of water at sea level?",
32 tokens, temperature 0, sent one after the other through the server's /v1/chat/completions (so
later chats hit the prefix cache for the template's system prompt, as a user's would). A reply is
identical to a reference when its text equals the reference's decoded greedy tokens (up to EOS).
For a reply that matches neither: the first token where it leaves the fp32 path and the fp32 top-2
logit margin there. The bar: all but one identical to one of the two references.

    .venv/bin/python benchmarks/chat_parity.py [--out benchmarks/reports/chat-parity.json]
    .venv/bin/python benchmarks/chat_parity.py --vllm-python VLLM_VENV/bin/python   # the peer, same chats
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import urllib.request
from pathlib import Path

import torch
from serve_peer import start_tokenfleet, start_vllm
from serving.procs import Children
from serving.report import git_head, machine_line, write_report

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
MAX_TOKENS = 32


def served(url: str, model: str, messages: list[dict]) -> str:
    body = json.dumps({"model": model, "messages": messages, "max_tokens": MAX_TOKENS, "temperature": 0}).encode()
    request = urllib.request.Request(f"{url}/v1/chat/completions", data=body, headers={"content-type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as response:
        return json.loads(response.read())["choices"][0]["message"]["content"]


def hf_reference(model, tokenizer, prompt: list[int]) -> tuple[list[int], torch.Tensor]:
    from tests.model.helpers import hf_greedy

    tokens, logits = hf_greedy(model, prompt, MAX_TOKENS)
    eos = tokenizer.eos_token_id
    if eos in tokens:  # the reply ends there; the logits that chose EOS stay (a divergence may be there)
        cut = tokens.index(eos)
        tokens, logits = tokens[:cut], logits[: cut + 1]
    return tokens, logits


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "reports" / "chat-parity.json"))
    parser.add_argument("--up-arg", action="append", default=[])
    parser.add_argument("--vllm-python", help="serve with vLLM-CPU (its virtualenv's python; serve_peer.py's best "
                        "configuration) instead of `tokenfleet up`: the peer's parity on the same chats")
    args = parser.parse_args()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tests.model.test_bf16_numerics import CHATS_WITH_FACTS
    from tokenfleet.models.gguf_import import DEFAULT_MODEL_NAME, ensure_default_model

    model_dir = str(Path(ensure_default_model()).resolve())
    children = Children()
    try:
        if args.vllm_python:
            _, url = start_vllm(children, args.vllm_python, model_dir, DEFAULT_MODEL_NAME)
        else:
            _, url = start_tokenfleet(children, DEFAULT_MODEL_NAME, args.up_arg)
        replies = [served(url, DEFAULT_MODEL_NAME, messages) for messages in CHATS_WITH_FACTS]
    finally:
        children.stop_all()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    references = {dtype: AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
                  for dtype in (torch.float32, torch.bfloat16)}
    rows = []
    for messages, reply in zip(CHATS_WITH_FACTS, replies):
        prompt = list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)["input_ids"])
        fp32, fp32_logits = hf_reference(references[torch.float32], tokenizer, prompt)
        bf16, _ = hf_reference(references[torch.bfloat16], tokenizer, prompt)
        texts = {"fp32": tokenizer.decode(fp32), "bf16": tokenizer.decode(bf16)}
        row = {"user": messages[-1]["content"], "reply": reply, "hf_fp32": texts["fp32"], "hf_bf16": texts["bf16"],
               "equals_fp32": reply == texts["fp32"], "equals_bf16": reply == texts["bf16"]}
        if not (row["equals_fp32"] or row["equals_bf16"]):
            ours = tokenizer.encode(reply, add_special_tokens=False)
            pos = next((i for i, (a, b) in enumerate(zip(ours, fp32)) if a != b), min(len(ours), len(fp32)))
            row["first_divergent_token"] = pos
            if pos < len(fp32_logits):
                top2 = torch.topk(fp32_logits[pos], 2).values
                row["fp32_top2_margin"] = float(top2[0] - top2[1])
        rows.append(row)
    identical = sum(r["equals_fp32"] or r["equals_bf16"] for r in rows)
    dtype = args.up_arg[args.up_arg.index("--dtype") + 1] if "--dtype" in args.up_arg else "bfloat16"
    system = "vLLM-CPU bf16" if args.vllm_python else f"`tokenfleet up` {dtype}"
    result = {"started": time.strftime("%Y-%m-%d %H:%M:%S"), "system": system, "machine": machine_line(),
              "commit": git_head(), "rows": rows, "identical": identical,
              "total": len(rows),
              "pass": identical >= len(rows) - 1}
    write_report(args.out, result, markdown(result))


def markdown(result: dict) -> str:
    lines = [f"# Greedy chat parity, {result['system']} vs HF transformers ({result['started']})", "",
             f"{MAX_TOKENS} tokens, temperature 0, served. Identical to one reference: "
             f"**{result['identical']} of {result['total']}** (bar: all but one: {'pass' if result['pass'] else 'FAIL'}).",
             "", f"Machine: {result['machine']}; commit {result['commit']}.", "",
             "| user | = HF fp32 | = HF bf16 | first divergent token (fp32 top-2 margin) | served reply |",
             "|---|---|---|---|---|"]
    for r in result["rows"]:
        div = "-" if "first_divergent_token" not in r else (
            f"{r['first_divergent_token']} ({r.get('fp32_top2_margin', float('nan')):.3f})")
        reply = r["reply"].replace("\n", " ").replace("|", "/")
        lines.append(f"| {r['user'][:40]} | {'yes' if r['equals_fp32'] else 'no'} | {'yes' if r['equals_bf16'] else 'no'} "
                     f"| {div} | {reply} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
