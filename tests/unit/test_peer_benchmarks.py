"""The llama.cpp comparisons' own logic: llama-perplexity's scoring protocol, reproduced for our side, and the
llama-server configuration specs of its sweep."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import gguf_perplexity  # noqa: E402
import llama_server_peer  # noqa: E402


def test_chunks_are_whole_ctx_slices_with_bos_in_front_and_the_tail_dropped():
    tokens = list(range(100, 111))  # 11 ids: two chunks of 4, 3 left over
    assert gguf_perplexity.chunks_of(tokens, 4, bos=2) == [[2, 101, 102, 103], [2, 105, 106, 107]]
    assert gguf_perplexity.chunks_of(tokens, 4, bos=None) == [[100, 101, 102, 103], [104, 105, 106, 107]]


def test_the_second_half_of_a_chunk_is_scored_as_llama_perplexity_scores_it():
    # prompt_logprobs[i] is token i+1's; llama-perplexity scores tokens ctx/2+1 .. ctx-1: ctx - ctx/2 - 1 of them
    ctx = 8
    logprobs = [-float(i + 1) for i in range(ctx - 1)]  # tokens 1..7
    scored = gguf_perplexity.scored_logprobs(logprobs, ctx)
    assert scored == [-5.0, -6.0, -7.0]  # tokens 5, 6, 7
    assert len(gguf_perplexity.scored_logprobs([0.0] * 511, 512)) == 255


def test_llama_server_specs_name_every_knob_and_reject_the_rest():
    assert llama_server_peer.parse_spec("t=1,np=32,b=512") == {"t": 1, "np": 32, "b": 512}
    assert llama_server_peer.with_setting("t=2,np=4,b=2048", "np", 16) == "t=2,np=16,b=2048"
    for bad in ("t=1,np=4", "t=0,np=4,b=2048", "t=1,np=4,b=2048,x=1", "t=one,np=4,b=2048"):
        with pytest.raises(ValueError):
            llama_server_peer.parse_spec(bad)
