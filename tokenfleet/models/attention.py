"""Paged attention over a flattened mixed batch (decode tokens first, then prefill chunks).

Layout of one forward's tokens:

    [ d_0 d_1 ... d_{D-1} | p0_0 ... p0_{n0-1} | p1_0 ... | ... ]
      one token per         prefill chunk of      next chunk
      decoding request      request 0

CPU implementation, chosen by measurement (benchmarks/attention_impls.py):
- decode tokens: gather every decoding request's context from the cache into one padded
  [D, kv_heads, L, head_dim] tensor and run two batched matmuls with an additive mask. One
  op per layer for the whole decode group; GQA is done by viewing the query heads as
  [kv_heads, group] so K/V are never repeated. CPU SDPA with q_len=1 in bf16 was several
  times slower than this in our measurements.
- prefill chunks: one SDPA per request (q_len = chunk length, where SDPA's blocked kernel
  is efficient); a chunk with no earlier context attends to its own fresh K/V, skipping the
  gather.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F


@dataclass
class PrefillSpan:
    """One request's prefill chunk inside the flattened batch."""

    start: int  # index of the chunk's first token in the batch
    num_tokens: int  # chunk length
    context_len: int  # tokens attended to by the chunk's last token (earlier context + chunk)
    context_slots: torch.Tensor | None  # [context_len] cache slots; None when there is no earlier context


@dataclass
class ForwardBatch:
    """Everything a forward needs besides token ids; built once per step by the model runner."""

    positions: torch.Tensor  # [num_tokens] long
    slot_mapping: torch.Tensor  # [num_tokens] long: where each token's K/V is written
    logits_indices: torch.Tensor  # [num_logits] long: batch rows whose logits are sampled
    num_decode: int = 0
    decode_slots: torch.Tensor | None = None  # [num_decode, max_len] long, padded with slot 0
    decode_bias: torch.Tensor | None = None  # [num_decode, 1, 1, max_len] 0 or -inf
    prefills: list[PrefillSpan] = field(default_factory=list)


def paged_attention(
    q: torch.Tensor,  # [num_tokens, heads, head_dim]
    k: torch.Tensor,  # [num_tokens, kv_heads, head_dim]
    v: torch.Tensor,  # [num_tokens, kv_heads, head_dim]
    k_cache: torch.Tensor,  # [num_slots, kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_slots, kv_heads, head_dim]
    batch: ForwardBatch,
) -> torch.Tensor:
    """Write k/v into the cache at ``batch.slot_mapping``, then attend. Returns [num_tokens, heads * head_dim]."""
    k_cache.index_copy_(0, batch.slot_mapping, k)
    v_cache.index_copy_(0, batch.slot_mapping, v)
    num_tokens, num_heads, head_dim = q.shape
    out = torch.empty_like(q)
    if batch.num_decode:
        d = batch.num_decode
        out[:d] = _decode_attention(q[:d], k_cache, v_cache, batch)
    for span in batch.prefills:
        rows = slice(span.start, span.start + span.num_tokens)
        if span.context_slots is None:
            out[rows] = _prefill_attention(q[rows], k[rows], v[rows], causal_offset=0)
        else:
            ctx_k, ctx_v = k_cache[span.context_slots], v_cache[span.context_slots]
            out[rows] = _prefill_attention(q[rows], ctx_k, ctx_v, causal_offset=span.context_len - span.num_tokens)
    return out.view(num_tokens, num_heads * head_dim)


def _decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
    assert batch.decode_slots is not None and batch.decode_bias is not None
    d, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[1]
    group = num_heads // num_kv_heads
    keys = k_cache[batch.decode_slots].permute(0, 2, 3, 1)  # [D, kv_heads, head_dim, L]
    values = v_cache[batch.decode_slots].transpose(1, 2)  # [D, kv_heads, L, head_dim]
    qg = q.view(d, num_kv_heads, group, head_dim)
    scores = torch.matmul(qg, keys).float() * (head_dim**-0.5) + batch.decode_bias  # [D, kv_heads, group, L]
    probs = torch.softmax(scores, dim=-1).to(values.dtype)
    return torch.matmul(probs, values).view(d, num_heads, head_dim)


def _prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal_offset: int) -> torch.Tensor:
    """q: [n, heads, hd]; k, v: [L, kv_heads, hd] with L = causal_offset + n. Query i sees keys <= offset + i."""
    n, num_heads, head_dim = q.shape
    length, num_kv_heads, _ = k.shape
    qt = q.transpose(0, 1).unsqueeze(0)  # [1, heads, n, hd]
    kt = k.transpose(0, 1).unsqueeze(0)  # [1, kv_heads, L, hd]
    vt = v.transpose(0, 1).unsqueeze(0)
    gqa = num_heads != num_kv_heads
    if causal_offset == 0:
        o = F.scaled_dot_product_attention(qt, kt, vt, is_causal=True, enable_gqa=gqa)
    else:
        key_pos = torch.arange(length, device=q.device)
        query_pos = torch.arange(n, device=q.device) + causal_offset
        mask = key_pos[None, :] <= query_pos[:, None]  # [n, L]
        o = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask, enable_gqa=gqa)
    return o.squeeze(0).transpose(0, 1)  # [n, heads, hd]
