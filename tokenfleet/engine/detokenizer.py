"""Incremental detokenization and stop-string matching.

Detokenizing token by token is wrong for byte-level BPE: one character can span several
tokens (multi-byte UTF-8), and a token's text can depend on its neighbours. We decode a
short window twice, ``tokens[prefix:read]`` and ``tokens[prefix:]``, and emit the
difference only when it does not end in an incomplete character (U+FFFD).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

_REPLACEMENT = "\ufffd"
_PROMPT_CONTEXT = 6  # prompt tokens kept as left context (leading-space handling)


class Decoder(Protocol):
    """The model's tokenizer, as the engine uses it."""

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str: ...

    def to_json(self) -> str:
        """Its tokenizer.json (guided decoding compiles grammars over the vocabulary)."""
        ...


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Decoder, prompt_token_ids: Sequence[int], skip_special_tokens: bool = True):
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self._tokens = list(prompt_token_ids[-_PROMPT_CONTEXT:])
        self._prefix = 0
        self._read = len(self._tokens)

    @staticmethod
    def text_of(tokenizer: Decoder, prompt_token_ids: Sequence[int], output_token_ids: Sequence[int],
                skip_special_tokens: bool = True) -> str:
        """All the text streaming ``output_token_ids`` after this prompt yields (no incomplete tail)."""
        context = list(prompt_token_ids[-_PROMPT_CONTEXT:])
        before = tokenizer.decode(context, skip_special_tokens=skip_special_tokens)
        after = tokenizer.decode(context + list(output_token_ids), skip_special_tokens=skip_special_tokens)
        return after[len(before) :].rstrip(_REPLACEMENT)

    def push(self, token_id: int) -> str:
        """Append one token; return the text that became final (maybe empty)."""
        self._tokens.append(token_id)
        return self._advance(final=False)

    def flush(self) -> str:
        """Text still held back (an incomplete character at the end), emitted as is."""
        return self._advance(final=True)

    def _advance(self, final: bool) -> str:
        decode = self._tokenizer.decode
        before = decode(self._tokens[self._prefix : self._read], skip_special_tokens=self._skip)
        after = decode(self._tokens[self._prefix :], skip_special_tokens=self._skip)
        if len(after) <= len(before) or (after.endswith(_REPLACEMENT) and not final):
            return ""
        self._prefix, self._read = self._read, len(self._tokens)
        return after[len(before) :]


class StopStringMatcher:
    """Finds stop strings in streamed text and holds back any tail that might start one."""

    def __init__(self, stops: Sequence[str], include_stop: bool = False):
        self._stops = tuple(stops)
        self._include = include_stop
        self._max_len = max((len(s) for s in self._stops), default=0)
        self._text = ""
        self._emitted = 0
        self.matched: str | None = None

    def prime(self, emitted: str) -> None:
        """Text already emitted elsewhere (a resumed request): stop strings may span it."""
        self._text, self._emitted = emitted, len(emitted)

    def feed(self, delta: str) -> str:
        """Add text; return what may be emitted now. After a match, ``matched`` is set."""
        if self.matched is not None:
            return ""
        search_from = max(0, len(self._text) - self._max_len + 1)
        self._text += delta
        if not self._stops:
            return self._take(len(self._text))
        hit = self._find(search_from)
        if hit is not None:
            index, stop = hit
            self.matched = stop
            return self._take(index + (len(stop) if self._include else 0))
        return self._take(len(self._text) - self._held_back())

    def flush(self) -> str:
        """Everything not yet emitted (the request ended for another reason)."""
        return "" if self.matched is not None else self._take(len(self._text))

    def _find(self, start: int) -> tuple[int, str] | None:
        best = None
        for stop in self._stops:
            index = self._text.find(stop, start)
            if index != -1 and (best is None or index < best[0]):
                best = (index, stop)
        return best

    def _held_back(self) -> int:
        """Length of the longest text suffix that is a proper prefix of some stop string."""
        for n in range(min(self._max_len - 1, len(self._text)), 0, -1):
            tail = self._text[-n:]
            if any(stop.startswith(tail) for stop in self._stops):
                return n
        return 0

    def _take(self, end: int) -> str:
        end = max(end, self._emitted)
        out = self._text[self._emitted : end]
        self._emitted = end
        return out
