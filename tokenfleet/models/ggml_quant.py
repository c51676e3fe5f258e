"""GGML's block-quantized tensor types, kept quantized in memory: the types the shipped GGUF files hold (the default
model's Q4_1 with a Q8_0 embedding; Gemma 3 270M's Q8_0, Q5_0, Q4_K and Q6_K).

A ``QuantTensor`` is a [rows, cols] matrix (a linear layer's [out, in] weight, or an embedding's [vocab, hidden]) as
the GGUF file stores it: each row is ``cols / block_elems`` consecutive blocks of ``block_bytes`` bytes, the blocks of
one row contiguous, rows one after the other. Rows are independent, so selecting or permuting rows (an embedding
lookup, undoing the converter's rotary permutation of Q and K) works on the bytes directly.

Block layouts (little-endian; ``d``/``m``/``dmin`` are fp16):

- Q8_0, 32 values in 34 bytes: ``d``, then 32 int8 ``q``; value = d * q.
- Q4_1, 32 values in 20 bytes: ``d``, ``m``, then 16 bytes: value i < 16 is the low nibble of byte i, value 16 + i the
  high nibble; value = d * q + m.
- Q5_0, 32 values in 22 bytes: ``d``, 4 bytes ``qh`` (bit i: the fifth bit of value i), 16 bytes of nibbles as Q4_1;
  value = d * (q - 16).
- Q4_K, 256 values in 144 bytes: ``d``, ``dmin``, 12 bytes packing eight 6-bit scales and eight 6-bit mins (one per
  sub-block of 32), 128 bytes of nibbles (per 64 values: 32 bytes, low nibbles the first 32 values, high the next);
  value = d * scale_j * q - dmin * min_j.
- Q6_K, 256 values in 210 bytes: 128 bytes ``ql`` (low 4 bits), 64 bytes ``qh`` (high 2 bits), 16 int8 scales (one
  per 16 values), ``d``; value = d * scale_j * (q - 32).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class GGMLType:
    name: str
    type_id: int  # ggml_type in the GGUF file
    block_elems: int
    block_bytes: int

    @property
    def bits_per_weight(self) -> float:
        return 8 * self.block_bytes / self.block_elems


TYPES = {t.name: t for t in (
    GGMLType("Q4_1", 3, 32, 20),
    GGMLType("Q5_0", 6, 32, 22),
    GGMLType("Q8_0", 8, 32, 34),
    GGMLType("Q4_K", 12, 256, 144),
    GGMLType("Q6_K", 14, 256, 210),
)}
BY_ID = {t.type_id: t for t in TYPES.values()}


@dataclass(frozen=True)
class QuantTensor:
    """A [rows, cols] matrix of ``kind`` blocks: ``data`` is uint8 [rows, cols / block_elems * block_bytes]."""

    kind: str
    rows: int
    cols: int
    data: torch.Tensor

    def __post_init__(self) -> None:
        t = TYPES[self.kind]
        if self.cols % t.block_elems:
            raise ValueError(f"{self.kind}: {self.cols} columns are not whole blocks of {t.block_elems}")
        want = (self.rows, self.cols // t.block_elems * t.block_bytes)
        if self.data.dtype != torch.uint8 or tuple(self.data.shape) != want:
            raise ValueError(f"{self.kind} [{self.rows}, {self.cols}]: data must be uint8 {want}, got "
                             f"{self.data.dtype} {tuple(self.data.shape)}")

    @property
    def type(self) -> GGMLType:
        return TYPES[self.kind]

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.rows, self.cols))

    @property
    def nbytes(self) -> int:
        return self.data.numel()

    def select_rows(self, index: torch.Tensor) -> QuantTensor:
        """Rows ``index`` (in that order), still quantized."""
        return QuantTensor(self.kind, int(index.numel()), self.cols, self.data.index_select(0, index).contiguous())
