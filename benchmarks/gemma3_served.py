"""Two models behind one `tokenfleet up` (bf16 defaults), and Gemma 3's served greedy chat vs HF fp32.

1. `tokenfleet up --model smollm2-135m-instruct --model gemma3-270m`; the official `openai` client asks
   each model one chat, non-streaming and streaming, and the replies are recorded.
2. Gemma 3 270M greedy chat through the gateway (bf16, temperature 0, 32 tokens; prompts rendered
   with the project's Gemma 3 turn format, one of them longer than the 512-token sliding window)
   against HF transformers' fp32 greedy tokens on the same prompt ids. A reply is identical when its
   text equals the reference's decoded tokens (up to the end of turn). For one that is not: the first
   token where it leaves the fp32 path and the fp32 top-2 logit margin there. The bar: all but one
   identical.

    .venv/bin/python benchmarks/gemma3_served.py [--out benchmarks/reports/gemma3-served.json]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
from serve_peer import start_tokenfleet
from serving.procs import Children, wait_completion
from serving.report import write_report

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
MAX_TOKENS = 32


def both_models(url: str, names: list[str]) -> list[dict]:
    from openai import OpenAI

    client = OpenAI(base_url=f"{url}/v1", api_key="unused", timeout=300)
    listed = sorted(m.id for m in client.models.list().data)
    rows = []
    for name in names:
        messages = [{"role": "user", "content": "Name three colours of the rainbow."}]
        reply = client.chat.completions.create(model=name, messages=messages, max_tokens=24, temperature=0)
        stream = client.chat.completions.create(model=name, messages=messages, max_tokens=24, temperature=0, stream=True)
        streamed = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
        rows.append({"model": name, "listed": name in listed, "reply": reply.choices[0].message.content,
                     "finish_reason": reply.choices[0].finish_reason, "streamed": streamed,
                     "stream_equals_reply": streamed == reply.choices[0].message.content,
                     "usage": reply.usage.model_dump() if reply.usage else None})
    return rows


def chats() -> list[list[dict]]:
    from tests.model.test_bf16_numerics import CHATS_WITH_FACTS
    from tests.model.test_gemma3_parity import CHATS

    return [*CHATS, *CHATS_WITH_FACTS[:4], CHATS_WITH_FACTS[-1]]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "reports" / "gemma3-served.json"))
    args = parser.parse_args()
    from openai import OpenAI
    from transformers import AutoModelForCausalLM

    from tests.model.helpers import hf_greedy
    from tokenfleet.api.chat_template import render_chat
    from tokenfleet.models.gguf_import import DEFAULT_MODEL_NAME, GEMMA3_MODEL_NAME, ensure_model
    from tokenfleet.models.tokenizer import Tokenizer

    gemma_dir = str(Path(ensure_model(GEMMA3_MODEL_NAME)).resolve())
    tokenizer = Tokenizer(gemma_dir)
    conversations = chats()
    children = Children()
    try:
        child, url = start_tokenfleet(children, DEFAULT_MODEL_NAME, ["--model", DEFAULT_MODEL_NAME,
                                                                      "--model", GEMMA3_MODEL_NAME])
        wait_completion(url, GEMMA3_MODEL_NAME, 600, lambda: child.proc.poll() is None)
        served_both = both_models(url, [DEFAULT_MODEL_NAME, GEMMA3_MODEL_NAME])
        client = OpenAI(base_url=f"{url}/v1", api_key="unused", timeout=300)
        replies = [client.chat.completions.create(model=GEMMA3_MODEL_NAME, messages=m, max_tokens=MAX_TOKENS,
                                                  temperature=0).choices[0].message.content for m in conversations]
    finally:
        children.stop_all()
    hf = AutoModelForCausalLM.from_pretrained(gemma_dir, dtype=torch.float32).eval()
    eos = set(hf.generation_config.eos_token_id if isinstance(hf.generation_config.eos_token_id, list)
              else [hf.generation_config.eos_token_id]) | {1, 106}
    rows = []
    for messages, reply in zip(conversations, replies):
        prompt = tokenizer.encode(render_chat(tokenizer, messages))
        tokens, logits = hf_greedy(hf, prompt, MAX_TOKENS)
        cut = next((i for i, t in enumerate(tokens) if t in eos), len(tokens))
        tokens, logits = tokens[:cut], logits[: cut + 1]
        reference = tokenizer.decode(tokens)
        row = {"user": messages[-1]["content"][:80], "prompt_tokens": len(prompt), "reply": reply,
               "hf_fp32": reference, "identical": reply == reference}
        if not row["identical"]:
            ours = tokenizer.encode(reply)
            pos = next((i for i, (a, b) in enumerate(zip(ours, tokens)) if a != b), min(len(ours), len(tokens)))
            row["first_divergent_token"] = pos
            if pos < len(logits):
                top2 = torch.topk(logits[pos], 2).values
                row["fp32_top2_margin"] = float(top2[0] - top2[1])
        rows.append(row)
    identical = sum(r["identical"] for r in rows)
    result = {"started": time.strftime("%Y-%m-%d %H:%M:%S"), "command": "benchmarks/gemma3_served.py",
              "both_models": served_both, "rows": rows, "identical": identical, "total": len(rows),
              "longest_prompt_tokens": max(r["prompt_tokens"] for r in rows),
              "pass": identical >= len(rows) - 1 and all(r["listed"] and r["reply"] and r["streamed"] for r in served_both)}
    write_report(args.out, result, markdown(result))


def markdown(result: dict) -> str:
    lines = [f"# Two models behind one `tokenfleet up`; Gemma 3 270M served bf16 vs HF fp32 ({result['started']})", "",
             "## Both models through the official `openai` client", "",
             "| model | in /v1/models | reply | streamed (same text?) |", "|---|---|---|---|"]
    for r in result["both_models"]:
        lines.append(f"| {r['model']} | {'yes' if r['listed'] else 'no'} | {_cell(r['reply'])} | "
                     f"{'yes' if r['stream_equals_reply'] else 'no'}: {_cell(r['streamed'])} |")
    lines += ["", "## Gemma 3 greedy chat, served bf16 vs HF transformers fp32", "",
              f"{MAX_TOKENS} tokens, temperature 0; longest prompt {result['longest_prompt_tokens']} tokens (window 512). "
              f"Identical: **{result['identical']} of {result['total']}** (bar: all but one: "
              f"{'pass' if result['pass'] else 'FAIL'}).", "",
              "| user | prompt tokens | identical | first divergent token (fp32 top-2 margin) | served reply |",
              "|---|---|---|---|---|"]
    for r in result["rows"]:
        div = "-" if "first_divergent_token" not in r else (
            f"{r['first_divergent_token']} ({r.get('fp32_top2_margin', float('nan')):.3f})")
        lines.append(f"| {_cell(r['user'][:40])} | {r['prompt_tokens']} | {'yes' if r['identical'] else 'no'} | {div} "
                     f"| {_cell(r['reply'])} |")
    return "\n".join(lines) + "\n"


def _cell(text: str | None) -> str:
    return (text or "").replace("\n", " ").replace("|", "/")


if __name__ == "__main__":
    main()
