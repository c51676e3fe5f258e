"""Tokenizer of an HF model folder (tokenizer.json via the `tokenizers` library) plus its chat template."""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer as HFTokenizer


class Tokenizer:
    def __init__(self, model_dir: str | Path):
        folder = Path(model_dir)
        path = folder / "tokenizer.json"
        if not path.exists():
            raise FileNotFoundError(f"{model_dir} has no tokenizer.json")
        self._tok = HFTokenizer.from_file(str(path))
        config_path = folder / "tokenizer_config.json"
        config = json.loads(config_path.read_text()) if config_path.exists() else {}
        template_path = folder / "chat_template.jinja"
        self.chat_template: str | None = config.get("chat_template") or (
            template_path.read_text() if template_path.exists() else None
        )
        self.special_tokens = {k: _token_text(config.get(k)) for k in ("bos_token", "eos_token", "pad_token")}
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_prompt(self, text: str) -> list[int]:
        """A raw-text prompt (completions) as the model's tokenizer encodes it by default: with the special tokens
        its post-processor adds (Gemma's ``<bos>``; none for SmolLM2), as transformers and vLLM's completions do,
        except that a text which already starts with them (a prompt rendered by a chat template) does not get them
        twice. Chat prompts are rendered by our template, which writes them itself: they use ``encode``."""
        return self._prompt_ids(text)[1]

    def added_prefix(self, text: str) -> int:
        """How many special tokens ``encode_prompt`` puts before ``text``'s own tokens (0, or Gemma's one ``<bos>``)."""
        return self._prompt_ids(text)[0]

    def _prompt_ids(self, text: str) -> tuple[int, list[int]]:
        plain = self.encode(text)
        ids = self.encode(text, add_special_tokens=True)
        added = len(ids) - len(plain)
        if added > 0 and ids[added:] == plain:  # the post-processor put tokens before the text's own
            return (0, plain) if plain[:added] == ids[:added] else (added, ids)  # unless the text starts with them
        return 0, ids  # nothing added, or tokens after the text too: as the tokenizer has it

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def to_json(self) -> str:
        """The tokenizer's tokenizer.json text (grammar engines build their token tables from it)."""
        return self._tok.to_str()

    def id_to_token(self, token_id: int) -> str | None:
        return self._tok.id_to_token(token_id)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)


def _token_text(value: object) -> str | None:
    if isinstance(value, dict):  # {"content": "<s>", ...} in older configs
        return value.get("content")
    return value if isinstance(value, str) else None
