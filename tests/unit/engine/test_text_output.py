"""Incremental detokenization (multi-byte UTF-8, BPE) and stop strings that never leak."""

from __future__ import annotations

import pytest

from tokenfleet.engine.detokenizer import IncrementalDetokenizer, StopStringMatcher
from tokenfleet.models.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def tokenizer(default_model_dir) -> Tokenizer:
    return Tokenizer(default_model_dir)


@pytest.mark.parametrize(
    "text",
    [
        "Hello there, how are you?", "  leading spaces and   gaps", "🚀🎉 launch!",
        "日本語のテキスト", "café naïve façade", "a\nb\tc",
    ],
)
def test_streamed_text_equals_full_decode_and_never_has_replacement_chars(tokenizer, text):
    prompt = tokenizer.encode("<|im_start|>user\nhi<|im_end|>\n")
    ids = tokenizer.encode(text)
    detok = IncrementalDetokenizer(tokenizer, prompt)
    deltas = [detok.push(t) for t in ids]
    deltas.append(detok.flush())
    assert "".join(deltas) == tokenizer.decode(ids)
    assert all("\ufffd" not in d for d in deltas)


def test_multibyte_character_split_over_tokens_is_held_until_complete(tokenizer):
    ids = tokenizer.encode("🚀")
    assert len(ids) > 1  # byte-level BPE splits this emoji: the test is meaningful
    detok = IncrementalDetokenizer(tokenizer, [])
    deltas = [detok.push(t) for t in ids]
    assert deltas[:-1] == [""] * (len(ids) - 1) and deltas[-1] == "🚀"


def test_special_tokens_skipped(tokenizer):
    eos = tokenizer.token_to_id("<|im_end|>")
    detok = IncrementalDetokenizer(tokenizer, [], skip_special_tokens=True)
    assert "".join(detok.push(t) for t in tokenizer.encode("Hi") + [eos]) == "Hi"


def feed_all(matcher: StopStringMatcher, pieces: list[str]) -> list[str]:
    return [matcher.feed(p) for p in pieces]


def test_stop_string_split_across_feeds_is_caught_and_never_leaks():
    m = StopStringMatcher(["STOP"])
    emitted = feed_all(m, ["Hello S", "T", "O", "P and more"])
    assert "".join(emitted) == "Hello "
    assert m.matched == "STOP"
    for i in range(1, len(emitted) + 1):
        assert "S" not in "".join(emitted[:i])


def test_held_back_prefix_is_released_when_it_is_not_a_stop():
    m = StopStringMatcher(["STOP"])
    assert m.feed("go ST") == "go "
    assert m.feed("ART") == "START"
    assert m.matched is None


def test_flush_releases_held_text():
    m = StopStringMatcher(["</end>"])
    assert m.feed("value </e") == "value "
    assert m.flush() == "</e"


def test_include_stop_and_earliest_stop_wins():
    m = StopStringMatcher(["world", "lo w"], include_stop=True)
    assert "".join(feed_all(m, ["hel", "lo world"])) == "hello w"
    assert m.matched == "lo w"


def test_no_stops_passes_text_through():
    m = StopStringMatcher([])
    assert feed_all(m, ["a", "b"]) == ["a", "b"]


def test_nothing_after_a_match():
    m = StopStringMatcher(["x"])
    assert m.feed("abxcd") == "ab"
    assert m.feed("more") == "" and m.flush() == ""
