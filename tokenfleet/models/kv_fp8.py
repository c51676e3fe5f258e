"""FP8 (e4m3) KV cache with one fp32 scale per token and KV head (registry ``kv_cache_dtype: fp8``).

Layout: a cache is a uint8 tensor ``[kv_heads, num_blocks, block_size, head_dim + 16]``: each token's head row is
its ``head_dim`` e4m3 values, the 4 bytes of its fp32 scale (``amax / 448`` of that row), then 12 zero bytes that
keep every row 16-byte aligned (Triton loads a row in 16-byte vectors only when its strides are multiples of 16;
with rows of ``head_dim + 4`` bytes an H200's 8B-geometry decode step with the FP8 cache took 1.16x the bf16
cache's at batch 1 and 1.70x at 256, with aligned rows 1.09x and 1.15x: benchmarks/reports/
2026-11-26-h200-gpu-data-plane.md). The first three dimensions are those of a 16-bit cache, so whatever moves whole
blocks (copy-on-write, KV transfer between replicas, the second KV tier, CUDA-graph scratch blocks) moves the
scales with the values and needs no change; a row takes ``head_dim + 16`` bytes instead of ``2 * head_dim``
(1.6x the tokens at head_dim 64, 1.78x at 128). Since ``head_dim`` is a multiple of 16, the same memory viewed
as fp32 holds each scale at column ``head_dim // 4`` (what the kernels read).

Per-token scales follow each key's own magnitude (Llama keys have outlier channels that a per-tensor scale would
clip or starve); a row's values round to nearest even at 3 mantissa bits. Readers dequantize in fp32: the torch
reference (``models.attention``) and the Triton kernels (``models.triton_attention``, ``models.triton_ops``), which
keep the scale out of the dot products (an e4m3 value is exact in bf16) and apply it per key.
"""

from __future__ import annotations

import torch

FP8_MAX = 448.0  # the largest finite e4m3 (float8_e4m3fn) value
SCALE_BYTES = 4
ROW_PAD = 16  # the scale and zero padding after a row's values: rows stay 16-byte aligned
MIN_AMAX = 1e-12  # an all-zero row keeps a positive scale (as models.linear's weight and activation scales)
KV_CACHE_DTYPES = ("", "fp8")  # "": the model's dtype


def check_kv_cache_dtype(name: str) -> str:
    if name not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be '' (the model's dtype) or 'fp8', got {name!r}")
    return name


def check_device(kv_cache_dtype: str, device: torch.device) -> None:
    """An FP8 cache on CUDA is read and written by Triton kernels with e4m3 conversions: compute capability 8.9 or
    newer (Ada, Hopper and later). Older GPUs get a clear error at load instead of a kernel failing at the first
    forward."""
    if kv_cache_dtype == "fp8":
        check_fp8_device("an FP8 KV cache", device, "use kv_cache_dtype ''")


def check_fp8_device(what: str, device: torch.device, instead: str) -> None:
    """e4m3 on CUDA (``torch._scaled_mm``, Triton's fp8e4nv conversions) needs compute capability 8.9 or newer."""
    if device.type != "cuda":
        return
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) < (8, 9):
        raise ValueError(f"{what} needs a GPU of compute capability 8.9 or newer (Ada, Hopper); "
                         f"{torch.cuda.get_device_name(device)} is {major}.{minor}: {instead}")


def is_fp8(cache: torch.Tensor) -> bool:
    """A packed FP8 cache (uint8); 16- and 32-bit caches hold their values as they are."""
    return cache.dtype == torch.uint8


def row_width(head_dim: int) -> int:
    """Bytes of one token's head row in a packed cache."""
    if head_dim % ROW_PAD:
        raise ValueError(f"an FP8 KV cache needs head_dim divisible by {ROW_PAD}, got {head_dim}")
    return head_dim + ROW_PAD


def row_bytes(head_dim: int, dtype: torch.dtype, kv_cache_dtype: str) -> int:
    """Bytes one token's K (or V) takes per KV head in a cache of ``kv_cache_dtype`` for a model of ``dtype``."""
    return row_width(head_dim) if check_kv_cache_dtype(kv_cache_dtype) == "fp8" else head_dim * dtype.itemsize


def quantize(x: torch.Tensor) -> torch.Tensor:
    """``[..., head_dim]`` (any float dtype) -> packed rows ``[..., head_dim + 16]`` uint8."""
    x32 = x.float()
    scale = x32.abs().amax(dim=-1, keepdim=True).clamp(min=MIN_AMAX) / FP8_MAX
    values = (x32 / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).view(torch.uint8)
    pad = values.new_zeros(*values.shape[:-1], ROW_PAD - SCALE_BYTES)
    return torch.cat((values, scale.view(torch.uint8), pad), dim=-1)


def dequantize(packed: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Packed rows ``[..., head_dim + 16]`` -> ``[..., head_dim]`` values (computed in fp32, returned in ``dtype``)."""
    head_dim = packed.shape[-1] - ROW_PAD
    values = packed[..., :head_dim].view(torch.float8_e4m3fn).float()
    scale = packed[..., head_dim:head_dim + SCALE_BYTES].contiguous().view(torch.float32)  # [..., 1]
    return (values * scale).to(dtype)


def store(cache: torch.Tensor, slot_mapping: torch.Tensor, x: torch.Tensor) -> None:
    """Write ``x`` [tokens, kv_heads, head_dim] at ``slot_mapping`` (block_id * block_size + offset), quantizing
    for a packed cache."""
    num_kv_heads, num_blocks, block_size, width = cache.shape
    rows = quantize(x) if is_fp8(cache) else x
    cache.view(num_kv_heads, num_blocks * block_size, width).index_copy_(1, slot_mapping, rows.transpose(0, 1))


def gather(cache: torch.Tensor, block_ids: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``[kv_heads, len(block_ids) * block_size, head_dim]``: the blocks' tokens in order, dequantized from a packed
    cache into ``dtype`` (default fp32), else in the cache's dtype (or ``dtype``)."""
    num_kv_heads, _, block_size, width = cache.shape
    rows = cache.index_select(1, block_ids).view(num_kv_heads, -1, width)
    if is_fp8(cache):
        return dequantize(rows, dtype or torch.float32)
    return rows if dtype is None else rows.to(dtype)
