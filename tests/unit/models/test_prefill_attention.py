"""Where bf16 prefill chunks attend on a CPU (models.prefill_attention): the faster of the native kernel and SDPA on
this machine, measured once and cached; both choices give a model the same greedy answers but at near-ties."""

from __future__ import annotations

import json

import pytest
import torch

from tokenfleet.models import native, prefill_attention
from tokenfleet.models.attention import NativePagedAttention

needs_compiler = pytest.mark.skipif(native.compiler() is None, reason="no C compiler: the torch path is what runs")


@pytest.fixture(scope="module")
def kernel() -> NativePagedAttention:
    lib = native.load("paged_attention")
    if lib is None:
        pytest.skip("the native attention kernel does not build here")
    return NativePagedAttention(lib)


@needs_compiler
@pytest.mark.parametrize(("kernel_ms", "sdpa_ms", "in_kernel"), [(5.6, 2.9, False), (2.0, 3.0, True), (3.0, 2.9, True)])
def test_sdpa_takes_the_chunks_only_when_clearly_faster(kernel, tmp_path, kernel_ms, sdpa_ms, in_kernel):
    calls = []

    def timer(*args):  # type: ignore[no-untyped-def]
        calls.append(args)
        return kernel_ms, sdpa_ms

    cache = tmp_path / "prefill-attention.json"
    choice = prefill_attention.choose(kernel, 9, 3, 64, 16, cache=cache, timer=timer)
    assert (choice.in_kernel, choice.source) == (in_kernel, "measured")
    assert ("native kernel" if in_kernel else "SDPA") in choice.reason
    again = prefill_attention.choose(kernel, 9, 3, 64, 16, cache=cache, timer=timer)
    assert (again.in_kernel, again.source, len(calls)) == (in_kernel, "cached", 1)  # no second measurement
    other = prefill_attention.choose(kernel, 4, 1, 64, 16, cache=cache, timer=timer)  # another geometry: measured
    assert other.source == "measured" and len(calls) == 2


@needs_compiler
def test_an_unreadable_cache_is_measured_again(kernel, tmp_path):
    cache = tmp_path / "prefill-attention.json"
    cache.write_text("not json")
    choice = prefill_attention.choose(kernel, 9, 3, 64, 16, cache=cache, timer=lambda *a: (1.0, 2.0))
    assert choice.in_kernel and choice.source == "measured"
    assert len(json.loads(cache.read_text())) == 1


@needs_compiler
def test_the_measurement_times_both_on_this_machine(kernel):
    kernel_ms, sdpa_ms = prefill_attention.measure(kernel, 9, 3, 64, 16)
    assert kernel_ms > 0 and sdpa_ms > 0


@needs_compiler
@pytest.mark.parametrize("in_kernel", [True, False])
def test_the_loader_applies_the_choice(default_model_dir, monkeypatch, in_kernel):
    from tokenfleet.models.config import ModelConfig
    from tokenfleet.models.loader import checked_kernels

    monkeypatch.setattr(prefill_attention, "choose", lambda *a, **k: prefill_attention.PrefillChoice(in_kernel, 2.0, 1.0))
    attention, _, _ = checked_kernels(ModelConfig.from_dir(default_model_dir), torch.bfloat16, torch.device("cpu"))
    assert isinstance(attention, NativePagedAttention)
    assert attention.handles_prefill is in_kernel
    assert ("in the SDPA" in attention.prefill_reason) is not in_kernel
