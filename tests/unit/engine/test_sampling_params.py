"""SamplingParams validation (clear ValueErrors) and normalization."""

from __future__ import annotations

import dataclasses

import pytest

from tokenfleet.engine.sampling_params import SamplingParams


@pytest.mark.parametrize(
    ("kwargs", "pattern"),
    [
        ({"max_tokens": 0}, r"max_tokens must be a positive integer, got 0"),
        ({"max_tokens": -5}, r"max_tokens must be a positive integer, got -5"),
        ({"temperature": -0.01}, r"temperature must be >= 0"),
        ({"top_p": 0.0}, r"top_p must be in \(0, 1\]"),
        ({"top_p": 1.5}, r"top_p must be in \(0, 1\], got 1.5"),
        ({"top_p": -0.2}, r"top_p"),
        ({"top_k": -2}, r"top_k must be -1, 0 \(disabled\) or positive, got -2"),
        ({"min_p": 1.5}, r"min_p must be in \[0, 1\], got 1.5"),
        ({"min_p": -0.1}, r"min_p"),
        ({"stop": 5}, r"stop must be a string or a list of strings"),
        ({"stop": [1, 2]}, r"stop must be a string or a list of strings"),
        ({"stop": ["ok", 3]}, r"stop must be a string or a list of strings"),
        ({"stop": ""}, r"stop strings must not be empty"),
        ({"stop": ["a", ""]}, r"stop strings must not be empty"),
        ({"max_tokens": 4, "min_tokens": 5}, r"min_tokens \(5\) must be <= max_tokens \(4\)"),
        ({"min_tokens": -1}, r"min_tokens must be >= 0"),
        ({"logprobs": 21}, r"logprobs must be in \[0, 20\], got 21"),
        ({"logprobs": -1}, r"logprobs"),
        ({"presence_penalty": 2.5}, r"presence_penalty must be in \[-2, 2\]"),
        ({"frequency_penalty": -2.5}, r"frequency_penalty must be in \[-2, 2\]"),
        ({"repetition_penalty": 0.0}, r"repetition_penalty must be > 0"),
    ],
)
def test_bad_input_raises_value_error_naming_the_field(kwargs, pattern):
    with pytest.raises(ValueError, match=pattern):
        SamplingParams(**kwargs)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"max_tokens": 1},
        {"max_tokens": None},
        {"max_tokens": None, "min_tokens": 1000},
        {"max_tokens": 3, "min_tokens": 3},
        {"temperature": 0.0},
        {"temperature": 2.0},
        {"top_p": 1.0},
        {"top_p": 1e-6},
        {"top_k": -1},
        {"top_k": 0},
        {"top_k": 50},
        {"min_p": 0.0},
        {"min_p": 1.0},
        {"logprobs": 0},
        {"logprobs": 20},
        {"presence_penalty": -2.0, "frequency_penalty": 2.0},
        {"repetition_penalty": 0.5},
    ],
)
def test_boundary_values_are_accepted(kwargs):
    params = SamplingParams(**kwargs)
    for key, value in kwargs.items():
        assert getattr(params, key) == value


def test_stop_string_becomes_a_one_tuple():
    params = SamplingParams(stop="###")
    assert params.stop == ("###",)
    assert isinstance(params.stop, tuple)


def test_stop_list_becomes_a_tuple():
    params = SamplingParams(stop=["a", "bc"])
    assert params.stop == ("a", "bc")
    assert isinstance(params.stop, tuple)
    assert SamplingParams(stop=("x",)).stop == ("x",)


def test_stop_none_or_default_is_empty_tuple():
    assert SamplingParams().stop == ()
    assert SamplingParams(stop=None).stop == ()  # type: ignore[arg-type]
    assert SamplingParams(stop=[]).stop == ()


def test_stop_token_ids_normalized_to_int_tuple():
    params = SamplingParams(stop_token_ids=[3, 7])  # type: ignore[arg-type]
    assert params.stop_token_ids == (3, 7)
    assert isinstance(params.stop_token_ids, tuple)


def test_normalized_params_stay_frozen_and_hashable():
    params = SamplingParams(stop=["a"], stop_token_ids=[1])  # type: ignore[arg-type]
    with pytest.raises(dataclasses.FrozenInstanceError):
        params.temperature = 0.5  # type: ignore[misc]
    assert hash(params) == hash(SamplingParams(stop="a", stop_token_ids=(1,)))
    assert params == SamplingParams(stop="a", stop_token_ids=(1,))


def test_is_greedy_for_temperature_zero_only():
    assert SamplingParams(temperature=0).is_greedy
    assert SamplingParams(temperature=0.0).is_greedy
    assert not SamplingParams(temperature=0.1).is_greedy
    assert not SamplingParams().is_greedy  # default temperature 1.0


def test_has_penalties():
    assert not SamplingParams().has_penalties
    assert SamplingParams(presence_penalty=0.1).has_penalties
    assert SamplingParams(frequency_penalty=-0.1).has_penalties
    assert SamplingParams(repetition_penalty=1.1).has_penalties


@pytest.mark.parametrize("field", ["temperature", "repetition_penalty"])
def test_nan_is_rejected(field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: float("nan")})


@pytest.mark.parametrize("field", ["top_p", "min_p", "presence_penalty", "frequency_penalty"])
def test_nan_is_rejected_by_range_checks(field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: float("nan")})


def test_non_integer_top_k_and_boolean_max_tokens_are_rejected():
    with pytest.raises(ValueError, match="top_k"):
        SamplingParams(top_k=2.5)
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=True)
