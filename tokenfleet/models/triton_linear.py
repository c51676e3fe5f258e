"""FP8 weights times a few rows of activations, in Triton (CUDA): an FP8 model's matmuls at decode batch sizes.

A decode step at batch 1-16 reads every weight once and computes little, so its time is the weights' bytes over the
HBM bandwidth, and FP8 weights should halve it. ``models.linear.Fp8Linear``'s general path does not get there at one
row: it quantizes the activations (one more kernel per layer) for ``torch._scaled_mm``, whose cuBLASLt FP8 tiles are
sized for many rows. On an H200 the 8B geometry's FP8 batch-1 step took 6.115 ms against bf16's 5.914
(benchmarks/reports/2026-11-26-h200-gpu-data-plane.md).

Here the activations stay in the model's bf16/fp16 (weight-only FP8: no rounding of activations, so closer to bf16
than the general path): a program owns ``block_n`` output channels for every row, streams their e4m3 weights
``block_k`` columns at a time, converts each tile to the activations' dtype in registers (exact: every e4m3 value is
a bf16 and an fp16 value) and multiplies on tensor cores into fp32 sums; the channel's scale multiplies the sum.
Rows are padded to 16 inside the program (``tl.dot``'s least), which costs no memory traffic.

Tested against the dequantized matmul through Triton's interpreter on CPU (tests/unit/models/test_triton_linear.py)
and on CUDA in tests/gpu.
"""

from __future__ import annotations

from typing import Any

import torch

from tokenfleet import envs

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - Fp8Linear's general path serves
    triton = None


def available() -> bool:
    return triton is not None


def _interpreted() -> bool:
    return envs.triton_interpret()


if triton is not None:
    @triton.jit
    def _fp8_weight_matmul_kernel(x_ptr, w_ptr, scale_ptr, out_ptr, rows, stride_x, stride_o,
                                  N: tl.constexpr, K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                                  BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, FP32_DOT: tl.constexpr,
                                  HAS_SCALE: tl.constexpr):
        """out[:rows, n] = (x[:rows] @ w[n]) * scale[n] for this program's BLOCK_N channels n; w is [N, K] e4m3 (or,
        without HAS_SCALE, in the activations' dtype: the 16-bit few-rows path). The weight's shape is constant (a
        model has a few), so the loop's trip count is known when compiling."""
        rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        rm = tl.arange(0, BLOCK_M)
        rk = tl.arange(0, BLOCK_K)
        n_ok = rn < N
        m_ok = rm < rows
        x_rows = x_ptr + rm[:, None] * stride_x
        w_rows = w_ptr + tl.where(n_ok, rn, 0).to(tl.int64)[:, None] * K  # rows past N read row 0, masked at the end
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k = k0 + rk
            if EVEN_K:
                x = tl.load(x_rows + k[None, :], mask=m_ok[:, None], other=0.0)
                w = tl.load(w_rows + k[None, :])
            else:
                k_ok = k < K
                x = tl.load(x_rows + k[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
                w = tl.load(w_rows + k[None, :], mask=k_ok[None, :], other=0.0)
            if FP32_DOT:  # fp32 activations, and the interpreter (numpy has no bf16 dot)
                acc += tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)), input_precision="ieee")
            else:
                acc += tl.dot(x, tl.trans(w.to(x.dtype)))
        if HAS_SCALE:
            out = acc * tl.load(scale_ptr + rn, mask=n_ok, other=0.0)[None, :]
        else:
            out = acc
        tl.store(out_ptr + rm[:, None] * stride_o + rn[None, :], out.to(out_ptr.dtype.element_ty),
                 mask=m_ok[:, None] & n_ok[None, :])


class Fp8WeightMatmul:
    """x [rows, K] (bf16/fp16) @ an ``Fp8Weight`` [N, K] -> [rows, N] in x's dtype, for rows <= ``rows``.

    Settings (TOKENFLEET_FP8_MATMUL, "rows,block_n,block_k,num_warps,num_stages"; default 16,32,256,4,4): the most
    rows it takes (0: never, every FP8 matmul goes through ``torch._scaled_mm``), output channels per program, weight
    columns per loop step, warps, pipeline stages."""

    def __init__(self, rows: int, block_n: int, block_k: int, num_warps: int, num_stages: int):
        if rows < 0 or rows > 64:
            raise ValueError(f"{self.env} rows={rows}: 0 (off) to 64")
        for name, value in (("block_n", block_n), ("block_k", block_k)):
            if value < 16 or value & (value - 1):
                raise ValueError(f"{self.env} {name}={value}: a power of two, at least 16")
        self.rows, self.block_n, self.block_k = rows, block_n, block_k
        self.num_warps, self.num_stages = num_warps, num_stages

    env = "TOKENFLEET_FP8_MATMUL"

    @classmethod
    def from_env(cls) -> Fp8WeightMatmul:
        return cls(*_parse(envs.fp8_matmul(), cls.env))

    def takes(self, x: torch.Tensor) -> bool:
        return 0 < x.shape[0] <= self.rows and x.dtype in (torch.bfloat16, torch.float16, torch.float32)

    def __call__(self, x: torch.Tensor, weight: Any) -> torch.Tensor:
        """``weight``: a ``models.linear.Fp8Weight`` (data [N, K] e4m3, scale [1, N] fp32), or (``WeightMatmul``) a
        [N, K] tensor in x's dtype."""
        data, scale = (weight, None) if isinstance(weight, torch.Tensor) else (weight.data, weight.scale)
        n, k = data.shape
        if x.stride(-1) != 1:
            x = x.contiguous()
        rows = x.shape[0]
        out = torch.empty(rows, n, dtype=x.dtype, device=x.device)
        block_m = max(16, 1 << max(0, rows - 1).bit_length())
        _fp8_weight_matmul_kernel[(triton.cdiv(n, self.block_n),)](
            x, data, scale if scale is not None else data, out, rows, x.stride(0), out.stride(0), N=n, K=k,
            BLOCK_M=block_m, BLOCK_N=self.block_n, BLOCK_K=self.block_k, EVEN_K=k % self.block_k == 0,
            FP32_DOT=x.dtype == torch.float32 or _interpreted(), HAS_SCALE=scale is not None,
            num_warps=self.num_warps, num_stages=self.num_stages)
        return out


class WeightMatmul(Fp8WeightMatmul):
    """The same kernel over 16-bit weights (``models.linear.DenseLinear``'s few-rows path, opt-in): one launch per
    layer at decode batch sizes, where cuBLAS at one row picks split-K tiles and a reduction kernel for some layers
    (the H100 profile of the 8B batch-1 step: 64 reductions, ~0.12 ms). Settings: TOKENFLEET_BF16_MATMUL, as
    TOKENFLEET_FP8_MATMUL's; rows 0 (the default) leaves every matmul to cuBLAS (16,32,256,4,4 was 2.8 % faster at
    8B batch 1 on one H100: benchmarks/reports/2026-11-26-h100-gpu-data-plane.md)."""

    env = "TOKENFLEET_BF16_MATMUL"

    @classmethod
    def from_env(cls) -> WeightMatmul:
        return cls(*_parse(envs.bf16_matmul(), cls.env))

    def takes(self, x: torch.Tensor) -> bool:
        return 0 < x.shape[0] <= self.rows and x.dtype in (torch.bfloat16, torch.float16)


def _parse(raw: str, env: str) -> list[int]:
    try:
        values = [int(v) for v in raw.split(",")]
    except ValueError:
        values = []
    if len(values) != 5:
        raise ValueError(f"{env}={raw!r}: rows,block_n,block_k,num_warps,num_stages")
    return values


def select(device: torch.device, kind: type[Fp8WeightMatmul] = Fp8WeightMatmul) -> Fp8WeightMatmul | None:
    """The few-rows kernel (``kind``: FP8 weights, or ``WeightMatmul`` for 16-bit ones) where Triton runs it (CUDA,
    or the interpreter under TOKENFLEET_KERNELS=triton), unless its setting's rows are 0 or TOKENFLEET_KERNELS=torch
    asks for the reference paths."""
    choice = envs.kernels()
    if not available() or choice == "torch" or (device.type != "cuda" and choice != "triton"):
        return None
    kernel = kind.from_env()
    return kernel if kernel.rows > 0 else None
