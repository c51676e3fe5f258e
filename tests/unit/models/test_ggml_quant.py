"""GGML block types in torch (models.ggml_quant) against gguf-py's numpy reference: dequantization bitwise equal in
fp32 on random blocks (uniform random bytes, fp16 scales drawn over several decades, both signs), embedding rows,
and the Q8_0 / Q4_1 quantizers byte for byte."""

from __future__ import annotations

import pytest
import torch

from tokenfleet.models.ggml_quant import (
    TYPES,
    QuantTensor,
    dequantize,
    embedding,
    quantize_q4_1,
    quantize_q8_0,
    random_quant,
)

gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType  # noqa: E402

FP16_FIELDS = {"Q4_1": (0, 2), "Q5_0": (0,), "Q8_0": (0,), "Q4_K": (0, 2), "Q6_K": (208,)}  # byte offsets in a block
SHAPES = {32: [(1, 32), (3, 96), (17, 576), (5, 1536)], 256: [(1, 256), (3, 512), (7, 1536), (2, 2304)]}


def random_blocks(kind: str, rows: int, cols: int, g: torch.Generator) -> QuantTensor:
    """Uniform random bytes; every fp16 field a value of either sign between 1e-4 and 10."""
    t = TYPES[kind]
    blocks = torch.randint(0, 256, (rows * cols // t.block_elems, t.block_bytes), dtype=torch.uint8, generator=g)
    for offset in FP16_FIELDS[kind]:
        magnitude = 10 ** (torch.rand(blocks.shape[0], generator=g) * 5 - 4)
        sign = torch.randint(0, 2, (blocks.shape[0],), generator=g) * 2 - 1
        blocks[:, offset:offset + 2] = (magnitude * sign).to(torch.float16).view(torch.uint8).reshape(-1, 2)
    return QuantTensor(kind, rows, cols, blocks.reshape(rows, -1))


def reference(q: QuantTensor) -> torch.Tensor:
    return torch.from_numpy(gguf.quants.dequantize(q.data.numpy(), GGMLQuantizationType[q.kind]).copy())


@pytest.mark.parametrize("kind", sorted(TYPES))
def test_dequantize_is_bitwise_the_gguf_reference(kind: str) -> None:
    g = torch.Generator().manual_seed(TYPES[kind].type_id)
    for rows, cols in SHAPES[TYPES[kind].block_elems]:
        q = random_blocks(kind, rows, cols, g)
        got, want = dequantize(q), reference(q)
        assert got.dtype == torch.float32 and got.shape == (rows, cols)
        assert torch.equal(got, want), f"{kind} [{rows}, {cols}]: max diff {(got - want).abs().max():g}"
        assert torch.equal(dequantize(q, torch.bfloat16), want.to(torch.bfloat16))


@pytest.mark.parametrize("kind", sorted(TYPES))
def test_random_quant_values_are_about_unit_over_sqrt_cols(kind: str) -> None:
    g = torch.Generator().manual_seed(5)
    q = random_quant(kind, 64, 1536, g)
    values = dequantize(q)
    assert torch.equal(values, reference(q))
    rms = float(values.pow(2).mean().sqrt()) * 1536**0.5
    assert 0.1 < rms < 3.0, f"{kind}: rms * sqrt(cols) = {rms}"


@pytest.mark.parametrize("kind", ["Q8_0", "Q6_K"])
def test_embedding_dequantizes_the_selected_rows(kind: str) -> None:
    g = torch.Generator().manual_seed(3)
    q = random_blocks(kind, 50, 512, g)
    ids = torch.tensor([[4, 0, 49], [4, 7, 7]])
    got = embedding(q, ids, torch.bfloat16)
    assert got.shape == (2, 3, 512) and got.dtype == torch.bfloat16
    assert torch.equal(got, dequantize(q, torch.bfloat16)[ids])


@pytest.mark.parametrize(("kind", "quantize"), [("Q8_0", quantize_q8_0), ("Q4_1", quantize_q4_1)])
def test_quantizers_match_gguf_bytes(kind: str, quantize) -> None:
    g = torch.Generator().manual_seed(9)
    w = torch.randn(13, 320, generator=g) * 0.05
    w[0, :32] = 0  # an all-zero block: d = 0
    w[1, :32] = torch.arange(32) / 31 - 0.5  # values on the rounding midpoints
    q = quantize(w)
    want = gguf.quants.quantize(w.numpy(), GGMLQuantizationType[kind])
    assert q.kind == kind and q.shape == w.shape
    assert torch.equal(q.data, torch.from_numpy(want))
    blocks = w.reshape(-1, 32)
    amax = blocks.abs().amax(1, keepdim=True)
    d = amax / 127 if kind == "Q8_0" else (blocks.amax(1, keepdim=True) - blocks.amin(1, keepdim=True)) / 15
    error = (dequantize(q) - w).reshape(-1, 32).abs()
    assert (error <= 0.55 * d + 1e-3 * amax).all()  # half a step, and the fp16 rounding of d (and m)


def test_quant_tensor_rejects_partial_blocks_and_wrong_bytes() -> None:
    with pytest.raises(ValueError, match="whole blocks"):
        QuantTensor("Q4_K", 2, 300, torch.zeros(2, 144, dtype=torch.uint8))
    with pytest.raises(ValueError, match="data must be"):
        QuantTensor("Q8_0", 2, 64, torch.zeros(2, 64, dtype=torch.uint8))
