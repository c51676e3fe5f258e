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

from collections.abc import Sequence
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


# Dequantization: the torch reference every kernel is checked against. Each type's arithmetic repeats gguf-py's
# numpy reference step for step (the same fp32 products and sums, none fused), so its values are bitwise those of
# ``gguf.quants.dequantize``; tests hold it to that.

def _f16(b: torch.Tensor) -> torch.Tensor:
    """[blocks, 2] little-endian fp16 bytes -> [blocks, 1] float32."""
    return b.clone(memory_format=torch.contiguous_format).view(torch.float16).float()  # a copy: offset 0, aligned


def _nibbles(b: torch.Tensor) -> torch.Tensor:
    """[..., n] bytes -> [..., 2, n]: low nibbles, then high nibbles."""
    return torch.stack((b & 0x0F, b >> 4), dim=-2)


def _dequant_q4_1(blk: torch.Tensor) -> torch.Tensor:
    d, m = _f16(blk[:, 0:2]), _f16(blk[:, 2:4])
    q = _nibbles(blk[:, 4:20]).reshape(-1, 32).float()
    return d * q + m


def _dequant_q5_0(blk: torch.Tensor) -> torch.Tensor:
    d = _f16(blk[:, 0:2])
    bits = torch.arange(8, dtype=torch.uint8)
    high = ((blk[:, 2:6, None] >> bits) & 1).reshape(-1, 32) << 4  # bit i of the 4 little-endian bytes: value i's
    q = (_nibbles(blk[:, 6:22]).reshape(-1, 32) | high).to(torch.int32) - 16
    return d * q.float()


def _dequant_q8_0(blk: torch.Tensor) -> torch.Tensor:
    return blk[:, 2:34].contiguous().view(torch.int8).float() * _f16(blk[:, 0:2])


def _k_scale_min(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[blocks, 12] packed bytes -> eight 6-bit scales and eight 6-bit mins, [blocks, 8] each. Bytes 0-3 hold scales
    0-3 in their low 6 bits, bytes 4-7 mins 0-3; bytes 8-11 hold the low 4 bits of scales 4-7 (low nibble) and of
    mins 4-7 (high nibble), whose top 2 bits are the top 2 bits of bytes 0-3 (scales) and 4-7 (mins)."""
    lo, mid, top = s[:, 0:4], s[:, 4:8], s[:, 8:12]
    scale = torch.cat((lo & 0x3F, (top & 0x0F) | ((lo >> 2) & 0x30)), dim=1)
    minimum = torch.cat((mid & 0x3F, (top >> 4) | ((mid >> 2) & 0x30)), dim=1)
    return scale, minimum


def _dequant_q4_k(blk: torch.Tensor) -> torch.Tensor:
    d, dmin = _f16(blk[:, 0:2]), _f16(blk[:, 2:4])
    scale, minimum = _k_scale_min(blk[:, 4:16])
    d_sub = (d * scale.float()).unsqueeze(-1)  # [blocks, 8, 1]
    m_sub = (dmin * minimum.float()).unsqueeze(-1)
    q = _nibbles(blk[:, 16:144].reshape(-1, 4, 32)).reshape(-1, 8, 32).float()  # per 64 values: 32 low, 32 high
    return (d_sub * q - m_sub).reshape(-1, 256)


def _dequant_q6_k(blk: torch.Tensor) -> torch.Tensor:
    ql = _nibbles(blk[:, 0:128].reshape(-1, 2, 64)).reshape(-1, 8, 32)  # per 128 values: 64 low nibbles, 64 high
    qh = blk[:, 128:192].reshape(-1, 2, 1, 32) >> torch.tensor([0, 2, 4, 6], dtype=torch.uint8).reshape(1, 1, 4, 1)
    q = (ql | ((qh & 3).reshape(-1, 8, 32) << 4)).to(torch.int32) - 32
    scale = blk[:, 192:208].contiguous().view(torch.int8).float()  # one per 16 values
    d_sub = (_f16(blk[:, 208:210]) * scale).unsqueeze(-1)  # [blocks, 16, 1]
    return (d_sub * q.reshape(-1, 16, 16).float()).reshape(-1, 256)


_DEQUANT = {"Q4_1": _dequant_q4_1, "Q5_0": _dequant_q5_0, "Q8_0": _dequant_q8_0, "Q4_K": _dequant_q4_k,
            "Q6_K": _dequant_q6_k}


@dataclass(frozen=True)
class QuantRows:
    """One matrix whose row ranges are of different types (a fused QKV whose V is Q8_0 and Q, K Q5_0, as in Gemma 3's
    GGUF): its parts in row order; a linear kernel multiplies each and joins the outputs."""

    parts: tuple[QuantTensor, ...]

    @property
    def rows(self) -> int:
        return sum(p.rows for p in self.parts)

    @property
    def cols(self) -> int:
        return self.parts[0].cols

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.rows, self.cols))

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)


def cat_rows(parts: Sequence[torch.Tensor | QuantTensor]) -> torch.Tensor | QuantTensor | QuantRows:
    """Matrices stacked by rows (a fused QKV, gate_up): ``torch.cat`` of tensors; one QuantTensor when every part is of
    one type (the blocks joined); else QuantRows."""
    if all(isinstance(p, torch.Tensor) for p in parts):
        return torch.cat(list(parts))  # type: ignore[arg-type]
    if not all(isinstance(p, QuantTensor) for p in parts):
        raise ValueError("cannot stack quantized and float matrices into one layer (the GGUF mixes them in one "
                         "fused projection)")
    quant = [p for p in parts if isinstance(p, QuantTensor)]
    if len({p.cols for p in quant}) != 1:
        raise ValueError(f"matrices of {sorted({p.cols for p in quant})} columns cannot be stacked by rows")
    if len({p.kind for p in quant}) == 1:
        return QuantTensor(quant[0].kind, sum(p.rows for p in quant), quant[0].cols, torch.cat([p.data for p in quant]))
    return QuantRows(tuple(quant))


def dequantize(q: QuantTensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The [rows, cols] values of ``q`` (computed in float32, then cast to ``dtype``)."""
    t = q.type
    blocks = q.data.reshape(-1, t.block_bytes)  # [rows * cols / block_elems, block_bytes]
    return _DEQUANT[q.kind](blocks).reshape(q.rows, q.cols).to(dtype)


def embedding(q: QuantTensor, token_ids: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Rows ``token_ids`` (any shape) of an embedding table, dequantized alone: [*token_ids.shape, cols]."""
    flat = token_ids.reshape(-1).to(device=q.data.device, dtype=torch.long)
    return dequantize(q.select_rows(flat), dtype).reshape(*token_ids.shape, q.cols)


# Quantizers (tests, kernel checks, int8 experiments): bitwise those of gguf-py's numpy reference, the same fp32 steps.

def _round_away(x: torch.Tensor) -> torch.Tensor:
    """Round half away from zero (C's roundf), as gguf-py computes it: floor(a) + floor(2 (a - floor(a)))."""
    a = x.abs()
    whole = a.floor()
    return x.sign() * (whole + (2 * (a - whole)).floor())


def _f16_bytes(v: torch.Tensor) -> torch.Tensor:
    """[blocks, 1] float32 -> [blocks, 2] bytes of its fp16 rounding."""
    return v.to(torch.float16).view(torch.uint8).reshape(-1, 2)


def _inverse(d: torch.Tensor) -> torch.Tensor:
    return torch.where(d == 0, torch.zeros_like(d), 1 / torch.where(d == 0, torch.ones_like(d), d))


def quantize_q8_0(w: torch.Tensor) -> QuantTensor:
    """[rows, cols] (cols a multiple of 32) -> Q8_0: per 32 values d = max |w| / 127, q = round(w / d)."""
    rows, cols = w.shape
    blocks = w.float().reshape(-1, 32)
    d = blocks.abs().amax(dim=1, keepdim=True) / 127
    q = _round_away(blocks * _inverse(d)).to(torch.int8).view(torch.uint8)
    return QuantTensor("Q8_0", rows, cols, torch.cat((_f16_bytes(d), q), dim=1).reshape(rows, -1))


def quantize_q4_1(w: torch.Tensor) -> QuantTensor:
    """[rows, cols] (cols a multiple of 32) -> Q4_1: per 32 values m = min, d = (max - min) / 15."""
    rows, cols = w.shape
    blocks = w.float().reshape(-1, 32)
    hi, lo = blocks.amax(dim=1, keepdim=True), blocks.amin(dim=1, keepdim=True)
    d = (hi - lo) / 15
    q = ((blocks - lo) * _inverse(d) + 0.5).trunc().to(torch.uint8).clamp(0, 15)
    packed = q[:, :16] | (q[:, 16:] << 4)
    return QuantTensor("Q4_1", rows, cols, torch.cat((_f16_bytes(d), _f16_bytes(lo), packed), dim=1).reshape(rows, -1))


# Random blocks: uniform bytes with drawn fp16 scales, so that values are ~1/sqrt(cols) in magnitude (x @ W^T of a
# unit-normal x is O(1)). The integers' scale per type (the largest |q| times the sub-block scale's): d is drawn in
# [0.5, 1] / (that * sqrt(cols)); Q4_1's m and Q4_K's dmin center the values.
_INT_RANGE = {"Q4_1": 16, "Q5_0": 16, "Q8_0": 128, "Q4_K": 16 * 63, "Q6_K": 32 * 128}


def random_quant(kind: str, rows: int, cols: int, generator: torch.Generator | None = None) -> QuantTensor:
    t = TYPES[kind]
    nblocks = rows * cols // t.block_elems
    blk = torch.randint(0, 256, (nblocks, t.block_bytes), dtype=torch.uint8, generator=generator)
    d = (torch.rand(nblocks, 1, generator=generator) * 0.5 + 0.5) / (_INT_RANGE[kind] * cols**0.5)
    offset = {"Q4_1": 0, "Q5_0": 0, "Q8_0": 0, "Q4_K": 0, "Q6_K": 208}[kind]
    blk[:, offset:offset + 2] = _f16_bytes(d)
    if kind == "Q4_1":  # m: about -7.5 d
        blk[:, 2:4] = _f16_bytes(-d * (torch.rand(nblocks, 1, generator=generator) * 3 + 6))
    if kind == "Q4_K":  # dmin * min about d * scale * 7.5
        blk[:, 2:4] = _f16_bytes(d * (torch.rand(nblocks, 1, generator=generator) * 3 + 6))
    return QuantTensor(kind, rows, cols, blk.reshape(rows, -1))
