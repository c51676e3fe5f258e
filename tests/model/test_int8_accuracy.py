"""int8 weights (registry ``quantization: int8``) against bf16 on the default model's real weights, teacher-forced on
the fixed text of test_fp8_accuracy: the matrices quantized at load to int8 with a scale per 32 values; decode-sized
steps (up to INT8_ROWS rows: here the text prefilled that many tokens a step) multiply int8 activations (integer dot
products), longer steps the dequantized weights. The bar: perplexity within 2 % of bf16's."""

from __future__ import annotations

import pytest

from tests.model.helpers import make_core
from tests.model.test_fp8_accuracy import TEXT, perplexity, teacher_forced
from tokenfleet.models.ggml_quant import QuantTensor
from tokenfleet.models.quant_linear import INT8_ROWS
from tokenfleet.models.tokenizer import Tokenizer


def agree(a: list, b: list) -> float:
    return sum(x.top[0][0] == y.top[0][0] for x, y in zip(a, b, strict=True)) / len(a)


@pytest.mark.timeout(600)
def test_int8_weights_and_activations_agree_with_bf16_teacher_forced(default_model_dir):
    prompt = Tokenizer(default_model_dir).encode(TEXT)
    bf16 = teacher_forced(make_core(default_model_dir, dtype="bfloat16"), prompt)
    core = make_core(default_model_dir, quantization="int8", max_prefill_chunk=INT8_ROWS)
    weights = core.runner.model.weights
    assert isinstance(weights.embed, QuantTensor) and {layer.qkv.kind for layer in weights.layers} == {"Q8_0"}
    assert core.runner.model.linear.int8_activations or core.runner.model.linear.native is None
    int8 = teacher_forced(core, prompt)  # every step <= INT8_ROWS rows: the int8-activation kernel
    whole = teacher_forced(make_core(default_model_dir, quantization="int8"), prompt)  # one step: dequantized weights
    print(f"on {len(bf16)} positions: top-1 agreement with bf16: int8 activations {agree(bf16, int8):.1%}, weights "
          f"only {agree(bf16, whole):.1%}; perplexity bf16 {perplexity(bf16):.3f}, int8 {perplexity(int8):.3f}, "
          f"weights only {perplexity(whole):.3f}")
    # measured here: 94.5 % and 95.6 %; perplexity +0.6 % and +0.2 %
    for run in (int8, whole):
        assert agree(bf16, run) >= 0.85
        assert perplexity(run) <= 1.02 * perplexity(bf16)
