"""StopStringMatcher on streamed text, IncrementalDetokenizer with the real default tokenizer."""

from __future__ import annotations

from pathlib import Path

import pytest

from tokenfleet.api.chat_template import render_chat
from tokenfleet.engine.detokenizer import IncrementalDetokenizer, StopStringMatcher
from tokenfleet.engine.output import OutputState
from tokenfleet.engine.request import FinishReason, Request
from tokenfleet.engine.sampling_params import SamplingParams
from tokenfleet.models.tokenizer import Tokenizer

# ---------------------------------------------------------------- StopStringMatcher


def feed_all(matcher: StopStringMatcher, pieces: list[str]) -> list[str]:
    return [matcher.feed(p) for p in pieces]


def assert_no_partial_stop_leaks(chunks: list[str], stops: list[str], full_text: str) -> None:
    """No emitted prefix of the output may end inside an occurrence of a stop string that the
    rest of the text could still complete, and no emitted text may contain a whole stop."""
    emitted = ""
    for chunk in chunks:
        emitted += chunk
        assert full_text.startswith(emitted)
        for stop in stops:
            assert stop not in emitted
            for n in range(1, len(stop)):
                if emitted.endswith(stop[:n]):
                    # emitting a stop's prefix is only allowed once it can no longer become the stop
                    assert not full_text[len(emitted) - n :].startswith(stop), (emitted, stop)


def test_stop_split_across_several_feeds_is_caught():
    m = StopStringMatcher(["<END>"])
    pieces = ["Hello wor", "ld <", "E", "N", "D", "> trailing"]
    chunks = feed_all(m, pieces)
    assert "".join(chunks) == "Hello world "
    assert m.matched == "<END>"
    assert chunks[0] == "Hello wor"
    assert chunks[1] == "ld "  # "<" is held back
    assert chunks[2:] == ["", "", "", ""]
    assert_no_partial_stop_leaks(chunks, ["<END>"], "".join(pieces))


def test_stop_fed_one_character_at_a_time_never_leaks_a_prefix():
    stops = ["STOP"]
    text = "a ST STO STOOP SSTOP tail"
    m = StopStringMatcher(stops)
    chunks = feed_all(m, list(text))
    assert "".join(chunks) == "a ST STO STOOP S"
    assert m.matched == "STOP"
    assert_no_partial_stop_leaks(chunks, stops, text)
    # every intermediate chunk: nothing that is still a possible stop prefix at the end
    emitted = ""
    for i, chunk in enumerate(chunks):
        emitted += chunk
        seen = text[: i + 1]
        if "STOP" not in seen:
            held = seen[len(emitted) :]
            assert held == "" or "STOP".startswith(held), (seen, emitted)


def test_held_back_text_released_when_not_a_stop():
    m = StopStringMatcher(["</s>"])
    assert m.feed("x </") == "x "
    assert m.feed("p") == "</p"
    assert m.feed("> ok") == "> ok"
    assert m.matched is None


def test_held_back_text_partly_released_when_a_shorter_prefix_remains():
    m = StopStringMatcher(["abab"])
    assert m.feed("aba") == ""
    # "abaa": no "aba" tail any more, but "a" could still start "abab"
    assert m.feed("a") == "aba"
    assert m.feed("bab") == ""
    assert m.matched == "abab"


def test_flush_releases_held_text():
    m = StopStringMatcher(["###"])
    assert m.feed("result ##") == "result "
    assert m.flush() == "##"
    assert m.matched is None
    assert m.flush() == ""


def test_flush_after_a_match_returns_nothing_and_feed_is_ignored():
    m = StopStringMatcher(["x"])
    assert m.feed("abxcd") == "ab"
    assert m.matched == "x"
    assert m.feed("more") == ""
    assert m.flush() == ""


def test_include_stop_keeps_the_stop_string():
    m = StopStringMatcher(["<END>"], include_stop=True)
    chunks = feed_all(m, ["Hello <E", "ND", "> rest"])
    assert "".join(chunks) == "Hello <END>"
    assert chunks[0] == "Hello "
    assert m.matched == "<END>"


def test_multiple_stops_earliest_wins():
    m = StopStringMatcher(["world", "lo"])
    assert "".join(feed_all(m, ["hel", "lo world"])) == "hel"
    assert m.matched == "lo"

    m = StopStringMatcher(["bbb", "cd"])
    assert "".join(feed_all(m, ["a", "cd bbb"])) == "a"
    assert m.matched == "cd"


def test_multiple_stops_in_one_feed_earliest_wins_regardless_of_order():
    for stops in (["END", "STOP"], ["STOP", "END"]):
        m = StopStringMatcher(stops)
        assert m.feed("one STOP two END") == "one "
        assert m.matched == "STOP"
        m = StopStringMatcher(stops, include_stop=True)
        assert m.feed("one END two STOP") == "one END"
        assert m.matched == "END"


def test_multiple_stops_no_prefix_of_any_is_emitted():
    stops = ["<|end|>", "\n\nUser:"]
    text = "Answer: 42\n\nUs<|en and more\n\nUser: hi"
    m = StopStringMatcher(stops)
    chunks = feed_all(m, [text[i : i + 3] for i in range(0, len(text), 3)])
    assert "".join(chunks) == "Answer: 42\n\nUs<|en and more"
    assert m.matched == "\n\nUser:"
    assert_no_partial_stop_leaks(chunks, stops, text)


def test_stop_at_the_very_start():
    m = StopStringMatcher(["stop"])
    assert feed_all(m, ["st", "op now"]) == ["", ""]
    assert m.matched == "stop"


def test_no_stops_passes_text_through():
    m = StopStringMatcher([])
    assert feed_all(m, ["a", "bc", ""]) == ["a", "bc", ""]
    assert m.flush() == ""
    assert m.matched is None


# ---------------------------------------------------------------- IncrementalDetokenizer


@pytest.fixture(scope="module")
def model_dir() -> Path:
    from tokenfleet.models.gguf_import import ensure_default_model

    return ensure_default_model()


@pytest.fixture(scope="module")
def tokenizer(model_dir: Path) -> Tokenizer:
    return Tokenizer(model_dir)


TEXTS = [
    "🚀🎉",
    "日本語",
    "café",
    "🚀 日本語 café 🎉 naïve",
    "Résumé: 東京タワー 🗼 über straße 😀👍🏽",
    " The quick brown fox jumps over the lazy dog.",
    "  two leading spaces and   gaps\nnew line\tand tab",
]


def stream(tokenizer: Tokenizer, prompt_ids: list[int], ids: list[int]) -> list[str]:
    detok = IncrementalDetokenizer(tokenizer, prompt_ids)
    deltas = [detok.push(t) for t in ids]
    deltas.append(detok.flush())
    return deltas


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("prompt", ["", "chat"])
def test_streamed_deltas_equal_full_decode(tokenizer, text, prompt):
    prompt_ids = (
        tokenizer.encode(render_chat(tokenizer, [{"role": "user", "content": "Say something."}])) if prompt else []
    )
    ids = tokenizer.encode(text)
    deltas = stream(tokenizer, prompt_ids, ids)
    assert "".join(deltas) == tokenizer.decode(ids)
    assert "".join(deltas) == text
    for d in deltas:
        assert "\ufffd" not in d


def test_multibyte_emoji_is_held_until_complete(tokenizer):
    ids = tokenizer.encode("🚀🎉")
    assert len(ids) > 2  # byte-level BPE splits each emoji over several tokens
    detok = IncrementalDetokenizer(tokenizer, [])
    deltas = [detok.push(t) for t in ids]
    non_empty = [d for d in deltas if d]
    assert non_empty == ["🚀", "🎉"]
    assert deltas[0] == ""  # the first byte alone is never emitted
    assert detok.flush() == ""


def test_leading_space_after_prompt_is_kept(tokenizer):
    prompt_ids = tokenizer.encode("Question: what is it?\nAnswer:")
    ids = tokenizer.encode(" It is a test.")
    deltas = stream(tokenizer, prompt_ids, ids)
    assert deltas[0].startswith(" ")
    assert "".join(deltas) == " It is a test."


def test_every_prefix_of_the_stream_is_a_prefix_of_the_full_text(tokenizer):
    text = "Mixed: αβγ 日本語 🚀 done"
    ids = tokenizer.encode(text)
    detok = IncrementalDetokenizer(tokenizer, tokenizer.encode("prompt"))
    emitted = ""
    for i, t in enumerate(ids):
        emitted += detok.push(t)
        assert text.startswith(emitted)
        so_far = tokenizer.decode(ids[: i + 1])
        if so_far.endswith("\ufffd"):
            # an incomplete character is held back (with the rest of the token's text)
            assert so_far.rstrip("\ufffd").startswith(emitted)
        else:
            # everything complete so far has been emitted
            assert emitted == so_far
    assert emitted + detok.flush() == text


def test_special_tokens_skipped_or_kept(tokenizer):
    eos = tokenizer.token_to_id("<|im_end|>")
    assert eos is not None
    ids = tokenizer.encode("Hi there") + [eos]
    assert "".join(stream(tokenizer, [], ids)) == "Hi there"
    detok = IncrementalDetokenizer(tokenizer, [], skip_special_tokens=False)
    text = "".join(detok.push(t) for t in ids) + detok.flush()
    assert text == "Hi there<|im_end|>"


def test_flush_emits_an_incomplete_character_as_is(tokenizer):
    ids = tokenizer.encode("ok 🚀")
    detok = IncrementalDetokenizer(tokenizer, [])
    emitted = "".join(detok.push(t) for t in ids[:-1])  # drop the emoji's last byte
    assert "\ufffd" not in emitted
    tail = detok.flush()
    assert emitted + tail == tokenizer.decode(ids[:-1])
    assert tail.endswith("\ufffd")


# ---------------------------------------------------------------- OutputState (detokenizer + stop strings)


def run_output_state(tokenizer: Tokenizer, text: str, **params: object) -> tuple[str, OutputState]:
    ids = tokenizer.encode(text)
    request = Request("o", tokenizer.encode("Hello"), SamplingParams(max_tokens=len(ids), **params))  # type: ignore[arg-type]
    state = OutputState(request, tokenizer)
    out_text = ""
    last = None
    for t in ids:
        request.output_token_ids.append(t)
        last = state.on_token(t, None, finished_by_token=False)
        out_text += last.text
        if state.matcher.matched is not None:
            break
    assert last is not None
    already = last.text
    reason = FinishReason.STOP if state.matcher.matched is not None else FinishReason.LENGTH
    final = state.finish(last, reason)  # may append held-back text to the last delta
    assert final.finished and final.finish_reason is reason
    assert final.text.startswith(already)
    return out_text + final.text[len(already) :], state


def test_output_state_stops_on_a_multi_token_stop_string(tokenizer):
    text, state = run_output_state(tokenizer, "The answer is 日本語 END of story", stop=["END"])
    assert text == "The answer is 日本語 "
    assert state.matcher.matched == "END"


def test_output_state_releases_everything_without_a_stop(tokenizer):
    source = "café 🚀 ends with a partial E"
    text, state = run_output_state(tokenizer, source, stop=["ENDING"])
    assert text == source
    assert state.matcher.matched is None
