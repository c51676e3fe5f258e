"""Paged attention in Triton (CUDA): every query row of a step read straight from the block tables.

One kernel serves decode (one query row per request), speculative verification (a few rows,
causal among themselves) and prefill chunks over a cached prefix (many rows): a program takes a
tile of one request's query rows times the query heads of one KV head (GQA: the group's heads
share every K/V load), walks the request's context ``BLOCK_N`` keys at a time through its block
table (each key's block looked up, so a tile spans several cache blocks), and keeps an online
softmax in fp32. Q.K products accumulate in fp32 from the cache's dtype. P.V accumulates in fp32 from
probabilities rounded to the model's 16-bit dtype, as flash attention does (envs.attn_pv: "model"; the torch
reference keeps them in fp32, "fp32" here, which on an H200 made 8B decode steps 1.06x slower at batch 1 and 1.39x
at batch 256: the fp32 product runs on FMA units, not tensor cores). FP8 caches (models.kv_fp8) are read
as e4m3 with each key's and value's scale applied in fp32. Loop bounds come from device
tensors (context lengths, query starts), so a step captured in a CUDA graph replays for any
context length up to the block table's width.

Tested against ``TorchPagedAttention`` (the reference) in ``tests/unit/models/test_triton_attention.py``
through Triton's interpreter on CPU, and on CUDA in ``tests/gpu``.
"""

from __future__ import annotations

import functools

import torch

from tokenfleet import envs
from tokenfleet.models import kv_fp8
from tokenfleet.models.attention import PagedQueries
from tokenfleet.models.triton_ops import pow2

try:  # CUDA builds of torch bring triton; CPU installs have it with the dev extras (interpreter tests)
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - the torch reference serves
    triton = None


def available() -> bool:
    return triton is not None


if triton is not None:
    @triton.jit
    def _attend_keys(q, m_i, l_i, acc, key0, end, limit, window, sm_scale, req, kv_head, k_ptr, v_ptr, ks_ptr, vs_ptr,
                     table_ptr, stride_kh, stride_kb, stride_ks, stride_table, d, d_ok,
                     BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, FP32_DOT: tl.constexpr, FP8_KV: tl.constexpr,
                     HEAD_DIM: tl.constexpr, PV: tl.constexpr):
        """One tile of BLOCK_N keys (each looked up in the request's block table) into the online softmax.

        FP8_KV: the caches hold packed rows (models.kv_fp8: e4m3 bytes, then the row's fp32 scale, which
        ``ks_ptr``/``vs_ptr``, the caches viewed as fp32, read at column HEAD_DIM / 4). The scales stay out of the
        dot products: an e4m3 value is exact in bf16, and a key's scale multiplies its score column (a value's, its
        probability column).

        PV (envs.attn_pv): P.V with fp32 operands on FMA units (0), as three TF32 tensor-core products (1), or with
        P rounded to the model's 16-bit dtype, one tensor-core product (2); the accumulator is fp32 in all three."""
        pos = key0 + tl.arange(0, BLOCK_N)
        pos_ok = pos < end
        block = tl.load(table_ptr + req * stride_table + pos // BLOCK_SIZE, mask=pos_ok, other=0)
        where = kv_head.to(tl.int64) * stride_kh + block * stride_kb + (pos % BLOCK_SIZE) * stride_ks  # 64-bit
        kv_mask = pos_ok[:, None] & d_ok[None, :]
        if FP8_KV:
            k = tl.load(k_ptr + where[:, None] + d[None, :], mask=kv_mask, other=0).to(tl.float8e4nv, bitcast=True)
            v = tl.load(v_ptr + where[:, None] + d[None, :], mask=kv_mask, other=0).to(tl.float8e4nv, bitcast=True)
            k_scale = tl.load(ks_ptr + (where + HEAD_DIM) // 4, mask=pos_ok, other=0.0)
            v_scale = tl.load(vs_ptr + (where + HEAD_DIM) // 4, mask=pos_ok, other=0.0)
        else:
            k = tl.load(k_ptr + where[:, None] + d[None, :], mask=kv_mask, other=0.0)
            v = tl.load(v_ptr + where[:, None] + d[None, :], mask=kv_mask, other=0.0)
        if FP32_DOT:
            s = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k.to(q.dtype)))  # bf16/fp16 products are exact in the fp32 accumulator
        if FP8_KV:
            s = s * k_scale[None, :]
        s = s * sm_scale
        visible = (pos[None, :] < limit[:, None]) & ((pos[None, :] >= limit[:, None] - window) | (window == 0))
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if FP8_KV:
            p = p * v_scale[None, :]  # the probabilities then weigh e4m3 values (exact in bf16 and TF32)
        if PV == 2:  # FP8: bf16 operands whatever the model's dtype (scaled probabilities underflow fp16)
            lowp = tl.bfloat16 if FP8_KV else q.dtype
            pv = tl.dot(p.to(lowp), v.to(lowp))
        elif PV == 1:
            pv = tl.dot(p, v.to(tl.float32), input_precision="tf32x3")
        else:
            pv = tl.dot(p, v.to(tl.float32), input_precision="ieee")
        acc = acc * alpha[:, None] + pv
        return m_new, l_i, acc

    @triton.jit
    def _key_range(context, count, first_row, TOKENS: tl.constexpr, window, BLOCK_N: tl.constexpr):
        """The keys [start, end) that rows first_row .. first_row + TOKENS - 1 of a request see, start aligned down
        to BLOCK_N (a sliding window's start moves with the first row)."""
        last_row = tl.minimum(first_row + TOKENS, count) - 1
        end = context - count + last_row + 1
        start = tl.maximum(context - count + first_row + 1 - window, 0) * (window > 0)
        return (start // BLOCK_N) * BLOCK_N, end

    @triton.jit
    def _chunk(span, num_parts, PARTITION: tl.constexpr, BLOCK_N: tl.constexpr):
        """Keys per partition: the span spread over the grid's partitions in whole tiles, at least PARTITION."""
        per = (span + num_parts - 1) // num_parts
        return tl.maximum(PARTITION, ((per + BLOCK_N - 1) // BLOCK_N) * BLOCK_N)

    @triton.jit
    def paged_attention_kernel(
        q_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr, out_ptr, table_ptr, ctx_ptr, qstart_ptr,
        sm_scale, window,
        stride_qt, stride_qh, stride_kh, stride_kb, stride_ks, stride_ot, stride_oh, stride_table,
        part_m_ptr, part_l_ptr, part_acc_ptr, num_kv_heads, num_parts, work_req_ptr, work_tile_ptr, counter_ptr,
        GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, TOKENS: tl.constexpr, HEAD_DIM: tl.constexpr,
        HEAD_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, FP32_DOT: tl.constexpr,
        INTERPRETED: tl.constexpr, PARTITION: tl.constexpr, FP8_KV: tl.constexpr, PV: tl.constexpr,
        WORK: tl.constexpr, FUSED_MERGE: tl.constexpr,
    ):
        """PARTITION > 0 (split-K, "flash decoding"): program_id(0) is one of ``num_parts`` partitions of the
        request's keys instead of a tile of query rows (TOKENS then covers every row). A partition spans the keys
        divided evenly over the grid in whole tiles, at least PARTITION keys, so the grid stays the same for any
        context (a captured graph) while short contexts use fewer partitions: those past the keys exit without
        writing. Each used one writes its softmax state to the part_* buffers and ``_merge_partitions`` combines
        them; with FUSED_MERGE the last used partition of a request and KV head to finish combines them instead
        (it counts arrivals in ``counter_ptr``, one int32 per request x KV head, and sets its count back to 0):
        one launch fewer per layer.

        WORK (``PagedQueries.work``): program_id(0) is an entry of a list of (request, tile) pairs, request -1 for
        none, instead of a tile of every request."""
        if PARTITION > 0:
            part = tl.program_id(0)
            tile = 0
            req = tl.program_id(1)
        elif WORK:
            part = 0
            req = tl.load(work_req_ptr + tl.program_id(0))
            tile = tl.load(work_tile_ptr + tl.program_id(0))
        else:
            part = 0
            tile = tl.program_id(0)
            req = tl.program_id(1)
        listed = req >= 0
        req = tl.maximum(req, 0)
        kv_head = tl.program_id(2)
        q_first = tl.load(qstart_ptr + req)
        count = tl.load(qstart_ptr + req + 1) - q_first
        context = tl.load(ctx_ptr + req)
        first_row = tile * TOKENS
        start, end = _key_range(context, count, first_row, TOKENS, window, BLOCK_N)
        used = (first_row < count) & listed
        num_used = 1
        if PARTITION > 0:
            chunk = _chunk(end - start, num_parts, PARTITION, BLOCK_N)
            num_used = (end - start + chunk - 1) // chunk  # the partitions holding keys: 0 .. num_used - 1
            start = start + part * chunk
            end = tl.minimum(end, start + chunk)
            used = used & (start < end)
        if used:
            m = tl.arange(0, TOKENS * GROUP_PAD)
            row = first_row + m // GROUP_PAD  # the query row of this request
            head = kv_head * GROUP + m % GROUP_PAD
            live = (row < count) & (m % GROUP_PAD < GROUP)
            d = tl.arange(0, HEAD_PAD)
            d_ok = d < HEAD_DIM
            q = tl.load(q_ptr + (q_first + row)[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
                        mask=live[:, None] & d_ok[None, :], other=0.0)
            limit = context - count + row + 1  # keys this row sees: [limit - window, limit)
            m_i = tl.full([TOKENS * GROUP_PAD], -1.0e30, tl.float32)
            l_i = tl.zeros([TOKENS * GROUP_PAD], tl.float32)
            acc = tl.zeros([TOKENS * GROUP_PAD, HEAD_PAD], tl.float32)
            if INTERPRETED:  # the interpreter cannot take tensor bounds in range(); compiled, range() pipelines loads
                key0 = start
                while key0 < end:
                    m_i, l_i, acc = _attend_keys(q, m_i, l_i, acc, key0, end, limit, window, sm_scale, req, kv_head,
                                                 k_ptr, v_ptr, ks_ptr, vs_ptr, table_ptr, stride_kh, stride_kb,
                                                 stride_ks, stride_table, d, d_ok, BLOCK_SIZE, BLOCK_N, FP32_DOT,
                                                 FP8_KV, HEAD_DIM, PV)
                    key0 += BLOCK_N
            else:
                for key0 in range(start, end, BLOCK_N):
                    m_i, l_i, acc = _attend_keys(q, m_i, l_i, acc, key0, end, limit, window, sm_scale, req, kv_head,
                                                 k_ptr, v_ptr, ks_ptr, vs_ptr, table_ptr, stride_kh, stride_kb,
                                                 stride_ks, stride_table, d, d_ok, BLOCK_SIZE, BLOCK_N, FP32_DOT,
                                                 FP8_KV, HEAD_DIM, PV)
            if PARTITION > 0:
                at = ((req * num_kv_heads + kv_head) * num_parts + part).to(tl.int64) * (TOKENS * GROUP_PAD) + m  # 64-bit
                tl.store(part_m_ptr + at, m_i)
                tl.store(part_l_ptr + at, l_i)
                tl.store(part_acc_ptr + at[:, None] * HEAD_PAD + d[None, :], acc)
                if FUSED_MERGE:
                    tl.debug_barrier()  # every thread's stores above come before the release below
                    slot = counter_ptr + req * num_kv_heads + kv_head
                    arrived = tl.atomic_add(slot, 1, sem="acq_rel", scope="gpu")
                    tl.debug_barrier()
                    if arrived == num_used - 1:  # the last to finish: the others' states are visible (acquire)
                        tl.atomic_xchg(slot, 0)  # ready for the next layer, step, or graph replay
                        _merge_rows(part_m_ptr, part_l_ptr, part_acc_ptr, out_ptr, req, kv_head, num_kv_heads,
                                    num_parts, num_used, q_first, count, stride_ot, stride_oh, GROUP, GROUP_PAD,
                                    TOKENS, HEAD_DIM, HEAD_PAD, INTERPRETED)
            else:
                l_i = tl.where(l_i == 0.0, 1.0, l_i)
                out = acc / l_i[:, None]
                tl.store(out_ptr + (q_first + row)[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
                         out.to(out_ptr.dtype.element_ty), mask=live[:, None] & d_ok[None, :])

    @triton.jit
    def _merge_one(part_m_ptr, part_l_ptr, part_acc_ptr, at0, m, d, top, total, acc, HEAD_PAD: tl.constexpr):
        """One partition's state into the running one (a row that saw no keys there: m = -1e30, l = 0, weighs 0).
        Loads skip L1 (.cg): other programs wrote these, maybe on other multiprocessors, just before."""
        at = at0 + m
        m_p = tl.load(part_m_ptr + at, cache_modifier=".cg")
        l_p = tl.load(part_l_ptr + at, cache_modifier=".cg")
        acc_p = tl.load(part_acc_ptr + at[:, None] * HEAD_PAD + d[None, :], cache_modifier=".cg")
        new = tl.maximum(top, m_p)
        keep = tl.exp(top - new)
        take = tl.exp(m_p - new)
        return new, total * keep + l_p * take, acc * keep[:, None] + acc_p * take[:, None]

    @triton.jit
    def _merge_rows(part_m_ptr, part_l_ptr, part_acc_ptr, out_ptr, req, kv_head, num_kv_heads, num_parts, used,
                    q_first, count, stride_ot, stride_oh,
                    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, TOKENS: tl.constexpr, HEAD_DIM: tl.constexpr,
                    HEAD_PAD: tl.constexpr, INTERPRETED: tl.constexpr):
        """Request ``req`` x ``kv_head``: the first ``used`` partitions' (max, sum, accumulator), folded one by one
        into a running softmax state (rescaled to the running max), divided out and written."""
        m = tl.arange(0, TOKENS * GROUP_PAD)
        row = m // GROUP_PAD
        head = kv_head * GROUP + m % GROUP_PAD
        live = (row < count) & (m % GROUP_PAD < GROUP)
        d = tl.arange(0, HEAD_PAD)
        d_ok = d < HEAD_DIM
        base = (req * num_kv_heads + kv_head).to(tl.int64) * num_parts  # 64-bit: x HEAD_PAD can pass 2^31
        top = tl.full([TOKENS * GROUP_PAD], -1.0e30, tl.float32)
        total = tl.zeros([TOKENS * GROUP_PAD], tl.float32)
        acc = tl.zeros([TOKENS * GROUP_PAD, HEAD_PAD], tl.float32)
        if INTERPRETED:
            i = 0
            while i < used:
                top, total, acc = _merge_one(part_m_ptr, part_l_ptr, part_acc_ptr, (base + i) * (TOKENS * GROUP_PAD),
                                             m, d, top, total, acc, HEAD_PAD)
                i += 1
        else:
            for i in range(0, used):
                top, total, acc = _merge_one(part_m_ptr, part_l_ptr, part_acc_ptr, (base + i) * (TOKENS * GROUP_PAD),
                                             m, d, top, total, acc, HEAD_PAD)
        total = tl.where(total == 0.0, 1.0, total)
        out = acc / total[:, None]
        tl.store(out_ptr + (q_first + row)[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=live[:, None] & d_ok[None, :])

    @triton.jit
    def _merge_partitions(part_m_ptr, part_l_ptr, part_acc_ptr, out_ptr, ctx_ptr, qstart_ptr, window, num_kv_heads,
                          num_parts, stride_ot, stride_oh,
                          GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, TOKENS: tl.constexpr, HEAD_DIM: tl.constexpr,
                          HEAD_PAD: tl.constexpr, BLOCK_N: tl.constexpr, PARTITION: tl.constexpr,
                          INTERPRETED: tl.constexpr):
        """One program per request x KV head, after the partition kernel. The same arithmetic as that kernel tells
        how many partitions hold keys, so the merge's work follows the context, not the grid."""
        req = tl.program_id(0)
        kv_head = tl.program_id(1)
        q_first = tl.load(qstart_ptr + req)
        count = tl.load(qstart_ptr + req + 1) - q_first
        start, end = _key_range(tl.load(ctx_ptr + req), count, 0, TOKENS, window, BLOCK_N)
        chunk = _chunk(end - start, num_parts, PARTITION, BLOCK_N)
        used = (end - start + chunk - 1) // chunk
        _merge_rows(part_m_ptr, part_l_ptr, part_acc_ptr, out_ptr, req, kv_head, num_kv_heads, num_parts, used,
                    q_first, count, stride_ot, stride_oh, GROUP, GROUP_PAD, TOKENS, HEAD_DIM, HEAD_PAD, INTERPRETED)


PV_MODES = {"fp32": 0, "tf32x3": 1, "model": 2}  # envs.attn_pv -> the kernel's PV


def _interpreted() -> bool:
    return envs.triton_interpret()


class TritonPagedAttention:
    """The ``PagedAttention`` interface on CUDA. Decode and verification rows go through the kernel; prefill
    chunks without earlier context keep SDPA (flash attention, faster for a fresh causal block), and chunks
    over a cached prefix come back here (``prefix_spans``) instead of gathering the prefix.

    Few requests (requests x KV heads under ``split_below`` programs, default two per multiprocessor) leave most
    of the GPU idle while each program walks its whole context: then the context is split in partitions, one
    program each, merged by a second kernel (split-K, "flash decoding"). The grid's partition count fills
    ``split_below`` (capped by the block table's width at ``partition`` keys each) and is static, so a captured
    graph replays for any context; each partition covers the context divided over them in whole tiles, at least
    ``partition`` keys. Partitions past a request's keys exit at once and the merge walks only the used ones (a
    count that followed the table's width instead made a 128k-token table at batch 1 launch 512 partitions per KV
    head, most of them empty, for a merge to walk)."""

    handles_prefill = False
    prefix_spans = True

    def __init__(self, block_n: int = 0, prefill_tokens: int = 32, partition: int = 0, split_below: int | None = None,
                 num_warps: int = 0, num_stages: int = 0, pv: str = "", merge: str = ""):
        """Zeros take TOKENFLEET_ATTN_TUNING ("block_n,partition,num_warps,num_stages", benchmarks/attention_sweep.py)
        or the defaults 64, 256, 4, 3; ``pv`` "" takes TOKENFLEET_ATTN_PV (envs.attn_pv), ``merge`` ""
        TOKENFLEET_ATTN_MERGE (envs.attn_merge: "kernel", a second launch, or "fused", the last partition)."""
        tuned = [int(v) for v in envs.attn_tuning().split(",")]
        self.pv = pv or envs.attn_pv()
        if self.pv not in PV_MODES:
            raise ValueError(f"TOKENFLEET_ATTN_PV={self.pv!r}: one of {', '.join(PV_MODES)}")
        self.merge = merge or envs.attn_merge()
        if self.merge not in ("kernel", "fused"):
            raise ValueError(f"TOKENFLEET_ATTN_MERGE={self.merge!r}: kernel or fused")
        # fused merges: arrival counts per request x KV head, zero between calls (the last arrival resets its own);
        # one buffer per device, allocated by the first split call (a graph capture's warm-up, not the capture)
        self._counters: dict[torch.device, torch.Tensor] = {}
        self.block_n = block_n or tuned[0]
        self.partition = partition or tuned[1]
        self.num_warps = num_warps or tuned[2]
        self.num_stages = num_stages or tuned[3]
        if self.partition % self.block_n:
            raise ValueError("partition must be a multiple of block_n")
        self.prefill_tokens = prefill_tokens
        self.split_below = split_below

    def rows_per_program(self, num_heads: int, num_kv_heads: int, max_query_len: int) -> int:
        """Query rows of one request a program takes (TOKENS): a work list (``PagedQueries.work``) has one entry
        per tile of that many rows of a request."""
        group_pad = pow2(num_heads // num_kv_heads)
        if max_query_len <= 4:  # decode / verification: every row of a request in one program
            tokens = pow2(max_query_len)
        else:
            tokens = max(1, self.prefill_tokens * 4 // group_pad)
        return max(tokens, -(-16 // group_pad))  # tl.dot wants 16 rows at least

    def check_tolerance(self, dtype: torch.dtype, kv_cache_dtype: str) -> tuple[float, float] | None:
        """The load-time check's (rtol, atol) (models.kernel_check) where this kernel rounds P.V's operands on purpose:
        with ``pv`` "model" P is rounded to the model's dtype, and over an FP8 cache P times each value's scale to
        bf16, so even the largest term carries ~2^-9 of error: 4x the dtype's bf16 tolerance (a score off by 1 still
        moves outputs by 0.1-0.5). None: the dtype's own."""
        return (2**-5, 2**-6) if self.pv == "model" or kv_cache_dtype == "fp8" else None

    def __call__(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: PagedQueries) -> torch.Tensor:
        num_tokens, num_heads, head_dim = q.shape
        num_kv_heads, _, block_size, _ = k_cache.shape
        group = num_heads // num_kv_heads
        group_pad = pow2(group)
        tokens = self.rows_per_program(num_heads, num_kv_heads, meta.max_query_len)
        out = torch.empty_like(q)
        if q.stride(-1) != 1:
            q = q.contiguous()
        table = meta.block_table
        rows = tokens * group_pad
        head_pad = pow2(max(head_dim, 16))
        parts = 1
        programs = meta.num_requests * num_kv_heads
        split_below = self._split_below(q.device)
        if meta.max_query_len <= 4 and programs < split_below:
            # enough partitions to fill the GPU, no more than the table's width holds at PARTITION keys each
            parts = min(-(-split_below // programs), -(-table.shape[1] * block_size // self.partition))
        if parts > 1:
            partition = self.partition
            grid = (parts, meta.num_requests, num_kv_heads)
            part_m = torch.empty(programs * parts * rows, dtype=torch.float32, device=q.device)
            part_l = torch.empty_like(part_m)
            part_acc = torch.empty(part_m.shape[0] * head_pad, dtype=torch.float32, device=q.device)
        else:
            partition = 0
            grid = (-(-meta.max_query_len // tokens), meta.num_requests, num_kv_heads)
            part_m = part_l = part_acc = out  # unused
        fused = parts > 1 and self.merge == "fused"
        counters = self._counter_buffer(q.device, programs) if fused else meta.query_start  # else unread
        work = meta.work if parts == 1 else None
        if work is not None:
            grid = (work.shape[1], 1, num_kv_heads)
        constants = dict(GROUP=group, GROUP_PAD=group_pad, TOKENS=tokens, HEAD_DIM=head_dim, HEAD_PAD=head_pad)
        fp8 = kv_fp8.is_fp8(k_cache)  # packed rows: their scales read through fp32 views of the same memory
        num_warps, num_stages = self.launch_shape(rows, fp8)
        k_scales, v_scales = (k_cache.view(torch.float32), v_cache.view(torch.float32)) if fp8 else (k_cache, v_cache)
        paged_attention_kernel[grid](
            q, k_cache, v_cache, k_scales, v_scales, out, table, meta.context_lens, meta.query_start,
            head_dim**-0.5, meta.window,
            q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), out.stride(0),
            out.stride(1), table.stride(0), part_m, part_l, part_acc, num_kv_heads, parts,
            work[0] if work is not None else meta.query_start, work[1] if work is not None else meta.query_start,
            counters, **constants,
            BLOCK_SIZE=block_size, BLOCK_N=self.block_n,
            # the interpreter runs bf16 dots wrong (numpy has no bf16): there, upcast as fp32 runs do
            FP32_DOT=q.dtype == torch.float32 or _interpreted(),
            INTERPRETED=_interpreted(), PARTITION=partition, FP8_KV=fp8, WORK=work is not None, FUSED_MERGE=fused,
            num_warps=num_warps, num_stages=num_stages,
            # fp32 models (and the interpreter, whose 16-bit dots are wrong) keep fp32 operands
            PV=0 if q.dtype == torch.float32 or _interpreted() else PV_MODES[self.pv],
        )
        if parts > 1 and not fused:
            _merge_partitions[(meta.num_requests, num_kv_heads)](
                part_m, part_l, part_acc, out, meta.context_lens, meta.query_start, meta.window, num_kv_heads, parts,
                out.stride(0), out.stride(1), **constants, BLOCK_N=self.block_n, PARTITION=partition,
                INTERPRETED=_interpreted())
        return out

    def launch_shape(self, rows: int, fp8: bool) -> tuple[int, int]:
        """(warps, pipeline stages) for a program of ``rows`` query rows (TOKENS x GROUP_PAD). A tile of 128 (prefill
        over a cached prefix, mixed steps) keeps a [128, head_dim] fp32 accumulator: over 4 warps it spills (the 8B
        geometry: 255 registers and 480 bytes of stack on sm_90a, 672 reading an FP8 cache: scripts/triton_sm90.py,
        benchmarks/reports/2026-11-26-sm90-kernel-resources.md); over 8 warps it fits (232 registers), and so does the
        FP8 cache's with 2 pipeline stages instead of 3 (64 bytes of stack with 3)."""
        if rows < 128:
            return self.num_warps, self.num_stages
        return max(self.num_warps, 8), min(self.num_stages, 2) if fp8 else self.num_stages

    def _counter_buffer(self, device: torch.device, programs: int) -> torch.Tensor:
        counters = self._counters.get(device)
        if counters is None or counters.numel() < programs:
            if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
                raise RuntimeError("fused attention merges need their counters allocated before a graph capture")
            counters = self._counters[device] = torch.zeros(max(programs, self._split_below(device)),
                                                            dtype=torch.int32, device=device)
        return counters

    def _split_below(self, device: torch.device) -> int:
        if self.split_below is not None:
            return self.split_below
        if device.type != "cuda":
            return 0
        return 2 * _multiprocessors(device.index if device.index is not None else torch.cuda.current_device())


@functools.cache
def _multiprocessors(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count
