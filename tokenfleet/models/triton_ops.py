"""The decoder layer's element-wise steps as Triton kernels (CUDA): one launch each instead of 2-14 torch ops.

A decode step of a small model is bound by how many kernels it runs, not by what they compute: the
torch versions of a layer's norms, RoPE + KV write and SwiGLU launch ~35 kernels, each a few
microseconds even inside a CUDA graph, against 5 for the matmuls and attention. These kernels
round where torch rounds (a bf16 sum or product is rounded to bf16 before the next operation,
statistics in fp32), so they agree with ``TorchLayerOps`` to the last bit in most elements and to
one bf16 ulp elsewhere (summation order).

Also the per-token FP8 quantization of activations for ``models.linear.Fp8Linear`` (one kernel for
amax, scale and cast).

Tested against the torch versions through Triton's interpreter on CPU (tests/unit/models/test_triton_ops.py)
and on CUDA in tests/gpu.
"""

from __future__ import annotations

import torch

from tokenfleet import envs
from tokenfleet.models import kv_fp8
from tokenfleet.models.attention import ForwardBatch
from tokenfleet.models.config import ModelConfig

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - the torch versions serve
    triton = None


def available() -> bool:
    return triton is not None


def _interpreted() -> bool:
    return envs.triton_interpret()


def pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


if triton is not None:
    @triton.jit
    def _add_rms_norm_kernel(res_ptr, delta_ptr, w_ptr, out_ptr, hidden, eps, HAS_DELTA: tl.constexpr,
                             BLOCK: tl.constexpr):
        row = tl.program_id(0)
        cols = tl.arange(0, BLOCK)
        ok = cols < hidden
        x = tl.load(res_ptr + row * hidden + cols, mask=ok, other=0.0)
        if HAS_DELTA:
            d = tl.load(delta_ptr + row * hidden + cols, mask=ok, other=0.0)
            x = (x.to(tl.float32) + d.to(tl.float32)).to(res_ptr.dtype.element_ty)  # torch rounds the sum
            tl.store(res_ptr + row * hidden + cols, x, mask=ok)
        x32 = x.to(tl.float32)
        inv = 1.0 / tl.sqrt(tl.sum(x32 * x32, axis=0) / hidden + eps)
        normed = (x32 * inv).to(res_ptr.dtype.element_ty)  # HF: cast back, then scale
        w = tl.load(w_ptr + cols, mask=ok, other=0.0)
        tl.store(out_ptr + row * hidden + cols, (w.to(tl.float32) * normed.to(tl.float32)).to(out_ptr.dtype.element_ty),
                 mask=ok)

    @triton.jit
    def _rope_store_kv_kernel(qkv_ptr, pos_ptr, cos_ptr, sin_ptr, slot_ptr, q_ptr, k_ptr, k_cache_ptr, v_cache_ptr,
                              ks_ptr, vs_ptr, stride_qkv, stride_cache_head, NUM_HEADS: tl.constexpr,
                              NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, HEADS_PAD: tl.constexpr,
                              FP8_KV: tl.constexpr, ROW: tl.constexpr):
        """FP8_KV: the caches hold packed rows of ROW bytes (models.kv_fp8); each K and V head row is quantized with its own
        scale, written through ``ks_ptr``/``vs_ptr`` (the caches viewed as fp32) after the row's bytes."""
        t = tl.program_id(0)
        half: tl.constexpr = HEAD_DIM // 2
        d = tl.arange(0, HEAD_DIM)
        h = tl.arange(0, HEADS_PAD)
        pos = tl.load(pos_ptr + t)
        slot = tl.load(slot_ptr + t)
        cos = tl.load(cos_ptr + pos * HEAD_DIM + d).to(tl.float32)[None, :]
        sin = tl.load(sin_ptr + pos * HEAD_DIM + d).to(tl.float32)[None, :]
        partner = (d + half) % HEAD_DIM  # rotate_half: [-x2, x1]
        sign = tl.where(d < half, -1.0, 1.0)[None, :]
        dtype = q_ptr.dtype.element_ty
        row = qkv_ptr + t * stride_qkv
        # q heads
        q_ok = (h < NUM_HEADS)[:, None]
        x = tl.load(row + h[:, None] * HEAD_DIM + d[None, :], mask=q_ok, other=0.0).to(tl.float32)
        xr = tl.load(row + h[:, None] * HEAD_DIM + partner[None, :], mask=q_ok, other=0.0).to(tl.float32) * sign
        q = ((x * cos).to(dtype).to(tl.float32) + (xr * sin).to(dtype).to(tl.float32)).to(dtype)
        tl.store(q_ptr + t * NUM_HEADS * HEAD_DIM + h[:, None] * HEAD_DIM + d[None, :], q, mask=q_ok)
        # k heads: rotated, to the cache slot and to k; v: to the cache slot
        kv_ok = (h < NUM_KV_HEADS)[:, None]
        k_base = row + NUM_HEADS * HEAD_DIM
        x = tl.load(k_base + h[:, None] * HEAD_DIM + d[None, :], mask=kv_ok, other=0.0).to(tl.float32)
        xr = tl.load(k_base + h[:, None] * HEAD_DIM + partner[None, :], mask=kv_ok, other=0.0).to(tl.float32) * sign
        k = ((x * cos).to(dtype).to(tl.float32) + (xr * sin).to(dtype).to(tl.float32)).to(dtype)
        tl.store(k_ptr + t * NUM_KV_HEADS * HEAD_DIM + h[:, None] * HEAD_DIM + d[None, :], k, mask=kv_ok)
        v = tl.load(k_base + NUM_KV_HEADS * HEAD_DIM + h[:, None] * HEAD_DIM + d[None, :], mask=kv_ok, other=0.0)
        if FP8_KV:
            row_at = h.to(tl.int64) * stride_cache_head + slot * ROW  # [HEADS_PAD]: each row's first byte
            _store_fp8_rows(k_cache_ptr, ks_ptr, row_at, k.to(tl.float32), d, h < NUM_KV_HEADS, HEAD_DIM)
            _store_fp8_rows(v_cache_ptr, vs_ptr, row_at, v.to(tl.float32), d, h < NUM_KV_HEADS, HEAD_DIM)
        else:
            cache_at = h[:, None] * stride_cache_head + slot * HEAD_DIM + d[None, :]
            tl.store(k_cache_ptr + cache_at, k.to(k_cache_ptr.dtype.element_ty), mask=kv_ok)
            tl.store(v_cache_ptr + cache_at, v.to(v_cache_ptr.dtype.element_ty), mask=kv_ok)

    @triton.jit
    def _store_fp8_rows(cache_ptr, scale_ptr, row_at, x, d, head_ok, HEAD_DIM: tl.constexpr):
        """models.kv_fp8.quantize of [heads, HEAD_DIM] fp32 rows: e4m3 of x / (amax / 448) at ``row_at``, the scale
        and 12 zero bytes (kv_fp8.ROW_PAD) after each row."""
        # IEEE divisions (div_rn; '/' may compile to an approximate one), so the bytes are kv_fp8.quantize's
        scale = tl.math.div_rn(tl.maximum(tl.max(tl.abs(x), axis=1), 1e-12), 448.0)
        values = tl.minimum(tl.maximum(tl.math.div_rn(x, scale[:, None]), -448.0), 448.0)
        tl.store(cache_ptr + row_at[:, None] + d[None, :], values.to(tl.float8e4nv).to(tl.uint8, bitcast=True),
                 mask=head_ok[:, None])
        pad = tl.arange(0, 4)  # the row's last 16 bytes as 4 fp32 words: the scale, then zeros
        tl.store(scale_ptr + ((row_at + HEAD_DIM) // 4)[:, None] + pad[None, :],
                 tl.where(pad[None, :] == 0, scale[:, None], 0.0), mask=head_ok[:, None])

    @triton.jit
    def _silu_mul_kernel(gu_ptr, out_ptr, inter, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        ok = cols < inter
        g = tl.load(gu_ptr + row * 2 * inter + cols, mask=ok, other=0.0).to(tl.float32)
        u = tl.load(gu_ptr + row * 2 * inter + inter + cols, mask=ok, other=0.0).to(tl.float32)
        dtype = out_ptr.dtype.element_ty
        silu = (g / (1.0 + tl.exp(-g))).to(dtype).to(tl.float32)  # torch rounds silu's output, then the product
        tl.store(out_ptr + row * inter + cols, (silu * u).to(dtype), mask=ok)

    @triton.jit
    def _quantize_fp8_kernel(x_ptr, out_ptr, scale_ptr, cols, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        offs = tl.arange(0, BLOCK)
        ok = offs < cols
        x = tl.load(x_ptr + row * cols + offs, mask=ok, other=0.0).to(tl.float32)
        scale = tl.maximum(tl.max(tl.abs(x), axis=0), 1e-12) / 448.0
        tl.store(scale_ptr + row, scale)
        q = tl.minimum(tl.maximum(x / scale, -448.0), 448.0)
        tl.store(out_ptr + row * cols + offs, q.to(out_ptr.dtype.element_ty), mask=ok)


class TritonLayerOps:
    """``LayerOps`` on CUDA (contiguous activations, what the linear layers return)."""

    def __init__(self, config: ModelConfig):
        self.config = config

    def add_rms_norm(self, residual: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        residual = residual.contiguous()
        out = torch.empty_like(residual)
        rows, hidden = residual.shape
        if rows:
            _add_rms_norm_kernel[(rows,)](residual, delta.contiguous() if delta is not None else residual, weight, out,
                                          hidden, eps, HAS_DELTA=delta is not None, BLOCK=pow2(hidden))
        return residual, out

    def rope_store_kv(self, qkv: torch.Tensor, batch: ForwardBatch, cos: torch.Tensor, sin: torch.Tensor,
                      k_cache: torch.Tensor, v_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        cfg = self.config
        qkv = qkv.contiguous()
        tokens = qkv.shape[0]
        q = qkv.new_empty(tokens, cfg.num_heads, cfg.head_dim)
        k = qkv.new_empty(tokens, cfg.num_kv_heads, cfg.head_dim)
        fp8 = kv_fp8.is_fp8(k_cache)
        k_scales, v_scales = (k_cache.view(torch.float32), v_cache.view(torch.float32)) if fp8 else (k_cache, v_cache)
        if tokens:
            _rope_store_kv_kernel[(tokens,)](
                qkv, batch.positions, cos, sin, batch.slot_mapping, q, k, k_cache, v_cache, k_scales, v_scales,
                qkv.stride(0), k_cache.stride(0), NUM_HEADS=cfg.num_heads, NUM_KV_HEADS=cfg.num_kv_heads,
                HEAD_DIM=cfg.head_dim, HEADS_PAD=pow2(max(cfg.num_heads, cfg.num_kv_heads)), FP8_KV=fp8,
                ROW=k_cache.shape[-1])
        v = qkv[:, (cfg.num_heads + cfg.num_kv_heads) * cfg.head_dim:].view(tokens, cfg.num_kv_heads, cfg.head_dim)
        return q, k, v

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate_up = gate_up.contiguous()
        rows, width = gate_up.shape
        inter = width // 2
        out = gate_up.new_empty(rows, inter)
        block = min(pow2(inter), 2048)
        if rows:
            _silu_mul_kernel[(rows, -(-inter // block))](gate_up, out, inter, BLOCK=block)
        return out


def quantize_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """As ``models.linear.quantize_fp8`` (rows as e4m3, one fp32 scale per row), in one kernel."""
    x = x.contiguous()
    rows, cols = x.shape
    out = torch.empty(rows, cols, dtype=torch.float8_e4m3fn, device=x.device)
    scale = torch.empty(rows, 1, dtype=torch.float32, device=x.device)
    if rows:
        block = pow2(cols)  # a row per program, in one piece (hidden sizes: up to ~30k)
        _quantize_fp8_kernel[(rows,)](x, out, scale, cols, BLOCK=block, num_warps=16 if block >= 8192 else 4)
    return out, scale
