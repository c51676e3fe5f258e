"""Matmul kernels for the model's linear layers, chosen once per model (never per call).

On CPU in bf16, oneDNN weights packed ahead of time ("prepacked", as torch's inductor does)
skip the per-call weight reorder of ``F.linear``: measured here 2x faster at M=1 and 1.3x at
M=32 (one 3072x576 layer), with bit-identical results. fp32 keeps ``F.linear``: packed fp32
sums in another order, and fp32 is the dtype of our exact-equality tests against HF.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F


class LinearKernel(Protocol):
    def prepare(self, weight: torch.Tensor) -> torch.Tensor:
        """Turn a [out, in] weight into whatever ``__call__`` takes."""

    def __call__(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """x: [tokens, in] -> [tokens, out]."""


class DenseLinear:
    def prepare(self, weight: torch.Tensor) -> torch.Tensor:
        return weight

    def __call__(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return F.linear(x, weight)


class PackedOneDNNLinear:
    def prepare(self, weight: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._reorder_linear_weight(weight.contiguous())

    def __call__(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, weight, None, "none", [], "")


def select_linear(dtype: torch.dtype, device: torch.device) -> LinearKernel:
    if device.type == "cpu" and dtype == torch.bfloat16 and _packed_available():
        return PackedOneDNNLinear()
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
