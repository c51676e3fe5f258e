"""FP8 weights (registry ``quantization: fp8``) and the FP8 KV cache (``kv_cache_dtype: fp8``) against bf16 on the
default model's real weights.

Teacher-forced on a fixed text: at every position, does the fp8 model's most likely next token equal the bf16
model's, and how much does the text's perplexity move. ``torch._scaled_mm`` runs on CPU, so this is the same
quantization and the same matmul call the GPU path makes (tests/gpu runs it there)."""

from __future__ import annotations

import math

import pytest

from tests.model.helpers import make_core
from tokenfleet.engine.request_spec import RequestSpec
from tokenfleet.engine.sampling_params import SamplingParams
from tokenfleet.models.tokenizer import Tokenizer

TEXT = (
    "The history of the bicycle begins in the early nineteenth century, when inventors in Germany and France "
    "built wooden machines that riders pushed along with their feet. The addition of pedals to the front wheel "
    "in the 1860s made the velocipede popular in Paris, although its iron tires earned it the nickname boneshaker. "
    "Later designs enlarged the front wheel to go faster with each turn of the pedals, which made the penny-farthing "
    "fast but dangerous. The safety bicycle of the 1880s, with two wheels of equal size and a chain driving the rear "
    "wheel, solved that problem, and pneumatic tires soon made riding comfortable. Within a decade millions of people "
    "rode bicycles to work, and the machine changed how cities grew, how women dressed, and how roads were paved. "
    "Today engineers still refine the same basic design with lighter frames, better gears and electric motors."
)


def teacher_forced(core, prompt: list[int]) -> list:
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=1)
    core.add_request(RequestSpec(prompt, params, request_id="text"))
    logprobs = []
    while core.has_unfinished():
        for out in core.step():
            logprobs += out.prompt_logprobs
    assert len(logprobs) == len(prompt) - 1
    return logprobs


def perplexity(logprobs: list) -> float:
    return math.exp(-sum(lp.logprob for lp in logprobs) / len(logprobs))


@pytest.mark.timeout(600)
def test_fp8_weights_agree_with_bf16_teacher_forced(default_model_dir):
    prompt = Tokenizer(default_model_dir).encode(TEXT)
    assert len(prompt) > 150
    fp32 = teacher_forced(make_core(default_model_dir, dtype="float32"), prompt)
    bf16 = teacher_forced(make_core(default_model_dir, dtype="bfloat16"), prompt)
    fp8 = teacher_forced(make_core(default_model_dir, dtype="bfloat16", quantization="fp8"), prompt)

    def agree(a: list, b: list) -> float:
        return sum(x.top[0][0] == y.top[0][0] for x, y in zip(a, b)) / len(a)

    agreement = agree(bf16, fp8)
    print(f"on {len(bf16)} positions: top-1 agreement fp8/bf16 {agreement:.1%} (bf16/fp32 {agree(fp32, bf16):.1%}, "
          f"fp8/fp32 {agree(fp32, fp8):.1%}); perplexity fp32 {perplexity(fp32):.3f}, bf16 {perplexity(bf16):.3f}, "
          f"fp8 {perplexity(fp8):.3f}")
    # measured here: 85.1 % and +1.9 % (a 135M model; larger models lose less to per-channel fp8)
    assert agreement >= 0.80
    assert perplexity(fp8) <= 1.05 * perplexity(bf16)


def test_fp8_needs_a_16_bit_activation_dtype(default_model_dir):
    with pytest.raises(ValueError, match="float32"):
        make_core(default_model_dir, dtype="float32", quantization="fp8")


@pytest.mark.nightly  # ~14 s on CPU; FP8 weights stay here, and the FP8 KV engine tests in tests/unit/engine
@pytest.mark.timeout(600)
def test_fp8_kv_cache_agrees_with_bf16_teacher_forced(default_model_dir):
    """FP8 K/V (registry ``kv_cache_dtype: fp8``), alone and with FP8 weights. The text is prefilled in chunks of 16
    tokens, so each chunk reads the text before it from the FP8 cache."""
    prompt = Tokenizer(default_model_dir).encode(TEXT)
    bf16 = teacher_forced(make_core(default_model_dir, dtype="bfloat16", max_prefill_chunk=16), prompt)
    kv8 = teacher_forced(make_core(default_model_dir, dtype="bfloat16", max_prefill_chunk=16, kv_cache_dtype="fp8"),
                         prompt)
    both = teacher_forced(make_core(default_model_dir, dtype="bfloat16", max_prefill_chunk=16, kv_cache_dtype="fp8",
                                    quantization="fp8"), prompt)

    def agree(a: list, b: list) -> float:
        return sum(x.top[0][0] == y.top[0][0] for x, y in zip(a, b)) / len(a)

    print(f"on {len(bf16)} positions: top-1 agreement with bf16: fp8 KV {agree(bf16, kv8):.1%}, fp8 KV + fp8 weights "
          f"{agree(bf16, both):.1%}; perplexity bf16 {perplexity(bf16):.3f}, fp8 KV {perplexity(kv8):.3f}, both "
          f"{perplexity(both):.3f}")
    # measured here (the native kernel's FP8 path): 92.8 % at +0.2 % perplexity; with fp8 weights too, 87.8 % at
    # +4.2 % (fp8 weights alone: +1.9 %, above); the torch reference path gave 93.9 % / -0.4 % and 89.5 % / +1.5 %
    assert agree(bf16, kv8) >= 0.88
    assert perplexity(kv8) <= 1.03 * perplexity(bf16)
    assert agree(bf16, both) >= 0.80
    assert perplexity(both) <= 1.07 * perplexity(bf16)
