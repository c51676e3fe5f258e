"""Engine stream -> OpenAI JSON bodies (chat.completion, text_completion, their chunks, usage, logprobs)."""

from __future__ import annotations

import time
from typing import Any

from tokenfleet.models.tokenizer import Tokenizer
from tokenfleet.v1 import common_pb2

FINISH = {
    common_pb2.FINISH_REASON_STOP: "stop",
    common_pb2.FINISH_REASON_LENGTH: "length",
    common_pb2.FINISH_REASON_ABORT: "abort",
}


def usage(u: common_pb2.Usage) -> dict[str, Any]:
    return {
        "prompt_tokens": u.prompt_tokens,
        "completion_tokens": u.completion_tokens,
        "total_tokens": u.prompt_tokens + u.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": u.cached_prompt_tokens},
    }


def _token_text(tokenizer: Tokenizer, token_id: int) -> str:
    return tokenizer.decode([token_id], skip_special_tokens=False)


def chat_logprobs(tokenizer: Tokenizer, logprobs: list[common_pb2.TokenLogprob]) -> dict[str, Any]:
    def entry(token_id: int, logprob: float) -> dict[str, Any]:
        text = _token_text(tokenizer, token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    return {"content": [
        {**entry(lp.token_id, lp.logprob), "top_logprobs": [entry(t.token_id, t.logprob) for t in lp.top]}
        for lp in logprobs
    ]}


def completion_logprobs(tokenizer: Tokenizer, logprobs: list[common_pb2.TokenLogprob], offset: int) -> dict[str, Any]:
    tokens, offsets = [], []
    for lp in logprobs:
        offsets.append(offset)
        text = _token_text(tokenizer, lp.token_id)
        tokens.append(text)
        offset += len(text)
    return {
        "tokens": tokens,
        "token_logprobs": [lp.logprob for lp in logprobs],
        "top_logprobs": [{_token_text(tokenizer, t.token_id): t.logprob for t in lp.top} for lp in logprobs],
        "text_offset": offsets,
    }


def echo_logprobs(tokenizer: Tokenizer, prompt: list[int], logprobs: list[common_pb2.TokenLogprob]
                  ) -> dict[str, Any]:
    """Completion logprobs of an echoed prompt: its first token has none (null), as OpenAI's."""
    tokens = [_token_text(tokenizer, t) for t in prompt]
    offsets, offset = [], 0
    for text in tokens:
        offsets.append(offset)
        offset += len(text)
    return {
        "tokens": tokens,
        "token_logprobs": [None] + [lp.logprob for lp in logprobs],
        "top_logprobs": [None] + [{_token_text(tokenizer, t.token_id): t.logprob for t in lp.top} for lp in logprobs],
        "text_offset": offsets,
    }


def join_logprobs(first: dict[str, Any], second: dict[str, Any]) -> dict[str, Any]:
    return {key: first[key] + second[key] for key in first}


def envelope(kind: str, request_id: str, model: str, choices: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
    return {"id": request_id, "object": kind, "created": int(time.time()), "model": model, "choices": choices, **extra}
