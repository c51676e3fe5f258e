"""Block-quantized weights on CUDA: weight-only int8 (Q8_0) and int4 (Q4_1) matmuls in Triton, and the linear layer
that serves a gguf or int8 record on a GPU with them.

A decode step reads every weight once, so its time is the weights' bytes over the memory bandwidth: Q8_0 holds
8.5 bits a weight, Q4_1 5, against bf16's 16. At load each such ``ggml_quant.QuantTensor`` is repacked for the GPU
(``GpuQuantWeight``): the quants in one array, row-major ([rows, cols] int8, or [rows, cols / 2] bytes of two 4-bit
values, value 2j in the low nibble), the fp16 block scales (and Q4_1's block minimums) as fp32 arrays [rows,
cols / 32]: the same values, in a layout a program reads with wide loads. A program owns ``block_n`` output channels
for every row of x, streams their quants ``block_k`` columns at a time, dequantizes the tile in registers (q * d
(+ m) in fp32, as ggml_quant.dequantize computes it), rounds it to x's dtype and multiplies on tensor cores into fp32
sums: the numerics of dequantizing the weight to x's dtype and multiplying, without the dequantized weight in memory
(a GPU may fuse Q4_1's multiply and add: a value can then differ from the reference's in its last bit).
Steps of more rows than the kernel takes (prefill) dequantize the weight (torch ops on the GPU, a weight at a time)
and use cuBLAS. Activations stay in the model's dtype (weight-only: no int8 activations on the GPU).

The other types of a GGUF (Q5_0, Q4_K, Q6_K: Gemma 3's file) are dequantized to the model's dtype at load on a GPU,
and its embedding table stays quantized on the device (ggml_quant.embedding dequantizes the rows a step looks up).

Tested against the dequantized matmul through Triton's interpreter on CPU (tests/unit/models/test_triton_quant.py),
which runs the same program; its speed on a GPU is measured by the GPU checks when a GPU is at hand.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from tokenfleet import envs
from tokenfleet.models.ggml_quant import QuantRows, QuantTensor, dequantize
from tokenfleet.models.triton_linear import _interpreted, _parse

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - the dequantize-then-matmul path serves
    triton = None

KINDS = ("Q8_0", "Q4_1")  # kept quantized on a GPU; other GGML types are dequantized at load there
BLOCK = 32  # values per block (both kinds)


@dataclass(frozen=True)
class GpuQuantWeight:
    """A Q8_0 or Q4_1 matrix [rows, cols] repacked for the GPU kernel (module docstring)."""

    kind: str
    rows: int
    cols: int
    qs: torch.Tensor  # Q8_0: int8 [rows, cols]; Q4_1: uint8 [rows, cols // 2], value 2j low nibble, 2j + 1 high
    scale: torch.Tensor  # fp32 [rows, cols // 32]: each block's d
    minimum: torch.Tensor | None  # Q4_1: fp32 [rows, cols // 32], each block's m; Q8_0: None

    @property
    def shape(self) -> tuple[int, int]:
        return (self.rows, self.cols)

    @property
    def nbytes(self) -> int:
        return self.qs.nbytes + self.scale.nbytes + (self.minimum.nbytes if self.minimum is not None else 0)

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        """[rows, cols] in ``dtype``: the values ggml_quant.dequantize gives the original blocks (torch ops, on the
        weight's device)."""
        nb = self.cols // BLOCK
        if self.kind == "Q8_0":
            q = self.qs.view(self.rows, nb, BLOCK).float()
            return (q * self.scale[:, :, None]).reshape(self.rows, self.cols).to(dtype)
        packed = self.qs.view(self.rows, nb, BLOCK // 2)
        q = torch.stack([packed & 15, packed >> 4], dim=-1).reshape(self.rows, nb, BLOCK).float()
        assert self.minimum is not None
        return (q * self.scale[:, :, None] + self.minimum[:, :, None]).reshape(self.rows, self.cols).to(dtype)


def repack(weight: QuantTensor, device: torch.device | str) -> GpuQuantWeight:
    """``weight`` (a Q8_0 or Q4_1 ``QuantTensor`` as the GGUF file stores it) in the GPU layout, on ``device``."""
    if weight.kind not in KINDS:
        raise ValueError(f"{weight.kind} weights are not kept quantized on a GPU (only {', '.join(KINDS)})")
    nb = weight.cols // BLOCK
    size = 34 if weight.kind == "Q8_0" else 20
    blocks = weight.data.reshape(weight.rows, nb, size)
    scale = blocks[:, :, 0:2].contiguous().view(torch.float16).reshape(weight.rows, nb).float()
    if weight.kind == "Q8_0":
        qs = blocks[:, :, 2:].contiguous().view(torch.int8).reshape(weight.rows, weight.cols)
        return GpuQuantWeight("Q8_0", weight.rows, weight.cols, qs.to(device), scale.to(device), None)
    minimum = blocks[:, :, 2:4].contiguous().view(torch.float16).reshape(weight.rows, nb).float()
    nibbles = blocks[:, :, 4:]  # byte i: value i (low nibble), value i + 16 (high)
    values = torch.cat([nibbles & 15, nibbles >> 4], dim=-1)  # [rows, nb, 32] in block order
    qs = (values[:, :, 0::2] | (values[:, :, 1::2] << 4)).reshape(weight.rows, weight.cols // 2)
    return GpuQuantWeight("Q4_1", weight.rows, weight.cols, qs.to(device), scale.to(device), minimum.to(device))


if triton is not None:
    @triton.jit
    def _quant_matmul_kernel(x_ptr, q_ptr, s_ptr, m_ptr, out_ptr, rows, stride_x, stride_o,
                             N: tl.constexpr, K: tl.constexpr, INT4: tl.constexpr, BLOCK_M: tl.constexpr,
                             BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, FP32_DOT: tl.constexpr):
        """out[:rows, n] = x[:rows] @ dequantized w[n] for this program's BLOCK_N channels n. K is a multiple of 32
        and BLOCK_K of 32: a tile holds whole blocks, the last one masked past K."""
        G: tl.constexpr = BLOCK_K // 32
        NB: tl.constexpr = K // 32
        rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        rm = tl.arange(0, BLOCK_M)
        n_ok = rn < N
        m_ok = rm < rows
        rn_safe = tl.where(n_ok, rn, 0).to(tl.int64)  # rows past N read row 0, masked at the end
        x_rows = x_ptr + rm[:, None] * stride_x
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            k_ok = k < K
            x = tl.load(x_rows + k[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
            g = k0 // 32 + tl.arange(0, G)
            g_ok = g < NB
            s = tl.load(s_ptr + rn_safe[:, None] * NB + g[None, :], mask=g_ok[None, :], other=0.0)  # [BN, G]
            if INT4:
                j = k0 // 2 + tl.arange(0, BLOCK_K // 2)
                p = tl.load(q_ptr + rn_safe[:, None] * (K // 2) + j[None, :], mask=(j < K // 2)[None, :], other=0)
                q = tl.reshape(tl.join(p & 15, p >> 4), [BLOCK_N, G, 32]).to(tl.float32)  # value 2j, then 2j + 1
                mn = tl.load(m_ptr + rn_safe[:, None] * NB + g[None, :], mask=g_ok[None, :], other=0.0)
                w = q * tl.reshape(s, [BLOCK_N, G, 1]) + tl.reshape(mn, [BLOCK_N, G, 1])
            else:
                q = tl.load(q_ptr + rn_safe[:, None] * K + k[None, :], mask=k_ok[None, :], other=0)
                w = tl.reshape(q.to(tl.float32), [BLOCK_N, G, 32]) * tl.reshape(s, [BLOCK_N, G, 1])
            w = tl.reshape(w, [BLOCK_N, BLOCK_K])
            if FP32_DOT:  # fp32 activations, and the interpreter (numpy has no bf16 dot)
                acc += tl.dot(x.to(tl.float32), tl.trans(w.to(x.dtype).to(tl.float32)), input_precision="ieee")
            else:
                acc += tl.dot(x, tl.trans(w.to(x.dtype)))
        tl.store(out_ptr + rm[:, None] * stride_o + rn[None, :], acc.to(out_ptr.dtype.element_ty),
                 mask=m_ok[:, None] & n_ok[None, :])


class QuantWeightMatmul:
    """x [rows, K] @ a ``GpuQuantWeight`` [N, K] -> [rows, N] in x's dtype, for rows <= ``rows``. Settings
    (TOKENFLEET_QUANT_MATMUL, "rows,block_n,block_k,num_warps,num_stages"; default 32,32,128,4,3): the most rows
    it takes (0: never), output channels per program, weight columns per loop step (a multiple of 32), warps,
    pipeline stages. The default is a first guess, not yet tuned on a GPU."""

    env = "TOKENFLEET_QUANT_MATMUL"

    def __init__(self, rows: int, block_n: int, block_k: int, num_warps: int, num_stages: int):
        if rows < 0 or rows > 64:
            raise ValueError(f"{self.env} rows={rows}: 0 (off) to 64")
        if block_n < 16 or block_n & (block_n - 1):
            raise ValueError(f"{self.env} block_n={block_n}: a power of two, at least 16")
        if block_k < 32 or block_k & (block_k - 1):
            raise ValueError(f"{self.env} block_k={block_k}: a power of two, at least 32")
        self.rows, self.block_n, self.block_k = rows, block_n, block_k
        self.num_warps, self.num_stages = num_warps, num_stages

    @classmethod
    def from_env(cls) -> QuantWeightMatmul:
        return cls(*_parse(envs.quant_matmul(), cls.env))

    @property
    def name(self) -> str:
        return "Triton int8/int4 weight-only matmul" + (" (interpreter)" if _interpreted() else "")

    def takes(self, x: torch.Tensor) -> bool:
        return 0 < x.shape[0] <= self.rows and x.dtype in (torch.bfloat16, torch.float16, torch.float32)

    def __call__(self, x: torch.Tensor, weight: GpuQuantWeight) -> torch.Tensor:
        if x.stride(-1) != 1:
            x = x.contiguous()
        rows = x.shape[0]
        out = torch.empty(rows, weight.rows, dtype=x.dtype, device=x.device)
        block_m = max(16, 1 << max(0, rows - 1).bit_length())
        minimum = weight.minimum if weight.minimum is not None else weight.scale
        _quant_matmul_kernel[(triton.cdiv(weight.rows, self.block_n),)](
            x, weight.qs, weight.scale, minimum, out, rows, x.stride(0), out.stride(0), N=weight.rows, K=weight.cols,
            INT4=weight.kind == "Q4_1", BLOCK_M=block_m, BLOCK_N=self.block_n, BLOCK_K=self.block_k,
            FP32_DOT=x.dtype == torch.float32 or _interpreted(), num_warps=self.num_warps,
            num_stages=self.num_stages)
        return out


def select_matmul(device: torch.device) -> QuantWeightMatmul | None:
    """The kernel where Triton runs it (CUDA, or the interpreter under TOKENFLEET_KERNELS=triton), unless its
    rows are 0 or TOKENFLEET_KERNELS=torch asks for the reference."""
    choice = envs.kernels()
    if triton is None or choice == "torch" or (device.type != "cuda" and choice != "triton"):
        return None
    kernel = QuantWeightMatmul.from_env()
    return kernel if kernel.rows > 0 else None


class GpuQuantLinear:
    """``LinearKernel`` for a gguf or int8 record on a GPU: Q8_0 and Q4_1 matrices kept quantized
    (``GpuQuantWeight``), multiplied by ``matmul`` for steps of up to its rows, else dequantized a weight at a time
    for cuBLAS; other GGML types, and float matrices, dense in the model's dtype on the device."""

    def __init__(self, device: torch.device, dtype: torch.dtype, matmul: QuantWeightMatmul | None = None):
        self.device, self.dtype, self.matmul = device, dtype, matmul

    quantized_weights = True  # the model's matrices are not plain tensors (LoRA stacks no base weights on them)

    @property
    def name(self) -> str:
        return self.matmul.name if self.matmul is not None else "dequantize + F.linear (GPU)"

    def check_tolerance(self, dtype: torch.dtype, kv_cache_dtype: str = "") -> tuple[float, float] | None:
        """The load check's (rtol, atol): with 16-bit x, 2^-7 both, as quant_linear.QuantLinear's bf16 path (the
        weights are rounded to x's dtype, against the reference's exact values); else None (the dtype's)."""
        return (2**-7, 2**-7) if dtype in (torch.bfloat16, torch.float16) else None

    def prepare(self, weight: QuantTensor | QuantRows | torch.Tensor) -> Any:
        if isinstance(weight, QuantRows):  # row ranges of different types
            if all(p.kind in KINDS for p in weight.parts):
                return QuantRows(tuple(repack(p, self.device) for p in weight.parts))  # type: ignore[misc]
            return torch.cat([dequantize(p, self.dtype) for p in weight.parts]).to(self.device)  # one dense matrix
        if isinstance(weight, QuantTensor):
            if weight.kind in KINDS:
                return repack(weight, self.device)
            return dequantize(weight, self.dtype).to(self.device)
        return weight.to(self.device, self.dtype).contiguous()

    def __call__(self, x: torch.Tensor, weight: Any) -> torch.Tensor:
        if isinstance(weight, QuantRows):
            return torch.cat([self(x, part) for part in weight.parts], dim=-1)
        if isinstance(weight, torch.Tensor):
            return F.linear(x, weight.to(x.dtype))
        x2 = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
        if self.matmul is not None and self.matmul.takes(x2):
            out = self.matmul(x2, weight)
        else:
            out = F.linear(x2, weight.dequantize(x.dtype))
        return out if x.dim() == 2 else out.reshape(*x.shape[:-1], weight.rows)
