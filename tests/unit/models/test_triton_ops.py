"""Triton layer ops (norms, RoPE + KV write, SwiGLU, FP8 activation quantization) against the torch versions.

Without CUDA they run in Triton's interpreter (tests/conftest.py); on a GPU, on the GPU."""

from __future__ import annotations

import pytest
import torch

from tokenfleet.models import triton_ops
from tokenfleet.models.attention import ForwardBatch
from tokenfleet.models.config import ModelConfig
from tokenfleet.models.layer_ops import TorchLayerOps
from tokenfleet.models.linear import quantize_fp8

pytestmark = pytest.mark.skipif(not triton_ops.available(), reason="triton is not installed")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
CONFIG = ModelConfig.from_dict(dict(vocab_size=128, hidden_size=96, intermediate_size=80, num_hidden_layers=1,
                                    num_attention_heads=6, num_key_value_heads=2, head_dim=32,
                                    max_position_embeddings=64))
DTYPES = [torch.float32, torch.bfloat16]
IDS = ["fp32", "bf16"]


def close(out: torch.Tensor, ref: torch.Tensor, exact_share: float = 0.99) -> bool:
    """fp32: a few ulps (summation order). bf16: within 2 ulps of the largest value, and on a GPU equal in >= 99 %
    of elements (``exact_share``; the interpreter casts fp32 to bf16 by truncation, not to nearest, so it cannot be bit-exact)."""
    eps = torch.finfo(out.dtype).eps
    within = (out.float() - ref.float()).abs().max() <= (8 if out.dtype == torch.float32 else 2) * eps * ref.float().abs().max()
    if out.dtype == torch.bfloat16 and out.is_cuda:
        return bool(within) and (out == ref).float().mean().item() >= exact_share
    return bool(within)


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
@pytest.mark.parametrize("with_delta", [True, False])
def test_add_rms_norm(dtype, with_delta):
    g = torch.Generator().manual_seed(1)
    residual = torch.randn(7, 96, generator=g).to(DEVICE, dtype)
    delta = torch.randn(7, 96, generator=g).to(DEVICE, dtype) if with_delta else None
    weight = (1 + 0.1 * torch.randn(96, generator=g)).to(DEVICE, dtype)
    ref_res, ref = TorchLayerOps(CONFIG).add_rms_norm(residual.clone(), delta, weight, 1e-5)
    res, out = triton_ops.TritonLayerOps(CONFIG).add_rms_norm(residual.clone(), delta, weight, 1e-5)
    assert close(res, ref_res) and close(out, ref)


def rope_inputs(dtype: torch.dtype, magnitude: float = 1.0):
    """CONFIG's fused projection for 5 tokens at scattered positions and cache slots (6 blocks of 4), with the
    RoPE tables: (qkv, batch, cos, sin)."""
    g = torch.Generator().manual_seed(2)
    head_dim = CONFIG.head_dim
    qkv = (torch.randn(5, (CONFIG.num_heads + 2 * CONFIG.num_kv_heads) * head_dim, generator=g) * magnitude).to(DEVICE, dtype)
    positions = torch.tensor([0, 3, 17, 40, 63], device=DEVICE)
    slots = torch.tensor([5, 0, 23, 9, 14], device=DEVICE)
    angles = torch.arange(64)[:, None] * (1.0 / 10000 ** (torch.arange(0, head_dim, 2) / head_dim))[None, :]
    emb = torch.cat([angles, angles], dim=-1)
    cos, sin = emb.cos().to(DEVICE, dtype), emb.sin().to(DEVICE, dtype)
    return qkv, ForwardBatch(positions=positions, slot_mapping=slots, logits_indices=positions[:1]), cos, sin


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_rope_store_kv(dtype):
    kv_heads, head_dim, blocks, block_size = 2, 32, 6, 4
    qkv, batch, cos, sin = rope_inputs(dtype)
    caches = [torch.full((kv_heads, blocks, block_size, head_dim), 7.0, dtype=dtype, device=DEVICE) for _ in range(4)]
    q_ref, k_ref, v_ref = TorchLayerOps(CONFIG).rope_store_kv(qkv, batch, cos, sin, caches[0], caches[1])
    q, k, v = triton_ops.TritonLayerOps(CONFIG).rope_store_kv(qkv, batch, cos, sin, caches[2], caches[3])
    assert torch.equal(v, v_ref)
    # (RoPE's x * cos + rotated * sin: the compiler may contract it into one rounding where torch rounds three times,
    # so on a GPU it is held to the tolerance only)
    assert close(q, q_ref, exact_share=0) and close(k, k_ref, exact_share=0)
    assert close(caches[2], caches[0], exact_share=0) and torch.equal(caches[3], caches[1])  # other slots untouched


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_silu_mul(dtype):
    gate_up = torch.randn(4, 2 * 80, generator=torch.Generator().manual_seed(3)).to(DEVICE, dtype) * 3
    ref = TorchLayerOps(CONFIG).silu_mul(gate_up)
    out = triton_ops.TritonLayerOps(CONFIG).silu_mul(gate_up)
    assert close(out, ref)


def test_fp8_quantization_matches_the_torch_version():
    x = torch.randn(3, 5000, generator=torch.Generator().manual_seed(4)).to(DEVICE, torch.bfloat16) * 5
    x[1] = 0  # an all-zero row keeps a finite scale
    ref_q, ref_scale = quantize_fp8(x)
    q, scale = triton_ops.quantize_fp8(x)
    assert torch.allclose(scale, ref_scale, rtol=1e-6)
    within = (q.float() - ref_q.float()).abs() <= ref_q.float().abs() / 8 + 2**-9  # one e4m3 step
    if x.is_cuda:
        assert within.all() and (q.float() == ref_q.float()).float().mean() > 0.999
    else:  # the interpreter's fp8 cast is not the hardware's (it halves values just under a power of two)
        assert within.float().mean() > 0.9
    assert torch.equal(q[1].float(), torch.zeros(5000, device=DEVICE))
