"""Llama-family decoder (RMSNorm, RoPE incl. llama3 scaling, GQA, SwiGLU) over a paged KV cache.

Plain tensors, no nn.Module: the model runner owns every tensor and calls ``forward`` with
one ``ForwardBatch`` describing the flattened tokens of a mixed prefill/decode batch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from tokenfleet.engine.runner import KernelCheck
from tokenfleet.kvcache.layout import layer_slots
from tokenfleet.models import triton_logits
from tokenfleet.models.attention import ForwardBatch, PagedAttention, paged_attention
from tokenfleet.models.config import ModelConfig, RopeScaling
from tokenfleet.models.ggml_quant import QuantTensor, embedding
from tokenfleet.models.kv_fp8 import check_kv_cache_dtype, row_width
from tokenfleet.models.layer_ops import LayerOps
from tokenfleet.models.linear import LinearKernel


@dataclass
class LayerWeights:
    input_norm: torch.Tensor  # [hidden]
    qkv: torch.Tensor  # [(num_heads + 2 * num_kv_heads) * head_dim, hidden]
    o_proj: torch.Tensor  # [hidden, num_heads * head_dim]
    post_norm: torch.Tensor  # [hidden]
    gate_up: torch.Tensor  # [2 * intermediate, hidden]
    down: torch.Tensor  # [hidden, intermediate]


@dataclass
class LlamaWeights:
    embed: torch.Tensor | QuantTensor  # [vocab, hidden] (a GGUF's: quantized)
    layers: list[LayerWeights]
    norm: torch.Tensor  # [hidden]
    lm_head: Any  # [vocab, hidden] as the linear kernel takes it; the embedding itself when tied (may be packed)
    lm_head_rows: torch.Tensor | None = None  # lm_head as plain rows (the embedding when tied): refine_top_logits


REFINED_LOGITS = 8


def embed_rows(token_ids: torch.Tensor, table: torch.Tensor | QuantTensor, dtype: torch.dtype) -> torch.Tensor:
    """The embedding rows of ``token_ids``: of a tensor, or of a GGUF's quantized table (only those rows
    dequantized, in ``dtype``)."""
    if isinstance(table, QuantTensor):  # its blocks on the step's device (a GPU's), or on the CPU
        ids = token_ids if table.data.device == token_ids.device else token_ids.cpu()
        return embedding(table, ids, dtype).to(token_ids.device)
    return F.embedding(token_ids, table)


def refine_exact_logits(logits: torch.Tensor, last: torch.Tensor, batch: ForwardBatch,
                        lm_head_rows: torch.Tensor | None) -> torch.Tensor:
    """``logits`` with the rows a greedy pick or reported logprobs depend on refined (``refine_top_logits``): those
    ``batch.exact_logits`` lists, or (a CUDA graph's static rows) those ``batch.exact_rows`` flags. fp32 models and
    heads without kept rows need nothing."""
    if last.dtype == torch.float32 or lm_head_rows is None:
        return logits
    which = batch.exact_logits
    if triton_logits.serves(logits, last, lm_head_rows):  # CUDA: 2 kernels in place of ~15 (models.triton_logits)
        if which is not None or batch.exact_rows is not None:
            triton_logits.refine_top_logits_(logits, last, lm_head_rows, REFINED_LOGITS, rows=which, flags=batch.exact_rows)
        return logits
    if which is not None:
        logits[which] = refine_top_logits(logits[which], last[which], lm_head_rows)
    elif batch.exact_rows is not None:
        logits = torch.where(batch.exact_rows[:, None], refine_top_logits(logits, last, lm_head_rows), logits)
    return logits


def refine_top_logits(logits: torch.Tensor, hidden: torch.Tensor, rows: torch.Tensor,
                      k: int = REFINED_LOGITS) -> torch.Tensor:
    """``logits`` with each row's ``k`` largest recomputed in fp32 from the low-precision hidden state.

    A bf16 GEMM rounds its output to bf16: at this model's logits (~16-32) that is a step of 0.125,
    coarser than the margin between the top two tokens at many greedy decisions, which then fall to
    rounding rather than to the model (measured: a haiku and a gravity chat left HF fp32's greedy path
    at margins of 0.07 because of it). The candidates that decide a greedy pick and carry most of the
    sampling mass get their exact dot products; the rest keep the GEMM's values. The top-k search costs
    ~0.05 ms a row here, so the runner asks for it only on rows whose greedy pick or reported logprobs
    depend on it (``ForwardBatch.exact_logits``); temperature-sampled rows keep the GEMM's values.
    """
    top = logits.topk(min(k, logits.shape[-1]), dim=-1).indices  # [rows, k]
    exact = torch.einsum("rh,rkh->rk", hidden.float(), rows[top].float())
    return logits.scatter(1, top, exact)


class KVCache:
    """Preallocated K and V; a token's slot is block_id * block_size + offset.

    A block holds one layer of each KV group (``config.kv_groups``): ``k[i]`` is the i-th layer of
    whichever group the block belongs to. For a model of one group (a Llama) that is layer i.

    ``kv_cache_dtype`` "fp8": packed e4m3 rows with per-token, per-head scales (models.kv_fp8), uint8
    ``[slots, kv_heads, blocks, block_size, head_dim + 16]``; "": values in ``dtype``."""

    def __init__(self, config: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device,
                 kv_cache_dtype: str = ""):
        self.layer_slots = layer_slots(config.layer_windows, config.num_layers)  # layer -> (group, index in k / v)
        fp8 = check_kv_cache_dtype(kv_cache_dtype) == "fp8"
        width = row_width(config.head_dim) if fp8 else config.head_dim
        shape = (len(config.kv_groups[0].layers), config.num_kv_heads, num_blocks, block_size, width)
        dtype = torch.uint8 if fp8 else dtype
        self.k = torch.zeros(shape, dtype=dtype, device=device)  # [slots, kv_heads, blocks, block_size, head_dim]
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.kv_cache_dtype = kv_cache_dtype
        self.head_dim = config.head_dim

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy whole blocks src -> dst in every slot (copy-on-write of shared blocks)."""
        for src, dst in pairs:
            for cache in (self.k, self.v):
                cache[:, :, dst].copy_(cache[:, :, src])


def rope_inv_freq(config: ModelConfig) -> torch.Tensor:
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    if config.rope_scaling.rope_type == "llama3":
        inv_freq = _llama3_scale(inv_freq, config.rope_scaling)
    return inv_freq


def _llama3_scale(inv_freq: torch.Tensor, s: RopeScaling) -> torch.Tensor:
    low_wavelen = s.original_max_position_embeddings / s.low_freq_factor
    high_wavelen = s.original_max_position_embeddings / s.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / s.factor, inv_freq)
    smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (
        s.high_freq_factor - s.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    is_medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class LlamaModel:
    """``weights`` hold matrices already prepared by ``linear`` (see models.linear)."""

    def __init__(
        self, config: ModelConfig, weights: LlamaWeights, dtype: torch.dtype, device: torch.device, linear: LinearKernel,
        attention: PagedAttention, ops: LayerOps,
    ):
        self.config = config
        self.attention = attention
        self.ops = ops
        self.weights = weights
        self.linear = linear
        self.source_dir = ""  # the checkpoint folder it was loaded from (LoRA stacks adapters under its weights)
        self.kv_cache_dtype = ""  # "fp8": its runner keeps an FP8 KV cache (models.kv_fp8); set with the attention
        self.kernel_checks: tuple[KernelCheck, ...] = ()  # how its kernels did against the reference at load
        self.dtype = dtype
        self.device = device
        positions = torch.arange(config.max_position_embeddings, dtype=torch.float32)
        freqs = positions[:, None] * rope_inv_freq(config)[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)  # [max_pos, head_dim]
        self.cos = emb.cos().to(dtype=dtype, device=device)
        self.sin = emb.sin().to(dtype=dtype, device=device)

    @torch.inference_mode()
    def forward(self, token_ids: torch.Tensor, batch: ForwardBatch, kv: KVCache) -> torch.Tensor:
        """Run the flattened batch; write its K/V into ``kv``; return logits of ``batch.logits_indices``.

        token_ids: [num_tokens]. Returns float32 logits [num_logits, vocab].
        """
        cfg, w, linear, ops = self.config, self.weights, self.linear, self.ops
        residual = embed_rows(token_ids, w.embed, self.dtype)  # [num_tokens, hidden]
        delta: torch.Tensor | None = None  # what the previous sublayer adds to the residual stream
        lora = batch.lora
        for i, layer in enumerate(w.layers):
            residual, x = ops.add_rms_norm(residual, delta, layer.input_norm, cfg.rms_norm_eps)
            qkv = linear(x, layer.qkv) if lora is None else lora.project(i, "qkv", x, layer.qkv)
            q, k, v = ops.rope_store_kv(qkv, batch, self.cos, self.sin, kv.k[i], kv.v[i])
            attn = paged_attention(q, k, v, kv.k[i], kv.v[i], batch, self.attention)  # [num_tokens, heads * head_dim]
            o = linear(attn, layer.o_proj) if lora is None else lora.project(i, "o_proj", attn, layer.o_proj)
            residual, x = ops.add_rms_norm(residual, o, layer.post_norm, cfg.rms_norm_eps)
            gate_up = linear(x, layer.gate_up) if lora is None else lora.project(i, "gate_up", x, layer.gate_up)
            hidden = ops.silu_mul(gate_up)
            delta = linear(hidden, layer.down) if lora is None else lora.project(i, "down", hidden, layer.down)
        rows = batch.logits_indices
        _, last = ops.add_rms_norm(residual[rows], None if delta is None else delta[rows], w.norm, cfg.rms_norm_eps)
        return refine_exact_logits(linear(last, w.lm_head).float(), last, batch, w.lm_head_rows)
