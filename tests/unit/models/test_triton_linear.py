"""The FP8 few-rows matmul (models.triton_linear) against the dequantized matmul, and Fp8Linear's choice of it.

Without CUDA the kernel runs in Triton's interpreter (tests/conftest.py); on a GPU, on the GPU (scripts/gpu_check.sh
runs this file there)."""

from __future__ import annotations

import pytest
import torch

from tokenfleet.models import triton_linear
from tokenfleet.models.linear import DenseLinear, Fp8Linear, select_linear

pytestmark = pytest.mark.skipif(not triton_linear.available(), reason="triton is not installed")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def weight(n: int, k: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    return Fp8Linear().prepare((torch.randn(n, k, generator=g) * 0.05).to(DEVICE, torch.bfloat16))


def activations(rows: int, k: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=g)
    x[:, :3] *= 40  # outlier channels, as real activations have
    return x.to(DEVICE, dtype)


@pytest.mark.parametrize("rows", [1, 3, 16, 40])
@pytest.mark.parametrize("n,k,block_k", [(48, 80, 64), (64, 128, 32)], ids=["ragged", "even"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=["bf16", "fp16", "fp32"])
def test_the_kernel_is_the_dequantized_matmul(rows, n, k, block_k, dtype):
    """Channels past a multiple of block_n (48 = 32 + 16), columns past a multiple of block_k (80 = 64 + 16), rows
    padded to 16 or 64 in the program: all masked. fp32 sums in another order than torch's; 16-bit outputs round
    once (the interpreter truncates where a GPU rounds to nearest: 2 ulps)."""
    w = weight(n, k, seed=n + k)
    x = activations(rows, k, dtype, seed=rows)
    ref = x.float() @ w.dequantize(torch.float32).t()
    out = triton_linear.Fp8WeightMatmul(rows=64, block_n=32, block_k=block_k, num_warps=4, num_stages=2)(x, w)
    assert out.dtype == dtype and out.shape == (rows, n)
    err = ((out.float() - ref).abs() / ref.abs().amax()).amax().item()
    assert err < (1e-5 if dtype == torch.float32 else 2 * torch.finfo(dtype).eps), err


def test_it_is_closer_to_the_16_bit_matmul_than_quantized_activations_are():
    """Weight-only FP8 leaves activations alone: the few-rows path carries the weights' rounding only, the general
    path the weights' and the per-token FP8 activations' (here 2.6 % against 3.1 % of the product's norm)."""
    g = torch.Generator().manual_seed(3)
    dense = (torch.randn(64, 256, generator=g) * 0.05).to(DEVICE, torch.bfloat16)
    w = Fp8Linear().prepare(dense)
    x = activations(4, 256, torch.bfloat16, seed=9)
    exact = x.float() @ dense.float().t()
    few = Fp8Linear(triton_linear.Fp8WeightMatmul(16, 32, 64, 4, 2))(x, w).float()
    general = Fp8Linear()(x, w).float()

    def err(y: torch.Tensor) -> float:
        return ((y - exact).norm() / exact.norm()).item()

    assert err(few) < err(general) < 0.05, (err(few), err(general))
    weights_only = x.float() @ w.dequantize(torch.float32).t()
    assert ((general - weights_only).norm() / weights_only.norm()).item() > 0.005  # the activations' own rounding


def test_fp8_linear_takes_the_kernel_up_to_its_rows_and_scaled_mm_above():
    w = weight(32, 64, seed=1)
    kernel = triton_linear.Fp8WeightMatmul(rows=4, block_n=16, block_k=32, num_warps=4, num_stages=2)
    linear = Fp8Linear(kernel)
    for rows in (1, 4, 5, 9):
        x = activations(rows, 64, torch.bfloat16, seed=rows)
        expected = kernel(x, w) if rows <= 4 else Fp8Linear()(x, w)
        assert torch.equal(linear(x, w), expected), rows
    dense = torch.randn(8, 64, device=DEVICE, dtype=torch.bfloat16)  # the LM head stays in the model's dtype
    x = activations(2, 64, torch.bfloat16, seed=2)
    assert torch.equal(linear(x, dense), torch.nn.functional.linear(x, dense))


def test_selection_follows_the_device_and_the_settings(monkeypatch):
    cpu = torch.device("cpu")
    monkeypatch.delenv("TOKENFLEET_KERNELS", raising=False)
    monkeypatch.delenv("TOKENFLEET_FP8_MATMUL", raising=False)
    assert triton_linear.select(cpu) is None  # on CPU the general path (torch._scaled_mm) serves
    assert select_linear(torch.bfloat16, cpu, "fp8").few_rows is None
    monkeypatch.setenv("TOKENFLEET_KERNELS", "triton")  # the interpreter, as CI tests kernels
    chosen = select_linear(torch.bfloat16, cpu, "fp8").few_rows
    assert isinstance(chosen, triton_linear.Fp8WeightMatmul)
    assert (chosen.rows, chosen.block_n, chosen.block_k, chosen.num_warps, chosen.num_stages) == (16, 32, 256, 4, 4)
    monkeypatch.setenv("TOKENFLEET_FP8_MATMUL", "8,64,128,8,3")
    assert triton_linear.select(cpu).rows == 8
    monkeypatch.setenv("TOKENFLEET_FP8_MATMUL", "0,32,256,4,4")
    assert triton_linear.select(cpu) is None
    for bad, match in (("16,32,256", "rows,block_n"), ("x,32,256,4,4", "rows,block_n"), ("16,24,256,4,4", "block_n"),
                       ("65,32,256,4,4", "rows=65")):
        monkeypatch.setenv("TOKENFLEET_FP8_MATMUL", bad)
        with pytest.raises(ValueError, match=match):
            triton_linear.select(cpu)
    monkeypatch.setenv("TOKENFLEET_KERNELS", "torch")
    assert triton_linear.select(torch.device("cuda")) is None


@pytest.mark.skipif(DEVICE != "cuda", reason="Llama-3.1-8B's layer shapes: a GPU check (the interpreter is slow)")
@pytest.mark.parametrize("rows", [1, 8, 16])
def test_llama_8b_layer_shapes_with_the_default_settings(rows, monkeypatch):
    monkeypatch.delenv("TOKENFLEET_FP8_MATMUL", raising=False)
    kernel = triton_linear.Fp8WeightMatmul.from_env()
    for n, k in ((6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)):  # qkv, o, gate_up, down
        w = weight(n, k, seed=n ^ k)
        x = activations(rows, k, torch.bfloat16, seed=rows)
        ref = x.float() @ w.dequantize(torch.float32).t()
        out = kernel(x, w).float()
        assert ((out - ref).norm() / ref.norm()).item() < 4e-3, (n, k)
        dense = w.dequantize(torch.bfloat16)  # the 16-bit path (TOKENFLEET_BF16_MATMUL) at the same shapes
        out = triton_linear.WeightMatmul(16, 32, 256, 4, 4)(x, dense).float()
        ref = x.float() @ dense.float().t()
        assert ((out - ref).norm() / ref.norm()).item() < 4e-3, (n, k)


def test_fp8_weights_on_a_gpu_without_e4m3_are_refused_at_load(monkeypatch):
    """torch._scaled_mm and the kernel's e4m3 loads need compute capability 8.9: an A100 gets a clear error when the
    model is loaded, not a failing first forward (the device is only a name here: nothing runs)."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100")
    with pytest.raises(ValueError, match="FP8 weights need.*8.9 or newer.*A100 is 8.0"):
        select_linear(torch.bfloat16, torch.device("cuda"), "fp8")
    select_linear(torch.bfloat16, torch.device("cuda"), "")  # bf16 weights: anywhere
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setenv("TOKENFLEET_FP8_MATMUL", "0,32,256,4,4")  # nothing compiled: _scaled_mm only
    assert isinstance(select_linear(torch.bfloat16, torch.device("cuda"), "fp8"), Fp8Linear)


@pytest.mark.parametrize("rows", [1, 5, 16])
@pytest.mark.parametrize("n,k,block_k", [(48, 80, 64), (64, 128, 32)], ids=["ragged", "even"])
def test_the_16_bit_few_rows_path_is_the_matmul(rows, n, k, block_k):
    """TOKENFLEET_BF16_MATMUL's kernel: the same program over bf16 weights, no scale."""
    g = torch.Generator().manual_seed(n * k + rows)
    w = (torch.randn(n, k, generator=g) * 0.05).to(DEVICE, torch.bfloat16)
    x = activations(rows, k, torch.bfloat16, seed=rows)
    kernel = triton_linear.WeightMatmul(rows=16, block_n=32, block_k=block_k, num_warps=4, num_stages=2)
    out = kernel(x, w)
    ref = x.float() @ w.float().t()
    assert out.dtype == torch.bfloat16 and out.shape == (rows, n)
    assert ((out.float() - ref).abs() / ref.abs().amax()).amax().item() < 2 * torch.finfo(torch.bfloat16).eps
    linear = DenseLinear(kernel)
    assert torch.equal(linear(x, w), out)
    many = activations(17, k, torch.bfloat16, seed=17)  # over its rows: F.linear
    assert torch.equal(linear(many, w), torch.nn.functional.linear(many, w))


def test_the_16_bit_few_rows_path_is_opt_in(monkeypatch):
    monkeypatch.setenv("TOKENFLEET_KERNELS", "triton")
    monkeypatch.delenv("TOKENFLEET_BF16_MATMUL", raising=False)
    cpu = torch.device("cpu")
    assert triton_linear.select(cpu, triton_linear.WeightMatmul) is None  # rows 0 by default: cuBLAS serves
    monkeypatch.setenv("TOKENFLEET_BF16_MATMUL", "8,64,128,4,3")
    chosen = triton_linear.select(cpu, triton_linear.WeightMatmul)
    assert isinstance(chosen, triton_linear.WeightMatmul) and (chosen.rows, chosen.block_n) == (8, 64)
    monkeypatch.setenv("TOKENFLEET_BF16_MATMUL", "8,24,128,4,3")
    with pytest.raises(ValueError, match="TOKENFLEET_BF16_MATMUL block_n=24"):
        triton_linear.select(cpu, triton_linear.WeightMatmul)
