"""Linear layers whose weights stay in GGML's block-quantized formats (models.ggml_quant.QuantTensor), as a GGUF
file ships them: Q4_1 and Q8_0 (the default model), Q5_0, Q4_K and Q6_K (Gemma 3 270M).

``QuantLinear`` is a ``LinearKernel`` (models.linear) over ``QuantTensor`` weights. Steps of a few rows of x (decode:
one row per request; up to 32 rows of fp32 x, 512 of bf16 on an AVX-512 BF16 CPU) go through csrc/quant_linear.c,
which reads each quantized weight once per call, dequantizes it in the cache and multiplies it in fp32: a decode
step reads the quantized bytes alone (Q4_1: 5 bits per weight against bf16's 16). Longer steps (prefill) dequantize
the weight, a few MiB at a time, and multiply with torch (MKL or oneDNN), which is faster there. Without the native
kernel every step takes that path, the torch reference ("dequantize, then F.linear").

Numerics: the native kernel's weights are bitwise the reference's dequantized values (ggml_quant.dequantize) and its
sums are fp32 in another order (~1e-6 relative); it is checked against the reference on the machine it runs on
(models.kernel_check.checked_quant_linear). Activations of any float dtype: the kernel computes in fp32 (bf16 x is
exact in fp32) and rounds the output to x's dtype once. Steps of several bf16 rows on AVX-512 BF16 CPUs, and the
prefill path, multiply in x's dtype: weights rounded to bf16 for a bf16 model (as a bf16 checkpoint converted from
the GGUF would hold them; 2^-9 relative per weight, well inside bf16's check tolerance).
"""

from __future__ import annotations

import ctypes

import torch
import torch.nn.functional as F

from tokenfleet import envs
from tokenfleet.models import native
from tokenfleet.models.ggml_quant import QuantRows, QuantTensor, dequantize

INT8_KINDS = ("Q4_1", "Q8_0")  # the types csrc/quant_linear.c multiplies with int8 activations
INT8_TOLERANCE = (2**-6, 2**-5)  # (rtol, atol) of the int8 path's check, outputs O(1): see QuantLinear
INT8_ROWS = 4  # the int8 path's rows: it halves a one-row step's time, but from ~4 rows the fp32 / bf16 paths match it
# Rows of x the native kernel takes; more: dequantize, then torch's matmul. Measured (benchmarks/quant_linear.py):
# with fp32 x the kernel is as fast as MKL at 32 rows; with bf16 x, the fp32 kernel only up to ~8 rows (then
# dequantizing to bf16 for oneDNN wins), the bf16 kernel (AVX-512 BF16) up to BF16_ROWS. The portable C build takes
# none: slower than dequantizing (its dequantization still serves) and torch's matmul even at one row.
FEW_ROWS = {torch.float32: 32}
FEW_ROWS_LOW_PRECISION = 8  # bf16 / fp16 x through the fp32 kernel
# the model's 120 layer matmuls on 2 threads (benchmarks/quant_linear.py's shapes): 41 ms against 56 for dequantize +
# oneDNN at 64 rows, 159 against 169 at 288 (a 256-token chunk beside 32 decodes), 280 against 295 at 512; 823
# against 638 at 1024
BF16_ROWS = 512
CHUNK_VALUES = 1 << 22  # weight values dequantized at a time on the prefill path (16 MiB in fp32)


class NativeQuantMatmul:
    """csrc/quant_linear.c: y = x W^T for fp32 x and a ``QuantTensor`` W, and W's fp32 values."""

    BUILDS = ("portable C", "AVX2+FMA", "AVX-512")  # tf_quant_linear_build()

    def __init__(self, lib: ctypes.CDLL):
        i64, ptr, c_int = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
        self._matmul = lib.tf_quant_linear
        self._matmul.argtypes = [c_int, ptr, ptr, ptr, i64, i64, i64, c_int]
        self._matmul.restype = c_int
        self._matmul_int8 = lib.tf_quant_linear_q8
        self._matmul_int8.argtypes = [c_int, ptr, ptr, ptr, i64, i64, i64, c_int]
        self._matmul_int8.restype = c_int
        self._matmul_bf16 = lib.tf_quant_linear_bf16
        self._matmul_bf16.argtypes = [c_int, ptr, ptr, ptr, i64, i64, i64, c_int]
        self._matmul_bf16.restype = c_int
        lib.tf_quant_linear_has_bf16.restype = c_int
        self.has_bf16 = bool(lib.tf_quant_linear_has_bf16())  # the AVX-512 BF16 path for bf16 x (matmul_bf16)
        self._dequantize = lib.tf_quant_dequantize
        self._dequantize.argtypes = [c_int, ptr, ptr, i64, i64, c_int]
        self._dequantize.restype = c_int
        self._dequantize_bf16 = lib.tf_quant_dequantize_bf16
        self._dequantize_bf16.argtypes = [c_int, ptr, ptr, i64, i64, c_int]
        self._dequantize_bf16.restype = c_int
        lib.tf_quant_linear_build.restype = c_int
        self.build = self.BUILDS[lib.tf_quant_linear_build()]

    @property
    def name(self) -> str:
        return f"native quantized matmul ({self.build})"

    def __call__(self, x: torch.Tensor, weight: QuantTensor, int8: bool = False) -> torch.Tensor:
        """x: [m, k] contiguous fp32 CPU -> [m, n] fp32. ``int8``: x quantized per 32 values (``INT8_KINDS`` only)."""
        out = x.new_empty(x.shape[0], weight.rows)
        fn = self._matmul_int8 if int8 else self._matmul
        rc = fn(weight.type.type_id, x.data_ptr(), weight.data.data_ptr(), out.data_ptr(), x.shape[0], weight.cols,
                weight.rows, torch.get_num_threads())
        if rc != 0:
            raise ValueError(f"quantized matmul: {weight.kind} {tuple(weight.shape)} times {tuple(x.shape)} failed ({rc})")
        return out

    def matmul_bf16(self, x: torch.Tensor, weight: QuantTensor) -> torch.Tensor:
        """x: [m, k] contiguous bf16 CPU -> [m, n] fp32, the weight rounded to bf16 (``has_bf16`` builds only)."""
        out = torch.empty(x.shape[0], weight.rows)
        rc = self._matmul_bf16(weight.type.type_id, x.data_ptr(), weight.data.data_ptr(), out.data_ptr(), x.shape[0],
                               weight.cols, weight.rows, torch.get_num_threads())
        if rc != 0:
            raise ValueError(f"bf16 quantized matmul: {weight.kind} {tuple(weight.shape)} times {tuple(x.shape)} failed "
                             f"({rc})")
        return out

    def dequantize(self, weight: QuantTensor, dtype: torch.dtype = torch.float32,
                   out: torch.Tensor | None = None) -> torch.Tensor:
        """[rows, cols] in ``dtype``: fp32 bitwise ggml_quant.dequantize(weight); bf16 (``has_bf16`` builds) its
        values rounded to nearest even, as ``.to(torch.bfloat16)`` rounds them. ``out``: a contiguous tensor of that
        shape and dtype to write into (the prefill path reuses one: a fresh one of several MiB is page faults)."""
        fn = self._dequantize_bf16 if dtype == torch.bfloat16 else self._dequantize
        if dtype not in (torch.float32, torch.bfloat16) or (dtype == torch.bfloat16 and not self.has_bf16):
            raise ValueError(f"dequantize: no native path to {dtype}")
        if out is None:
            out = torch.empty(weight.rows, weight.cols, dtype=dtype)
        if out.shape != (weight.rows, weight.cols) or out.dtype != dtype or not out.is_contiguous():
            raise ValueError(f"dequantize: out {tuple(out.shape)} {out.dtype} for {tuple(weight.shape)} {dtype}")
        if fn(weight.type.type_id, weight.data.data_ptr(), out.data_ptr(), weight.rows, weight.cols,
              torch.get_num_threads()) != 0:
            raise ValueError(f"dequantize: {weight.kind} {tuple(weight.shape)} not supported")
        return out


def native_quant_matmul(defines: tuple[str, ...] = ()) -> NativeQuantMatmul | None:
    """The native kernel, unless TOKENFLEET_KERNELS=torch or it cannot be built here. ``defines``: a build variant
    (tests: ``TF_PORTABLE_ONLY``, ``TF_NO_AVX512``)."""
    if envs.kernels() == "torch":
        return None
    lib = native.load("quant_linear", defines)
    return NativeQuantMatmul(lib) if lib is not None else None


class QuantLinear:
    """``LinearKernel`` for ``QuantTensor`` weights: ``native`` for steps of up to ``rows_native(x.dtype)`` rows of x
    (``few_rows`` when given, else FEW_ROWS), else (and without ``native``) dequantize, then ``F.linear``.

    ``int8_activations``: Q4_1 and Q8_0 weights multiply steps of up to INT8_ROWS rows of x quantized to int8 per 32
    values (llama.cpp's numerics: integer dot products, ~2x faster at one row). x moves by up to half a step,
    max |x| / 254 in each block of 32, so an output moves by up to sum_i |w_i| max|x_block(i)| / 254: for
    unit-normal x, ~0.5% of the output's scale, ~0.002 on the load check's O(1) outputs at a standard deviation,
    which allows (``check_tolerance``) 2^-5 plus 2^-6 relative (a wrong kernel is off by O(1)); the tests hold each
    output to the bound itself."""

    quantized_weights = True  # the model's matrices are not plain tensors (LoRA stacks no base weights on them)

    def __init__(self, native: NativeQuantMatmul | None = None, few_rows: int | None = None,
                 int8_activations: bool = False):
        self.native = native
        self.few_rows = few_rows
        self.int8_activations = int8_activations and native is not None
        self._buffers: dict[torch.dtype, torch.Tensor] = {}  # _values' reused dequantization buffers

    def rows_native(self, dtype: torch.dtype) -> int:
        """The most rows of x of ``dtype`` the native kernel takes (0: none)."""
        if self.native is None:
            return 0
        if self.few_rows is not None:
            return self.few_rows
        if self.native.build == "portable C":  # measured slower than dequantize + torch even at one row
            return 0
        if dtype == torch.bfloat16 and self.native.has_bf16:
            return BF16_ROWS
        return FEW_ROWS.get(dtype, FEW_ROWS_LOW_PRECISION)

    @property
    def name(self) -> str:
        if self.native is None:
            return "dequantize + F.linear"
        return self.native.name + (", int8 activations for Q4_1/Q8_0" if self.int8_activations else "")

    def check_tolerance(self, dtype: torch.dtype, kv_cache_dtype: str = "") -> tuple[float, float] | None:
        """The load check's (rtol, atol): the int8 path's own (see the class); with bf16 x, 2^-7 both (the weights
        are rounded to bf16 too, against the reference's exact values: up to ~0.007 on the check's O(1) outputs
        over half a million of them, beside bf16's own 2^-8 atol; a wrong kernel is off by O(1)); else None (the
        dtype's)."""
        if self.int8_activations:
            return INT8_TOLERANCE
        return (2**-7, 2**-7) if dtype == torch.bfloat16 else None

    def prepare(self, weight: QuantTensor | QuantRows | torch.Tensor) -> QuantTensor | QuantRows | torch.Tensor:
        if isinstance(weight, QuantRows):
            return QuantRows(tuple(self.prepare(p) for p in weight.parts))  # type: ignore[misc]
        if isinstance(weight, torch.Tensor):  # a matrix the file keeps in a float type (or int8 could not block)
            return weight.contiguous()
        if not isinstance(weight, QuantTensor):
            raise TypeError(f"QuantLinear takes QuantTensor weights, got {type(weight).__name__}")
        return weight if weight.data.is_contiguous() else QuantTensor(weight.kind, weight.rows, weight.cols,
                                                                      weight.data.contiguous())

    def __call__(self, x: torch.Tensor, weight: QuantTensor | QuantRows) -> torch.Tensor:
        """x: [..., cols] of any float dtype -> [..., rows] in x's dtype."""
        if isinstance(weight, QuantRows):  # row ranges of different types: each multiplied, the outputs joined
            return torch.cat([self(x, part) for part in weight.parts], dim=-1)
        if isinstance(weight, torch.Tensor):
            return F.linear(x, weight.to(x.dtype))
        x2 = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])  # [tokens, cols]
        rows = x2.shape[0]
        if self.native is not None and 0 < rows <= self.rows_native(x.dtype) and x2.device.type == "cpu":
            int8 = self.int8_activations and rows <= INT8_ROWS and weight.kind in INT8_KINDS
            if x.dtype == torch.bfloat16 and rows > 1 and self.native.has_bf16 and not int8:
                out = self.native.matmul_bf16(x2.contiguous(), weight).to(x.dtype)
            else:
                out = self.native(x2.float().contiguous(), weight, int8).to(x.dtype)
        else:
            out = self._dequantized_matmul(x2, weight)
        return out if x.dim() == 2 else out.reshape(*x.shape[:-1], weight.rows)

    def _dequantized_matmul(self, x: torch.Tensor, weight: QuantTensor) -> torch.Tensor:
        """x [tokens, cols] times the weight dequantized ``CHUNK_VALUES`` at a time, in x's dtype."""
        step = max(1, CHUNK_VALUES // weight.cols)
        if weight.rows <= step:
            return F.linear(x, self._values(weight, x.dtype).to(x.device))
        out = x.new_empty(x.shape[0], weight.rows)
        for r0 in range(0, weight.rows, step):
            r1 = min(r0 + step, weight.rows)
            part = QuantTensor(weight.kind, r1 - r0, weight.cols, weight.data[r0:r1])  # a view: whole rows
            out[:, r0:r0 + part.rows] = F.linear(x, self._values(part, x.dtype).to(x.device))
        return out

    def _values(self, weight: QuantTensor, dtype: torch.dtype) -> torch.Tensor:
        """W's values in ``dtype``; on the native path in a buffer this layer reuses for every weight (valid until
        the next call: F.linear reads it at once)."""
        if self.native is None or weight.data.device.type != "cpu":
            return dequantize(weight, dtype)
        direct = dtype == torch.float32 or (dtype == torch.bfloat16 and self.native.has_bf16)
        values = self._buffer(weight.rows * weight.cols, dtype if direct else torch.float32)
        out = self.native.dequantize(weight, values.dtype, values.view(weight.rows, weight.cols))
        return out if direct else out.to(dtype)

    def _buffer(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        buf = self._buffers.get(dtype)
        if buf is None or buf.numel() < numel:
            buf = self._buffers[dtype] = torch.empty(max(numel, CHUNK_VALUES), dtype=dtype)
        return buf[:numel]


def select_quant_linear(int8_activations: bool = False) -> QuantLinear:
    """The native kernel where it builds (and TOKENFLEET_KERNELS is not ``torch``), else the torch reference;
    ``int8_activations`` for its decode steps over Q4_1 / Q8_0 weights (see QuantLinear). A loader checks it with
    models.kernel_check.checked_quant_linear before serving with it."""
    return QuantLinear(native_quant_matmul(), int8_activations=int8_activations)
