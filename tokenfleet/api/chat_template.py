"""Render a model's Jinja chat template (the HF convention) in a sandbox."""

from __future__ import annotations

from functools import lru_cache
from typing import Any

from jinja2.exceptions import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from tokenfleet.models.tokenizer import Tokenizer

# Used only when a model ships no template: ChatML, which many instruct models were tuned on.
FALLBACK_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


@lru_cache(maxsize=16)
def _compile(source: str):
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = _raise
    return env.from_string(source)


def _raise(message: str) -> None:
    raise TemplateError(message)


def render_chat(tokenizer: Tokenizer, messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> str:
    """The prompt text for ``messages``; ValueError for malformed messages or template errors."""
    if not messages:
        raise ValueError("messages must not be empty")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise ValueError(f"messages[{i}] must be an object with a string 'role'")
        if not isinstance(m.get("content", ""), str):
            raise ValueError(f"messages[{i}].content must be a string")
    template = _compile(tokenizer.chat_template or FALLBACK_TEMPLATE)
    try:
        return template.render(
            messages=messages, add_generation_prompt=add_generation_prompt, **tokenizer.special_tokens
        )
    except TemplateError as e:
        raise ValueError(f"chat template rejected the messages: {e}") from e
