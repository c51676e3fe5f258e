"""Paged attention over a flattened mixed batch (decode tokens first, then prefill chunks).

Layout of one forward's tokens:

    [ d_0 d_1 ... d_{D-1} | p0_0 ... p0_{n0-1} | p1_0 ... | ... ]
      one token per         prefill chunk of      next chunk
      decoding request      request 0

KV cache layout per layer: [kv_heads, num_blocks, block_size, head_dim]. Gathering a
request's context is then one ``index_select`` of whole blocks (contiguous 2 KB runs), and
the gathered [kv_heads, D, L, head_dim] tensor feeds the batched matmuls with no permute
copy. Measured on the 2-core CPU for 32 decodes at L=320, one layer, bf16
(benchmarks/attention_impls.py): token-major [slots, kv_heads, head_dim] gather + permute
2.4-3.2 ms; this layout 1.2-1.5 ms; CPU SDPA with q_len=1 7.7 ms; fp32 upcast 5-6 ms.

- decode tokens: all decoding requests in one pair of batched matmuls over the padded
  gathered context with an additive mask; GQA by viewing query heads as [kv_heads, group],
  so K/V are never repeated. Softmax in fp32.
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
    context_block_ids: torch.Tensor | None  # [num_context_blocks]; None when there is no earlier context


@dataclass
class ForwardBatch:
    """Everything a forward needs besides token ids; built once per step by the model runner."""

    positions: torch.Tensor  # [num_tokens] long
    slot_mapping: torch.Tensor  # [num_tokens] long: block_id * block_size + offset of each token's K/V
    logits_indices: torch.Tensor  # [num_logits] long: batch rows whose logits are sampled
    num_decode: int = 0
    decode_block_ids: torch.Tensor | None = None  # [num_decode * max_blocks] long, padded with block 0
    decode_bias: torch.Tensor | None = None  # [1, num_decode, 1, max_blocks * block_size] 0 or -inf
    prefills: list[PrefillSpan] = field(default_factory=list)


def paged_attention(
    q: torch.Tensor,  # [num_tokens, heads, head_dim]
    k: torch.Tensor,  # [num_tokens, kv_heads, head_dim]
    v: torch.Tensor,  # [num_tokens, kv_heads, head_dim]
    k_cache: torch.Tensor,  # [kv_heads, num_blocks, block_size, head_dim]
    v_cache: torch.Tensor,  # [kv_heads, num_blocks, block_size, head_dim]
    batch: ForwardBatch,
) -> torch.Tensor:
    """Write k/v into the cache at ``batch.slot_mapping``, then attend. Returns [num_tokens, heads * head_dim]."""
    num_kv_heads, num_blocks, block_size, head_dim = k_cache.shape
    k_cache.view(num_kv_heads, num_blocks * block_size, head_dim).index_copy_(1, batch.slot_mapping, k.transpose(0, 1))
    v_cache.view(num_kv_heads, num_blocks * block_size, head_dim).index_copy_(1, batch.slot_mapping, v.transpose(0, 1))
    num_tokens, num_heads, _ = q.shape
    out = torch.empty_like(q)
    if batch.num_decode:
        d = batch.num_decode
        out[:d] = _decode_attention(q[:d], k_cache, v_cache, batch)
    for span in batch.prefills:
        rows = slice(span.start, span.start + span.num_tokens)
        if span.context_block_ids is None:  # no earlier context: attend to the chunk's own K/V
            out[rows] = _prefill_attention(q[rows], k[rows].transpose(0, 1), v[rows].transpose(0, 1), 0)
        else:
            ctx_k = _gather(k_cache, span.context_block_ids)[:, : span.context_len]
            ctx_v = _gather(v_cache, span.context_block_ids)[:, : span.context_len]
            out[rows] = _prefill_attention(q[rows], ctx_k, ctx_v, span.context_len - span.num_tokens)
    return out.view(num_tokens, num_heads * head_dim)


def _gather(cache: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
    """[kv_heads, len(block_ids) * block_size, head_dim]: the blocks' tokens in order."""
    num_kv_heads, _, block_size, head_dim = cache.shape
    return cache.index_select(1, block_ids).view(num_kv_heads, -1, head_dim)


def _decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
    if batch.decode_block_ids is None or batch.decode_bias is None:
        raise ValueError("decode tokens scheduled without decode metadata")
    d, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[0]
    group = num_heads // num_kv_heads
    keys = _gather(k_cache, batch.decode_block_ids).view(num_kv_heads, d, -1, head_dim)  # [kvh, D, L, hd]
    values = _gather(v_cache, batch.decode_block_ids).view(num_kv_heads, d, -1, head_dim)
    qh = q.view(d, num_kv_heads, group, head_dim).transpose(0, 1)  # [kvh, D, group, hd]
    scores = torch.matmul(qh, keys.transpose(-1, -2)).float() * (head_dim**-0.5) + batch.decode_bias
    probs = torch.softmax(scores, dim=-1).to(values.dtype)  # [kvh, D, group, L]
    return torch.matmul(probs, values).transpose(0, 1).reshape(d, num_heads, head_dim)


def _prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal_offset: int) -> torch.Tensor:
    """q: [n, heads, hd]; k, v: [kv_heads, L, hd] with L = causal_offset + n. Query i sees keys <= offset + i."""
    n, num_heads, head_dim = q.shape
    num_kv_heads, length, _ = k.shape
    qt = q.transpose(0, 1).unsqueeze(0)  # [1, heads, n, hd]
    kt, vt = k.unsqueeze(0), v.unsqueeze(0)  # [1, kv_heads, L, hd]
    gqa = num_heads != num_kv_heads
    if causal_offset == 0:
        o = F.scaled_dot_product_attention(qt, kt, vt, is_causal=True, enable_gqa=gqa)
    else:
        key_pos = torch.arange(length, device=q.device)
        query_pos = torch.arange(n, device=q.device) + causal_offset
        mask = key_pos[None, :] <= query_pos[:, None]  # [n, L]
        o = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask, enable_gqa=gqa)
    return o.squeeze(0).transpose(0, 1)  # [n, heads, hd]
