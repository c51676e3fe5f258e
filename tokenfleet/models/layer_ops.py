"""The decoder layer's element-wise steps, chosen once per model (like linear and attention kernels).

- ``TorchLayerOps``: plain torch ops; every device and dtype (fp32 is what the exact-equality tests
  against HF run).
- ``NativeLayerOps``: csrc/fused_ops.c for bf16 or fp32 on CPU: one call per step instead of 3-10
  small ops (a 30-layer decode step ran ~1,000 of them, ~5 us each), with the same rounding points.
"""

from __future__ import annotations

import ctypes
from typing import Any, Protocol

import torch
import torch.nn.functional as F

from tokenfleet import envs
from tokenfleet.models import kv_fp8, native
from tokenfleet.models.attention import ForwardBatch
from tokenfleet.models.config import ModelConfig


class LayerOps(Protocol):
    def add_rms_norm(self, residual: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        """(residual + delta, RMSNorm of it); ``residual`` may be updated in place. [tokens, hidden]."""

    def rope_store_kv(self, qkv: torch.Tensor, batch: ForwardBatch, cos: torch.Tensor, sin: torch.Tensor,
                      k_cache: torch.Tensor, v_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Split the fused projection, rotate q and k, write k and v into the caches at ``batch.slot_mapping``.
        Returns q [tokens, heads, head_dim], k and v [tokens, kv_heads, head_dim]."""

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """[tokens, 2 * inter] -> silu(gate) * up [tokens, inter]."""


class TorchLayerOps:
    def __init__(self, config: ModelConfig):
        self.config = config

    def add_rms_norm(self, residual: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        if delta is not None:
            residual = residual + delta
        return residual, rms_norm(residual, weight, eps)

    def rope_store_kv(self, qkv: torch.Tensor, batch: ForwardBatch, cos: torch.Tensor, sin: torch.Tensor,
                      k_cache: torch.Tensor, v_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        cfg = self.config
        q_size, kv_size = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
        cos_t = cos[batch.positions].unsqueeze(1)  # [tokens, 1, head_dim]
        sin_t = sin[batch.positions].unsqueeze(1)
        q = apply_rope(q.view(-1, cfg.num_heads, cfg.head_dim), cos_t, sin_t)
        k = apply_rope(k.view(-1, cfg.num_kv_heads, cfg.head_dim), cos_t, sin_t)
        v = v.view(-1, cfg.num_kv_heads, cfg.head_dim)
        kv_fp8.store(k_cache, batch.slot_mapping, k)
        kv_fp8.store(v_cache, batch.slot_mapping, v)
        return q, k, v

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up


class NativeLayerOps:
    """bf16 or fp32 (``dtype``), CPU, contiguous inputs (what the model's linear layers return)."""

    SUFFIX = {torch.bfloat16: "", torch.float32: "_f32"}  # the C functions for each dtype

    def __init__(self, config: ModelConfig, lib: ctypes.CDLL, dtype: torch.dtype = torch.bfloat16):
        if dtype not in self.SUFFIX:
            raise ValueError(f"the native layer ops run bf16 or fp32, not {dtype}")
        self.config = config
        self.dtype = dtype
        self.name = f"native layer ops (csrc/fused_ops.c{', fp32' if dtype == torch.float32 else ''})"
        suffix = self.SUFFIX[dtype]
        i64, ptr, f32, i32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float, ctypes.c_int
        self._norm = _bind(getattr(lib, "tf_add_rms_norm" + suffix), [ptr] * 4 + [i64, i64, f32, i32])
        # last argument: FP8 rows (models.kv_fp8)
        self._rope = _bind(getattr(lib, "tf_rope_store_kv" + suffix), [ptr] * 9 + [i64] * 5 + [i32, i32])
        self._silu = _bind(getattr(lib, "tf_silu_mul" + suffix), [ptr, ptr, i64, i64, i32])

    def add_rms_norm(self, residual: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        residual = residual.contiguous()
        out = torch.empty_like(residual)
        delta_ptr = delta.contiguous().data_ptr() if delta is not None else None
        self._norm(residual.data_ptr(), delta_ptr, weight.data_ptr(), out.data_ptr(), residual.shape[0],
                   residual.shape[1], eps, torch.get_num_threads())
        return residual, out

    def rope_store_kv(self, qkv: torch.Tensor, batch: ForwardBatch, cos: torch.Tensor, sin: torch.Tensor,
                      k_cache: torch.Tensor, v_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        cfg = self.config
        qkv = qkv.contiguous()
        tokens = qkv.shape[0]
        q = qkv.new_empty(tokens, cfg.num_heads, cfg.head_dim)
        k = qkv.new_empty(tokens, cfg.num_kv_heads, cfg.head_dim)
        num_kv_heads, num_blocks, block_size, _ = k_cache.shape
        self._rope(qkv.data_ptr(), batch.positions.data_ptr(), cos.data_ptr(), sin.data_ptr(),
                   batch.slot_mapping.data_ptr(), q.data_ptr(), k.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(),
                   tokens, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, num_blocks * block_size,
                   torch.get_num_threads(), int(kv_fp8.is_fp8(k_cache)))
        v = qkv[:, (cfg.num_heads + cfg.num_kv_heads) * cfg.head_dim:].view(tokens, cfg.num_kv_heads, cfg.head_dim)
        return q, k, v

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate_up = gate_up.contiguous()
        inter = gate_up.shape[1] // 2
        out = gate_up.new_empty(gate_up.shape[0], inter)
        self._silu(gate_up.data_ptr(), out.data_ptr(), gate_up.shape[0], inter, torch.get_num_threads())
        return out


def select_layer_ops(config: ModelConfig, dtype: torch.dtype, device: torch.device) -> LayerOps:
    """Triton kernels on CUDA (models.triton_ops), the native C kernels on CPU in bf16 or fp32, else torch;
    TOKENFLEET_KERNELS=torch forces torch."""
    choice = envs.kernels()
    if choice == "torch":
        return TorchLayerOps(config)
    pow2_head = config.head_dim & (config.head_dim - 1) == 0
    if (device.type == "cuda" or choice == "triton") and pow2_head and not config.is_gemma3:
        from tokenfleet.models import triton_ops

        if triton_ops.available():
            return triton_ops.TritonLayerOps(config)
    if device.type == "cpu" and dtype in NativeLayerOps.SUFFIX and config.head_dim % 2 == 0:
        lib = native.load("fused_ops")
        if lib is not None:
            return NativeLayerOps(config, lib, dtype)
    return TorchLayerOps(config)


def _bind(fn: Any, argtypes: list) -> Any:
    fn.argtypes = argtypes
    fn.restype = None
    return fn


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # Same order of operations as HF's LlamaRMSNorm (fp32 statistics, cast back, then scale).
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE (HF layout). x: [num_tokens, heads, head_dim]."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
