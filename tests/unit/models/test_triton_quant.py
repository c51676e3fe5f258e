"""Q8_0 / Q4_1 weights on a GPU (models.triton_quant): the repacked layout holds the GGUF blocks' values exactly,
the Triton weight-only matmul equals the dequantized matmul, and a gguf record loads through it end to end.

Without CUDA the kernel runs in Triton's interpreter (tests/conftest.py), the same program; on a GPU, on the GPU."""

from __future__ import annotations

import pytest
import torch

from tokenfleet.models import triton_quant
from tokenfleet.models.ggml_quant import QuantRows, QuantTensor, dequantize, random_quant

pytestmark = pytest.mark.skipif(triton_quant.triton is None, reason="triton is not installed")

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.mark.parametrize("kind", triton_quant.KINDS)
def test_the_repacked_weight_holds_the_blocks_values_exactly(kind):
    w = random_quant(kind, 37, 96, torch.Generator().manual_seed(1))
    packed = triton_quant.repack(w, "cpu")
    assert packed.shape == (37, 96) and packed.nbytes <= w.nbytes * 2  # fp32 scales beside the quants
    assert torch.equal(packed.dequantize(torch.float32), dequantize(w, torch.float32))


@pytest.mark.parametrize("kind", triton_quant.KINDS)
@pytest.mark.parametrize("rows", [1, 3, 17])
@pytest.mark.parametrize(("n", "k"), [(48, 96), (64, 128)], ids=["ragged", "even"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_the_kernel_is_the_dequantized_matmul(kind, rows, n, k, dtype):
    """Channels past a multiple of block_n (48 = 32 + 16) and columns past a multiple of block_k (96 = 64 + 32):
    masked; rows padded to 16 or 32 in the program. The weight is rounded to x's dtype as a dequantized checkpoint's
    would be; the sums are fp32 in another order than torch's."""
    g = torch.Generator().manual_seed(rows + n)
    w = random_quant(kind, n, k, g)
    x = torch.randn(rows, k, generator=g).to(dtype)
    kernel = triton_quant.QuantWeightMatmul(32, 32, 64, 4, 2)
    got = kernel(x.to(DEVICE), triton_quant.repack(w, DEVICE)).cpu()
    assert got.dtype == dtype and got.shape == (rows, n)
    want = x.float() @ dequantize(w, dtype).float().t()
    rtol, atol = (1e-5, 1e-5) if dtype == torch.float32 else (2**-7, 2**-6)
    torch.testing.assert_close(got.float(), want, rtol=rtol, atol=atol)


def test_the_layer_keeps_q8_0_and_q4_1_and_densifies_the_other_types():
    g = torch.Generator().manual_seed(5)
    layer = triton_quant.GpuQuantLinear(DEVICE, torch.float32, triton_quant.QuantWeightMatmul(4, 32, 64, 4, 2))
    q4, q6 = random_quant("Q4_1", 32, 256, g), random_quant("Q6_K", 16, 256, g)
    assert isinstance(layer.prepare(q4), triton_quant.GpuQuantWeight)
    dense = layer.prepare(q6)
    assert isinstance(dense, torch.Tensor) and torch.equal(dense.cpu(), dequantize(q6))
    mixed = layer.prepare(QuantRows((q4, q6)))  # a fused layer with a type the GPU does not keep: one dense matrix
    assert isinstance(mixed, torch.Tensor) and mixed.shape == (48, 256)
    both = layer.prepare(QuantRows((q4, random_quant("Q8_0", 8, 256, g))))
    assert isinstance(both, QuantRows) and all(isinstance(p, triton_quant.GpuQuantWeight) for p in both.parts)
    for rows in (2, 9):  # the kernel's rows, then more: dequantized for the library matmul
        x = torch.randn(rows, 256, generator=g)
        got = layer(x.to(DEVICE), layer.prepare(q4)).cpu()
        torch.testing.assert_close(got, x @ dequantize(q4).t(), rtol=1e-5, atol=1e-5)


def test_a_gguf_record_loads_for_the_gpu_path_and_answers_as_the_dequantized_model(default_model_dir, tmp_path,
                                                                                  monkeypatch):
    """TOKENFLEET_KERNELS=triton takes the GPU path on a CPU: the layers repacked, the embedding's blocks kept.
    Rows 0 turns the kernel off (its load check with it), so every step multiplies the repacked weights
    dequantized and the test stays quick; the kernel itself and its load check are tested above and below. Greedy
    answers equal the fp32 model's."""
    from tests.model.helpers import greedy, make_core, run_to_completion
    from tests.model.test_gguf_served import PROMPTS, kept_quantized
    from tokenfleet.models.tokenizer import Tokenizer

    folder = kept_quantized(default_model_dir, tmp_path / "gguf")
    monkeypatch.setenv("TOKENFLEET_KERNELS", "triton")
    monkeypatch.setenv("TOKENFLEET_QUANT_MATMUL", "0,32,128,4,3")
    core = make_core(folder, quantization="gguf", num_blocks=64)
    model = core.runner.model
    assert isinstance(model.linear, triton_quant.GpuQuantLinear)
    assert isinstance(model.weights.layers[0].qkv, triton_quant.GpuQuantWeight)
    assert isinstance(model.weights.embed, QuantTensor) and isinstance(model.weights.lm_head,
                                                                        triton_quant.GpuQuantWeight)
    monkeypatch.delenv("TOKENFLEET_KERNELS")
    tokenizer = Tokenizer(default_model_dir)
    arrivals = {0: [(f"p{i}", tokenizer.encode(p), greedy(6)) for i, p in enumerate(PROMPTS[:2])]}
    assert run_to_completion(core, arrivals) == run_to_completion(make_core(default_model_dir), arrivals)


def test_the_load_check_runs_the_kernel_on_the_models_shapes():
    from tokenfleet.models.kernel_check import checked_gpu_quant_linear

    layer = triton_quant.GpuQuantLinear(DEVICE, torch.float32, triton_quant.QuantWeightMatmul(2, 32, 64, 4, 2))
    chosen, checks = checked_gpu_quant_linear(layer, {("Q4_1", 40, 64), ("Q8_0", 24, 64), ("Q6_K", 16, 256)},
                                              torch.float32, DEVICE)
    assert chosen is layer and len(checks) == 1 and checks[0].passed
