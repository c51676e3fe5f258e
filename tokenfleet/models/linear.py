"""Matmul kernels for the model's linear layers, chosen once per model (never per call).

On CPU in bf16, oneDNN weights packed ahead of time ("prepacked", as torch's inductor does)
skip the per-call weight reorder of ``F.linear``: measured here 2x faster at M=1 and 1.3x at
M=32 (one 3072x576 layer), with bit-identical results.

On CPU in fp32 (the CPU default), steps of up to 32 rows go through csrc/skinny_linear.c
(``NativeFewRows``), which streams each weight once from memory: on the 2-core Zen 3 the 60 MLP
weights of a 30-layer model took 16 ms at one row against MKL's 32 ms, 17 against 56 at 4 rows,
64 against 82 at 32 (benchmarks/linear_kernels.py). Its dot products sum in another order than
MKL's (fp32 rounding, ~1e-6 relative); it is checked against ``F.linear`` at load
(models.kernel_check.checked_linear). Longer steps (prefill) keep MKL, faster there.

``quantization="fp8"`` (the registry record's field): FP8 e4m3 weights with one scale per output
channel, activations quantized per token at run time, one ``torch._scaled_mm`` per layer (Hopper's
FP8 tensor cores on CUDA; it runs on CPU too, slowly, which is where its accuracy is tested). Half
the weight bytes of bf16: a batch-1 decode step, which reads every weight once, is bound by them.
The embedding and the LM head stay in the model's dtype.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.nn.functional as F

from tokenfleet import envs
from tokenfleet.models import native

QUANTIZATIONS = ("", "fp8")
FP8_MAX = 448.0  # largest finite float8_e4m3fn


class LinearKernel(Protocol):
    def prepare(self, weight: Any) -> Any:
        """Turn a [out, in] weight (a tensor; a GGUF's models.ggml_quant.QuantTensor or QuantRows for
        models.quant_linear.QuantLinear) into whatever ``__call__`` takes."""

    def __call__(self, x: torch.Tensor, weight: Any) -> torch.Tensor:
        """x: [tokens, in] -> [tokens, out]."""


class DenseLinear:
    """``F.linear``; with ``few_rows`` (models.triton_linear.WeightMatmul, CUDA, opt-in: TOKENFLEET_BF16_MATMUL; or
    ``NativeFewRows``, CPU fp32), steps of that many rows or fewer go through that weight-streaming kernel instead."""

    def __init__(self, few_rows: Any = None):
        self.few_rows = few_rows

    @property
    def name(self) -> str:
        return getattr(self.few_rows, "name", None) or "F.linear"

    def prepare(self, weight: torch.Tensor) -> torch.Tensor:
        return weight

    def __call__(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        if self.few_rows is not None and self.few_rows.takes(x) and x.dtype == weight.dtype and weight.is_contiguous():
            return self.few_rows(x, weight)
        return F.linear(x, weight)


class NativeFewRows:
    """csrc/skinny_linear.c: y = x W^T for fp32 CPU tensors of up to ``rows`` rows (``DenseLinear``'s few-rows path)."""

    BUILDS = ("portable C", "AVX2+FMA")  # tf_skinny_linear_build()

    def __init__(self, lib: ctypes.CDLL):
        self._fn = lib.tf_skinny_linear
        i64, ptr = ctypes.c_int64, ctypes.c_void_p
        self._fn.argtypes = [ptr, ptr, ptr, i64, i64, i64, ctypes.c_int]
        self._fn.restype = ctypes.c_int
        lib.tf_skinny_linear_build.restype = ctypes.c_int
        self.rows = int(lib.tf_skinny_linear_max_rows())
        self.build = self.BUILDS[lib.tf_skinny_linear_build()]

    @property
    def name(self) -> str:
        return f"native fp32 few-row matmul ({self.build})"

    def takes(self, x: torch.Tensor) -> bool:
        return x.dim() == 2 and 0 < x.shape[0] <= self.rows and x.dtype == torch.float32 and x.device.type == "cpu"

    def __call__(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        x = x.contiguous()
        out = x.new_empty(x.shape[0], weight.shape[0])
        if self._fn(x.data_ptr(), weight.data_ptr(), out.data_ptr(), x.shape[0], x.shape[1], weight.shape[0],
                    torch.get_num_threads()) != 0:
            raise ValueError(f"few-row matmul: shapes {tuple(x.shape)} x {tuple(weight.shape)} out of range")
        return out


def native_few_rows() -> NativeFewRows | None:
    """The native fp32 few-row matmul, unless TOKENFLEET_KERNELS=torch or it cannot be built here."""
    if envs.kernels() == "torch":
        return None
    lib = native.load("skinny_linear")
    return NativeFewRows(lib) if lib is not None else None


class PackedOneDNNLinear:
    def prepare(self, weight: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._reorder_linear_weight(weight.contiguous())

    def __call__(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, weight, None, "none", [], "")


@dataclass(frozen=True)
class Fp8Weight:
    data: torch.Tensor  # [out, in] float8_e4m3fn
    scale: torch.Tensor  # [1, out] float32: row i of the weight is data[i] * scale[0, i]

    @property
    def shape(self) -> torch.Size:
        return self.data.shape

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        return (self.data.float() * self.scale.t()).to(dtype)


def quantize_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of ``x`` [rows, cols] as e4m3 with one fp32 scale per row ([rows, 1]): amax maps to 448."""
    x32 = x.float()
    scale = x32.abs().amax(dim=1, keepdim=True).clamp(min=1e-12) / FP8_MAX
    return (x32 / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), scale


class Fp8Linear:
    """y = (x quantized per token) @ (W quantized per output channel)^T, rescaled, in the activations' dtype.

    ``few_rows`` (models.triton_linear, CUDA): steps of that many rows or fewer (decode at small batches) keep the
    activations in their dtype and multiply them by the e4m3 weights in one Triton kernel, which streams the weights
    at HBM speed where ``torch._scaled_mm`` with one row does not."""

    def __init__(self, few_rows: Any = None):
        self.few_rows = few_rows

    def prepare(self, weight: torch.Tensor) -> Fp8Weight:
        if weight.shape[0] % 16 or weight.shape[1] % 16:
            raise ValueError(f"fp8 weights need both dimensions divisible by 16, got {tuple(weight.shape)}")
        data, scale = quantize_fp8(weight)
        return Fp8Weight(data.contiguous(), scale.view(1, -1).contiguous())

    def __call__(self, x: torch.Tensor, weight: Fp8Weight | torch.Tensor) -> torch.Tensor:
        if isinstance(weight, torch.Tensor):  # a layer kept in the model's dtype (the LM head)
            return F.linear(x, weight)
        if self.few_rows is not None and self.few_rows.takes(x):
            return self.few_rows(x, weight)
        if x.is_cuda and _triton_quantize is not None:
            xq, scale = _triton_quantize(x)  # one kernel instead of ~8
        else:
            xq, scale = quantize_fp8(x)
        return torch._scaled_mm(xq, weight.data.t(), scale_a=scale, scale_b=weight.scale, out_dtype=x.dtype)


def _load_triton_quantize() -> Any:
    if not torch.cuda.is_available():
        return None
    from tokenfleet.models import triton_ops

    return triton_ops.quantize_fp8 if triton_ops.available() else None


_triton_quantize = _load_triton_quantize()


def select_linear(dtype: torch.dtype, device: torch.device, quantization: str = "") -> LinearKernel:
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization={quantization!r}: the torch engine supports {QUANTIZATIONS[1:]} (or none)")
    if quantization == "fp8":
        if dtype == torch.float32:
            raise ValueError("fp8 weights run with bfloat16 or float16 activations, not float32")
        from tokenfleet.models.kv_fp8 import check_fp8_device

        check_fp8_device("FP8 weights", device, "serve the model without quantization")
        from tokenfleet.models import triton_linear

        return Fp8Linear(triton_linear.select(device))
    if device.type == "cpu" and dtype == torch.bfloat16 and _packed_available():
        return PackedOneDNNLinear()
    if dtype != torch.float32 and device.type == "cuda":
        from tokenfleet.models import triton_linear

        return DenseLinear(triton_linear.select(device, triton_linear.WeightMatmul))
    if dtype == torch.float32 and device.type == "cpu":
        return DenseLinear(native_few_rows())
    return DenseLinear()


def _packed_available() -> bool:
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        probe = torch.ones(4, 4, dtype=torch.bfloat16)
        packed = torch.ops.mkldnn._reorder_linear_weight(probe)
        out = torch.ops.mkldnn._linear_pointwise(torch.ones(1, 4, dtype=torch.bfloat16), packed, None, "none", [], "")
    except (RuntimeError, AttributeError):
        return False
    return bool(torch.equal(out, torch.full((1, 4), 4.0, dtype=torch.bfloat16)))
