from __future__ import annotations

import pytest

from tokenfleet.engine.sampling_params import SamplingParams


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": -3}, "max_tokens"),
        ({"temperature": -0.1}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"min_p": 1.5}, "min_p"),
        ({"stop": 5}, "stop"),
        ({"stop": [1, 2]}, "stop"),
        ({"stop": [""]}, "stop"),
        ({"max_tokens": 2, "min_tokens": 3}, "min_tokens"),
        ({"logprobs": 21}, "logprobs"),
        ({"presence_penalty": 3.0}, "presence_penalty"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
    ],
)
def test_bad_params_rejected_with_named_field(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_stop_normalized_to_tuple():
    assert SamplingParams(stop="x").stop == ("x",)
    assert SamplingParams(stop=["a", "b"]).stop == ("a", "b")
    assert SamplingParams(stop=None).stop == ()


def test_greedy_and_penalty_flags():
    assert SamplingParams(temperature=0).is_greedy and not SamplingParams(temperature=0.5).is_greedy
    assert SamplingParams(frequency_penalty=0.1).has_penalties and not SamplingParams().has_penalties
