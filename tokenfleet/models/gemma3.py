"""Gemma 3 (text) over the paged KV cache, on the same linear, attention and KV interfaces as Llama.

What differs from Llama: the embedding is scaled by sqrt(hidden); RMSNorm multiplies by (1 + weight),
in fp32; q and k are RMS-normed per head before RoPE (QK-norm); each sublayer's output is normed
before it joins the residual (post-attention, post-feed-forward norms) besides the pre-norms; the MLP
is GeGLU (tanh-approximated GELU of the gate times up); sliding-window layers use a local RoPE base
(10k) and global layers the long one (1M). Sliding-window layers attend to the last ``sliding_window``
keys: their KV lives in its own groups of the paged cache (``ModelConfig.kv_groups``), whose block
tables keep only the blocks the window reaches, and the attention masks the rest.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from tokenfleet.engine.runner import KernelCheck
from tokenfleet.models import kv_fp8
from tokenfleet.models.attention import ForwardBatch, PagedAttention, paged_attention
from tokenfleet.models.config import ModelConfig
from tokenfleet.models.ggml_quant import QuantTensor
from tokenfleet.models.layer_ops import apply_rope
from tokenfleet.models.linear import LinearKernel
from tokenfleet.models.llama import KVCache, embed_rows, refine_exact_logits


@dataclass
class Gemma3LayerWeights:
    input_norm: torch.Tensor  # (1 + weight), fp32, [hidden]
    qkv: torch.Tensor
    q_norm: torch.Tensor  # (1 + weight), fp32, [head_dim]
    k_norm: torch.Tensor
    o_proj: torch.Tensor
    post_attention_norm: torch.Tensor
    pre_feedforward_norm: torch.Tensor
    post_feedforward_norm: torch.Tensor
    gate_up: torch.Tensor
    down: torch.Tensor
    sliding: bool


@dataclass
class Gemma3Weights:
    embed: torch.Tensor | QuantTensor  # [vocab, hidden] (a GGUF's: quantized)
    layers: list[Gemma3LayerWeights]
    norm: torch.Tensor  # (1 + weight), fp32
    lm_head: Any  # prepared for the linear kernel (tied: the embedding)
    lm_head_rows: torch.Tensor | None = None  # lm_head as plain rows: refine_top_logits


def gemma_rms_norm(x: torch.Tensor, scale: torch.Tensor, eps: float) -> torch.Tensor:
    """HF's Gemma3RMSNorm: statistics and the (1 + weight) scale in fp32, then back to x's dtype."""
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps) * scale).to(x.dtype)


def _rope_table(theta: float, head_dim: int, max_positions: int, dtype: torch.dtype, device: torch.device
                ) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    freqs = torch.arange(max_positions, dtype=torch.float32)[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype=dtype, device=device), emb.sin().to(dtype=dtype, device=device)


class Gemma3Model:
    def __init__(self, config: ModelConfig, weights: Gemma3Weights, dtype: torch.dtype, device: torch.device,
                 linear: LinearKernel, attention: PagedAttention):
        self.config, self.weights, self.dtype, self.device = config, weights, dtype, device
        self.linear, self.attention = linear, attention
        self.kv_cache_dtype = ""  # as LlamaModel.kv_cache_dtype
        self.kernel_checks: tuple[KernelCheck, ...] = ()  # as LlamaModel.kernel_checks
        n = config.max_position_embeddings
        self.rope_global = _rope_table(config.rope_theta, config.head_dim, n, dtype, device)
        self.rope_local = _rope_table(config.rope_local_theta, config.head_dim, n, dtype, device)
        self.embed_scale = torch.tensor(config.hidden_size ** 0.5, dtype=dtype)

    def _attention(self, x: torch.Tensor, layer: Gemma3LayerWeights, batch: ForwardBatch, k_cache: torch.Tensor,
                   v_cache: torch.Tensor) -> torch.Tensor:
        cfg = self.config
        q_size, kv_size = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        q, k, v = self.linear(x, layer.qkv).split([q_size, kv_size, kv_size], dim=-1)
        q = gemma_rms_norm(q.reshape(-1, cfg.num_heads, cfg.head_dim), layer.q_norm, cfg.rms_norm_eps)
        k = gemma_rms_norm(k.reshape(-1, cfg.num_kv_heads, cfg.head_dim), layer.k_norm, cfg.rms_norm_eps)
        v = v.reshape(-1, cfg.num_kv_heads, cfg.head_dim)
        cos, sin = self.rope_local if layer.sliding else self.rope_global
        cos_t, sin_t = cos[batch.positions].unsqueeze(1), sin[batch.positions].unsqueeze(1)
        q, k = apply_rope(q, cos_t, sin_t), apply_rope(k, cos_t, sin_t)
        kv_fp8.store(k_cache, batch.slot_mapping, k)
        kv_fp8.store(v_cache, batch.slot_mapping, v)
        return self.linear(paged_attention(q, k, v, k_cache, v_cache, batch, self.attention), layer.o_proj)

    @torch.inference_mode()
    def forward(self, token_ids: torch.Tensor, batch: ForwardBatch, kv: KVCache) -> torch.Tensor:
        """As LlamaModel.forward: the flattened batch in, float32 logits of ``batch.logits_indices`` out."""
        w, linear, eps = self.weights, self.linear, self.config.rms_norm_eps
        h = embed_rows(token_ids, w.embed, self.dtype) * self.embed_scale
        for i, layer in enumerate(w.layers):
            group, slot = kv.layer_slots[i]
            attn = self._attention(gemma_rms_norm(h, layer.input_norm, eps), layer, batch.group(group), kv.k[slot],
                                   kv.v[slot])
            h = h + gemma_rms_norm(attn, layer.post_attention_norm, eps)
            gate, up = linear(gemma_rms_norm(h, layer.pre_feedforward_norm, eps), layer.gate_up).chunk(2, dim=-1)
            mlp = linear(F.gelu(gate, approximate="tanh") * up, layer.down)
            h = h + gemma_rms_norm(mlp, layer.post_feedforward_norm, eps)
        last = gemma_rms_norm(h[batch.logits_indices], w.norm, eps)
        return refine_exact_logits(linear(last, w.lm_head).float(), last, batch, w.lm_head_rows)  # as Llama's
