"""Paged attention over a flattened mixed batch (paged queries first, then prefill chunks).

Layout of one forward's tokens:

    [ d_0 d_1 ... d_{D-1} | p0_0 ... p0_{n0-1} | p1_0 ... | ... ]
      paged queries: a few    prefill chunk of      next chunk
      per request (decode 1)  request 0

KV cache layout per layer: [kv_heads, num_blocks, block_size, head_dim] in the model's dtype, or packed FP8
rows [kv_heads, num_blocks, block_size, head_dim + 16] (uint8: e4m3 values, an fp32 scale per token and
head, zero padding; models.kv_fp8), which every implementation below reads (the native one with its FP8 variant).

- paged queries (decode; several per request for speculative verification): one attention
  interface, ``PagedAttention``, over block tables and context lengths. Two implementations,
  chosen once per model by ``loader.select_attention``:
  - ``NativePagedAttention`` (CPU, bf16 or fp32): a C kernel (csrc/paged_attention.c) that reads
    each request's blocks where they lie, with scores, softmax and P.V accumulated in fp32.
  - ``TorchPagedAttention`` (the reference, every device and dtype): gathers the requests'
    blocks (padded to the longest) and runs batched matmuls with fp32 scores, softmax and
    accumulation (upcasting the gathered copy, never the cache).
  Rounding scores to bf16 before the softmax (what a bf16 matmul does) moved greedy decoding
  off the fp32 path within a few tokens on short chats; both implementations avoid it.
- prefill chunks: with the native kernel in bf16, in the same call from the cache where this machine runs that
  faster, else one SDPA per chunk (models.prefill_attention measures which: the kernel was 1.6-3.3x SDPA on the
  2-core AMD EPYCs at 256 to 4,096 tokens of context, SDPA 1.3-3.2x the kernel on a 2-core Intel Xeon with AMX;
  benchmarks/prefill_attention.py); with the torch reference and in fp32, one SDPA per request (a chunk with
  no earlier context attends to its own fresh K/V, skipping the gather). Either way greedy bf16
  output can differ from HF's bf16 run at near-ties (fp32 top-2 margins under bf16's logit
  resolution): benchmarks/chat_parity.py reports them.
"""

from __future__ import annotations

import ctypes
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
import torch.nn.functional as F

from tokenfleet.models import kv_fp8, native
from tokenfleet.models.kv_fp8 import gather as _gather


@dataclass
class PrefillSpan:
    """One request's prefill chunk inside the flattened batch."""

    start: int  # index of the chunk's first token in the batch
    num_tokens: int  # chunk length
    context_len: int  # tokens attended to by the chunk's last token (earlier context + chunk)
    context_block_ids: torch.Tensor | None  # [num_context_blocks]; None when there is no earlier context


@dataclass
class PagedQueries:
    """Requests with a few query tokens each, attended over their block tables.

    Their query rows are the batch's first ``num_tokens`` rows, request after request. Query j of a
    request with n rows and context length L sees keys 0 .. L - n + j (causal among its rows)."""

    block_table: torch.Tensor  # [num_requests, max_blocks] long, padded with block 0
    context_lens: torch.Tensor  # [num_requests] long: keys the request's last query row sees
    query_start: torch.Tensor  # [num_requests + 1] long: request r owns rows query_start[r] .. [r+1]-1
    num_tokens: int
    max_query_len: int
    window: int = 0  # sliding window: a query row sees only the last ``window`` of its keys; 0: all
    # [2, W] long, or None: the (request, tile of query rows) programs to run, request -1 for none, instead of every
    # request x tile (models.triton_attention; a mixed-step CUDA graph's grid is fixed while few requests have many
    # rows). Implementations that walk requests directly ignore it.
    work: torch.Tensor | None = None

    @property
    def num_requests(self) -> int:
        return int(self.context_lens.shape[0])


@dataclass
class ForwardBatch:
    """Everything a forward needs besides token ids; built once per step by the model runner."""

    positions: torch.Tensor  # [num_tokens] long
    slot_mapping: torch.Tensor  # [num_tokens] long: block_id * block_size + offset of each token's K/V
    logits_indices: torch.Tensor  # [num_logits] long: batch rows whose logits are sampled
    # Positions in logits_indices whose top logits are recomputed exactly (llama.refine_top_logits): the
    # rows a greedy pick or reported logprobs depend on. None: none.
    exact_logits: torch.Tensor | None = None
    # The same as one bool per logits row (a captured CUDA graph cannot index by a varying set): True rows get
    # the exact top logits. Set instead of exact_logits.
    exact_rows: torch.Tensor | None = None
    queries: PagedQueries | None = None  # every row, request by request: set when one call attends the whole step
    paged: PagedQueries | None = None  # the one-row (decode) requests, the batch's first rows
    prefills: list[PrefillSpan] = field(default_factory=list)  # the others, for implementations that use SDPA
    window: int = 0  # sliding window of the layers this batch's slots and tables serve; 0: full attention
    # Models whose layers keep KV in several groups (tokenfleet.kvcache.layout.kv_groups): the other groups'
    # views of the same rows (their slots, tables and window); group 0 is this object.
    others: tuple[ForwardBatch, ...] = ()
    lora: Any = None  # models.lora.LoraBatch: the step's rows grouped by LoRA adapter (None: no adapter in the step)

    def group(self, index: int) -> ForwardBatch:
        return self if index == 0 else self.others[index - 1]

    @property
    def num_paged_tokens(self) -> int:
        return self.paged.num_tokens if self.paged is not None else 0


class PagedAttention(Protocol):
    #: True: it attends every row (prefill chunks too) from the caches; False: decode rows only
    #: (``paged_attention`` runs SDPA for prefill chunks).
    handles_prefill: bool

    def __call__(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: PagedQueries) -> torch.Tensor:
        """q: [num_tokens, heads, head_dim] -> [num_tokens, heads, head_dim] in q's dtype; reads the caches only."""


class TorchPagedAttention:
    """Reference implementation: gather every request's blocks (padded to the longest), fp32 math."""

    handles_prefill = False

    def __call__(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: PagedQueries) -> torch.Tensor:
        num_tokens, num_heads, head_dim = q.shape
        num_kv_heads, _, block_size, _ = k_cache.shape
        group, r, n = num_heads // num_kv_heads, meta.num_requests, meta.max_query_len
        flat = meta.block_table.reshape(-1)
        keys = _gather(k_cache, flat).view(num_kv_heads, r, -1, head_dim).float()  # [kvh, R, L, hd]
        values = _gather(v_cache, flat).view(num_kv_heads, r, -1, head_dim).float()
        starts = meta.query_start[:-1]
        counts = meta.query_start[1:] - starts  # [R]
        row_req = torch.repeat_interleave(torch.arange(r, device=q.device), counts, output_size=num_tokens)
        row_pos = torch.arange(num_tokens, device=q.device) - starts[row_req]  # index of each row in its request
        padded = q.new_zeros(r, n, num_heads, head_dim)
        padded[row_req, row_pos] = q
        qh = padded.view(r, n, num_kv_heads, group, head_dim).permute(2, 0, 1, 3, 4).reshape(num_kv_heads, r, n * group, head_dim)
        scores = torch.matmul(qh.float(), keys.transpose(-1, -2)) * head_dim**-0.5  # [kvh, R, n * group, L]
        key_pos = torch.arange(keys.shape[2], device=q.device)
        # keys visible to query j: < L - count + j + 1
        limit = (meta.context_lens - counts)[:, None] + torch.arange(n, device=q.device)[None, :] + 1  # [R, n]
        visible = key_pos[None, None, :] < limit[:, :, None]  # [R, n, L]
        if meta.window:  # and keys >= limit - window (blocks before that may be the null block)
            visible &= key_pos[None, None, :] >= limit[:, :, None] - meta.window
        visible = visible[:, :, None, :].expand(r, n, group, -1).reshape(1, r, n * group, -1)
        scores = scores.masked_fill(~visible, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out = torch.matmul(probs, values)  # [kvh, R, n * group, hd]
        out = out.view(num_kv_heads, r, n, group, head_dim).permute(1, 2, 0, 3, 4).reshape(r, n, num_heads, head_dim)
        return out[row_req, row_pos].to(q.dtype)


class NativePagedAttention:
    """csrc/paged_attention.c: bf16 caches on CPU (or, ``fp8``, FP8 rows: models.kv_fp8), blocks read in place,
    fp32 math; every row of a step in one call (prefill chunks read their context from the cache, causal rows
    skip keys)."""

    PATHS = ("portable", "avx512-reduce", "avx512-packed")  # the kernel's PATH_* order
    BUILDS = ("portable C", "AVX-512 BF16", "AVX-512 BF16 emulated")  # tf_paged_attention_build()

    KINDS = {torch.bfloat16: 0, torch.float32: 2}  # the kernel's KIND_*: what q, out and the caches hold; FP8 caches: 1

    def __init__(self, lib: ctypes.CDLL, fp8: bool = False, dtype: torch.dtype = torch.bfloat16):
        if dtype not in self.KINDS or (fp8 and dtype != torch.bfloat16):
            raise ValueError(f"the native attention kernel runs bf16 (with bf16 or FP8 caches) or fp32, not {dtype}"
                             f"{' with FP8 caches' if fp8 else ''}")
        self.fp8 = fp8
        self.dtype = dtype
        # fp32 prefill spans go to SDPA (MKL's fp32 GEMMs), 1.4x faster at a 1,024-token prompt on the Zen 3 than
        # this kernel's portable code (benchmarks/cpu_kernels.py); bf16 ones stay here unless loader.checked_kernels
        # finds SDPA faster on this machine (models.prefill_attention), which it says in prefill_reason
        self.handles_prefill = dtype == torch.bfloat16
        self.prefill_reason = ""
        self._fn = lib.tf_paged_attention
        i64, ptr = ctypes.c_int64, ctypes.c_void_p
        self._fn.argtypes = [ptr] * 7 + [i64] * 7 + [ctypes.c_float, i64, ctypes.c_int, ctypes.c_int, ptr]
        self._fn.restype = ctypes.c_int
        lib.tf_paged_attention_build.restype = ctypes.c_int
        self.build = self.BUILDS[lib.tf_paged_attention_build()]
        self._paths = (ctypes.c_int64 * len(self.PATHS))()  # work items per path, since construction

    @property
    def name(self) -> str:
        if self.dtype == torch.float32:
            return "native paged attention (portable C, fp32)"
        return f"native paged attention ({self.build}{', FP8 KV' if self.fp8 else ''})"

    def path_counts(self) -> dict[str, int]:
        """Work items each code path has run since this object was made (the kernel counts them)."""
        return dict(zip(self.PATHS, self._paths))

    def __call__(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: PagedQueries) -> torch.Tensor:
        num_tokens, num_heads, head_dim = q.shape
        num_kv_heads, num_blocks, block_size, _ = k_cache.shape
        if kv_fp8.is_fp8(k_cache) != self.fp8:
            raise ValueError(f"this kernel reads {'FP8' if self.fp8 else 'bf16'} caches, not {k_cache.dtype}")
        if q.dtype != self.dtype or (not self.fp8 and k_cache.dtype != self.dtype):
            raise ValueError(f"this kernel runs {self.dtype} queries and caches, not {q.dtype} and {k_cache.dtype}")
        q = q.contiguous()
        out = torch.empty_like(q)
        table = meta.block_table.contiguous()
        rc = self._fn(q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), table.data_ptr(), meta.context_lens.data_ptr(),
                      meta.query_start.data_ptr(), out.data_ptr(), meta.num_requests, num_heads, num_kv_heads, head_dim,
                      block_size, num_blocks, table.shape[1], head_dim**-0.5, meta.window, torch.get_num_threads(),
                      1 if self.fp8 else self.KINDS[self.dtype], ctypes.addressof(self._paths))
        if rc != 0:
            raise ValueError("paged attention: inconsistent block table, context lengths or query rows")
        return out


def fallbacks(attend: PagedAttention) -> Iterator[PagedAttention]:
    """What may replace ``attend`` if it fails its check at load (models.kernel_check), before the torch reference:
    the portable C build after the AVX-512 one. A generator: nothing is built unless the check asks for it."""
    if isinstance(attend, NativePagedAttention) and attend.build != "portable C":
        lib = native.load("paged_attention", ("TF_PORTABLE_ONLY",))
        if lib is not None:
            yield NativePagedAttention(lib, fp8=attend.fp8, dtype=attend.dtype)


def paged_attention(
    q: torch.Tensor,  # [num_tokens, heads, head_dim]
    k: torch.Tensor,  # [num_tokens, kv_heads, head_dim]
    v: torch.Tensor,  # [num_tokens, kv_heads, head_dim]
    k_cache: torch.Tensor,  # [kv_heads, num_blocks, block_size, head_dim]
    v_cache: torch.Tensor,  # [kv_heads, num_blocks, block_size, head_dim]
    batch: ForwardBatch,
    attend: PagedAttention,
) -> torch.Tensor:
    """Attend; the step's k/v are already in the caches. Returns [num_tokens, heads * head_dim]."""
    num_tokens, num_heads, head_dim = q.shape
    if batch.queries is not None:  # one call for the whole step (an implementation with handles_prefill)
        return attend(q, k_cache, v_cache, batch.queries).view(num_tokens, num_heads * head_dim)
    if batch.paged is not None and not batch.prefills:  # a pure decode step: no copy of the output
        return attend(q, k_cache, v_cache, batch.paged).view(num_tokens, num_heads * head_dim)
    out = torch.empty_like(q)
    fp8 = kv_fp8.is_fp8(k_cache)
    if batch.paged is not None:
        d = batch.paged.num_tokens
        out[:d] = attend(q[:d], k_cache, v_cache, batch.paged)
    for span in batch.prefills:
        rows = slice(span.start, span.start + span.num_tokens)
        if span.context_block_ids is None:  # no earlier context: attend to the chunk's own K/V (an FP8 cache's
            # values, as the cache holds them: a prompt reads the same keys whether its prefix was cached or not,
            # up to the model dtype's rounding of them, which the kernels that read the cache in fp32 skip)
            own_k, own_v = (k[rows], v[rows]) if not fp8 else (_as_stored(k[rows]), _as_stored(v[rows]))
            out[rows] = _prefill_attention(q[rows], own_k.transpose(0, 1), own_v.transpose(0, 1), 0, batch.window)
        elif getattr(attend, "prefix_spans", False):  # the kernel reads the prefix through the block table
            meta = PagedQueries(block_table=span.context_block_ids[None], context_lens=_ints([span.context_len], q),
                                query_start=_ints([0, span.num_tokens], q), num_tokens=span.num_tokens,
                                max_query_len=span.num_tokens, window=batch.window)
            out[rows] = attend(q[rows], k_cache, v_cache, meta)
        else:
            ctx_k = _gather(k_cache, span.context_block_ids, q.dtype)[:, : span.context_len]
            ctx_v = _gather(v_cache, span.context_block_ids, q.dtype)[:, : span.context_len]
            out[rows] = _prefill_attention(q[rows], ctx_k, ctx_v, span.context_len - span.num_tokens, batch.window)
    return out.view(num_tokens, num_heads * head_dim)


def _as_stored(x: torch.Tensor) -> torch.Tensor:
    """``x`` [tokens, kv_heads, head_dim] rounded as an FP8 cache stores it, in x's dtype."""
    return kv_fp8.dequantize(kv_fp8.quantize(x), x.dtype)


def _ints(values: list[int], like: torch.Tensor) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.long, device=like.device)


def _prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal_offset: int, window: int = 0
                       ) -> torch.Tensor:
    """q: [n, heads, hd]; k, v: [kv_heads, L, hd] with L = causal_offset + n. Query i sees keys <= offset + i
    (and > offset + i - window with a sliding window)."""
    n, num_heads, head_dim = q.shape
    num_kv_heads, length, _ = k.shape
    qt = q.transpose(0, 1).unsqueeze(0)  # [1, heads, n, hd]
    kt, vt = k.unsqueeze(0), v.unsqueeze(0)  # [1, kv_heads, L, hd]
    gqa = num_heads != num_kv_heads
    if causal_offset == 0 and (not window or n <= window):
        o = F.scaled_dot_product_attention(qt, kt, vt, is_causal=True, enable_gqa=gqa)
    else:
        key_pos = torch.arange(length, device=q.device)
        query_pos = torch.arange(n, device=q.device) + causal_offset
        mask = key_pos[None, :] <= query_pos[:, None]  # [n, L]
        if window:
            mask &= key_pos[None, :] > query_pos[:, None] - window
        o = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask, enable_gqa=gqa)
    return o.squeeze(0).transpose(0, 1)  # [n, heads, hd]
