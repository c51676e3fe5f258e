"""Answers before speed: greedy answers of a server under test to a few committed correctness prompts."""

from __future__ import annotations

import json
from pathlib import Path

from serving.load import httpx

REPO = Path(__file__).resolve().parents[2]
CHECK_IDS = ("japan", "france", "colors", "water", "town")  # tests/data/correctness_prompts.json
CHECK_TOKENS = 16


def check_answers(url: str, model: str) -> dict[str, str]:
    """Greedy answers (16 tokens) to a few correctness prompts (the report flags a Japan answer without Tokyo: its
    answer is no near-tie in fp32 or bf16, where France's first token is)."""
    prompts = {p["id"]: p for p in json.loads((REPO / "tests" / "data" / "correctness_prompts.json").read_text())["prompts"]}
    answers = {}
    with httpx.Client(base_url=url, timeout=300) as client:
        for pid in CHECK_IDS:
            p = prompts[pid]
            body = {"model": model, "max_tokens": CHECK_TOKENS, "temperature": 0.0}
            if "chat" in p:
                messages = [{"role": "user", "content": p["chat"]}]
                response = client.post("/v1/chat/completions", json={**body, "messages": messages})
                response.raise_for_status()
                answers[pid] = response.json()["choices"][0]["message"]["content"] or ""
            else:
                response = client.post("/v1/completions", json={**body, "prompt": p["completion"]})
                response.raise_for_status()
                answers[pid] = response.json()["choices"][0]["text"] or ""
    return answers


def match_line(ours: dict[str, str], theirs: dict[str, str]) -> str:
    """"k/n" greedy answers equal between two servers, and whether each Japan answer says Tokyo."""
    same = sum(ours[k] == theirs.get(k) for k in ours)
    return (f"{same}/{len(ours)} answers equal; Japan: {'Tokyo' in ours.get('japan', '')} / "
            f"{'Tokyo' in theirs.get('japan', '')}")
