"""Gemma 3's turn format, written in the project (its GGUF carries no chat template)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from tokenfleet.api.chat_template import render_chat
from tokenfleet.models.gguf_import import GEMMA3_CHAT_TEMPLATE, SOURCES, source


def _render(messages, add_generation_prompt=True) -> str:  # type: ignore[no-untyped-def]
    tokenizer = SimpleNamespace(chat_template=GEMMA3_CHAT_TEMPLATE,
                                special_tokens={"bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>"})
    return render_chat(tokenizer, messages, add_generation_prompt)  # type: ignore[arg-type]


def test_turns_roles_system_text_and_the_generation_prompt():
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi "},
                {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Capital of France?"}]
    assert _render(messages) == (
        "<bos><start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n"
        "<start_of_turn>model\nHello!<end_of_turn>\n"
        "<start_of_turn>user\nCapital of France?<end_of_turn>\n"
        "<start_of_turn>model\n")
    assert _render([{"role": "user", "content": "Hi"}], add_generation_prompt=False) == \
        "<bos><start_of_turn>user\nHi<end_of_turn>\n"


def test_both_shipped_models_are_importable_by_name():
    assert set(SOURCES) == {"smollm2-135m-instruct", "gemma3-270m"}
    with pytest.raises(LookupError, match="gemma3-270m"):
        source("llama-70b")
