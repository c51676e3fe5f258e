"""A step's last work on the logits as Triton kernels (CUDA): the exact top logits of greedy rows, and the argmax.

At batch 1 on the Llama-3.1-8B geometry these were ~0.1 ms of a ~6.8 ms step on an H100
(benchmarks/reports/2026-11-25-h100-profile-llama-3.1-8b-graphs-b1.txt), in ~20 kernels: ``torch.topk`` over a 128k
vocabulary runs a multi-pass radix select (~12 kernels, ~45 us), the gather, einsum, scatter and ``where`` of
``llama.refine_top_logits`` a few more, and ``torch.argmax`` over one 128k row 27 us in one reduction. The bars want
70 % of the HBM roofline at that batch, 0.1 ms is 2 % of the step, and all of it is latency: the work is a few
hundred kilobytes.

Here two kernels refine and two pick:
- ``refine_top_logits_``: each program finds the top k of one ``CHUNK`` of one row (k rounds of max, masking the
  winner); one program per row then takes the top k of those candidates and computes their dot products in fp32 from
  the hidden state and the head's rows, written over the GEMM's values in place.
- ``argmax_rows``: each program the max of one chunk (first index on ties), one program per row the first chunk
  holding the row's max: torch.argmax's answer, ties included (the first maximal index).

Same values as the torch versions except the order of the fp32 sums in the dot products (a few ulps). Tested
against them through Triton's interpreter on CPU (tests/unit/models/test_triton_logits.py) and on CUDA in tests/gpu.
"""

from __future__ import annotations

import structlog
import torch

from tokenfleet import envs
from tokenfleet.models.triton_ops import pow2

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - the torch versions serve
    triton = None

log = structlog.get_logger(__name__)

CHUNK = 2048  # vocabulary entries per program of the first pass (a 128k vocabulary: 63 programs a row)


def available() -> bool:
    return triton is not None


_checked: dict[str, bool] = {}  # device -> whether the kernels compiled there and agreed with torch


def serves(logits: torch.Tensor, *others: torch.Tensor) -> bool:
    """Whether these kernels take fp32 ``logits`` (and the other operands) here: CUDA tensors with contiguous rows,
    unless TOKENFLEET_KERNELS=torch or TOKENFLEET_LOGITS_KERNELS=0 asks for torch's. The first call on a device runs
    both kernels on a small case against torch (``self_check``); if they fail to compile or disagree, torch serves
    from then on, with a warning, rather than every step failing. (Never first inside a CUDA graph capture: the
    capture's warm-up forwards run eagerly before it.)"""
    if not (available() and logits.is_cuda and logits.dtype == torch.float32 and envs.kernels() != "torch"
            and envs.logits_kernels() and all(t.stride(-1) == 1 for t in (logits, *others))):
        return False
    key = str(logits.device)
    ok = _checked.get(key)
    if ok is None:
        if torch.cuda.is_current_stream_capturing():
            return False
        ok = _checked[key] = self_check(logits.device)
    return ok


def self_check(device: torch.device) -> bool:
    """Each kernel variant the engine uses (all rows, listed rows, bool flags; a vocabulary of 5,000 and one divisible
    by 16, as real ones are: Triton specializes on it) against torch's topk, dot products and argmax. Out of memory
    is not a verdict on the kernels: it propagates."""
    try:
        g = torch.Generator().manual_seed(0)
        for vocab in (5000, 4112):
            head = torch.randn(vocab, 64, generator=g).to(device, torch.bfloat16)
            hidden = torch.randn(3, 64, generator=g).to(device, torch.bfloat16)
            logits = (hidden.float() @ head.float().T + torch.randn(3, vocab, generator=g).to(device)).contiguous()
            top = logits.topk(8, dim=-1).indices
            exact = logits.scatter(1, top, torch.einsum("rh,rkh->rk", hidden.float(), head[top].float()))
            rows = torch.tensor([2, 0], device=device)
            flags = torch.tensor([False, True, True], device=device)
            cases = ((refine_top_logits_(logits.clone(), hidden, head, 8), exact),
                     (refine_top_logits_(logits.clone(), hidden, head, 8, rows=rows),
                      torch.where(torch.tensor([True, False, True], device=device)[:, None], exact, logits)),
                     (refine_top_logits_(logits.clone(), hidden, head, 8, flags=flags),
                      torch.where(flags[:, None], exact, logits)))
            ok = all(torch.allclose(got, want, rtol=1e-5, atol=1e-4) for got, want in cases)
            ok = ok and torch.equal(argmax_rows(exact), exact.argmax(dim=-1))
            if not ok:
                log.warning("triton_logits_disagree", device=str(device), vocab=vocab,
                            note="torch serves the logits' top-k and argmax")
                return False
        return True
    except torch.cuda.OutOfMemoryError:
        raise
    except Exception as e:  # noqa: BLE001 - a kernel that cannot compile here: torch serves
        log.warning("triton_logits_failed", device=str(device), error=repr(e), note="torch serves instead")
        return False


if triton is not None:
    @triton.jit
    def _chunk_top_kernel(logits_ptr, row_ids_ptr, val_ptr, idx_ptr, vocab, stride_l, num_chunks,
                          K: tl.constexpr, BLOCK_K: tl.constexpr, CHUNK_SIZE: tl.constexpr, HAS_ROW_IDS: tl.constexpr):
        """The top K of chunk ``program_id(1)`` of row ``program_id(0)`` (or of row_ids[program_id(0)]), descending,
        into candidates [programs, num_chunks * BLOCK_K] (values, vocabulary indices; slots past K hold -inf)."""
        r = tl.program_id(0)
        chunk = tl.program_id(1)
        if HAS_ROW_IDS:
            row = tl.load(row_ids_ptr + r)
        else:
            row = r
        cols = tl.arange(0, CHUNK_SIZE)
        offs = chunk * CHUNK_SIZE + cols
        x = tl.load(logits_ptr + row.to(tl.int64) * stride_l + offs, mask=offs < vocab, other=float("-inf"))
        slots = tl.arange(0, BLOCK_K)
        vals = tl.full([BLOCK_K], float("-inf"), tl.float32)
        idxs = tl.zeros([BLOCK_K], tl.int32)
        for j in tl.static_range(K):
            best, at = tl.max(x, axis=0, return_indices=True)  # the first of equal maxima; all -inf: index 0, valid
            vals = tl.where(slots == j, best, vals)
            idxs = tl.where(slots == j, chunk * CHUNK_SIZE + at, idxs)
            x = tl.where(cols == at, float("-inf"), x)
        base = r.to(tl.int64) * num_chunks * BLOCK_K + chunk * BLOCK_K
        tl.store(val_ptr + base + slots, vals)
        tl.store(idx_ptr + base + slots, idxs)

    @triton.jit
    def _refine_top_kernel(logits_ptr, hidden_ptr, head_ptr, row_ids_ptr, flags_ptr, val_ptr, idx_ptr,
                           stride_l, stride_h, stride_w, num_candidates, HIDDEN: tl.constexpr,
                           K: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_H: tl.constexpr,
                           HAS_ROW_IDS: tl.constexpr, HAS_FLAGS: tl.constexpr):
        """Row ``program_id(0)``'s top K among its candidates, their logits replaced by fp32 dot products of the
        hidden state and the head's rows. With flags, a row whose flag is 0 is left as it is (nothing read)."""
        r = tl.program_id(0)
        if HAS_ROW_IDS:
            row = tl.load(row_ids_ptr + r)
        else:
            row = r
        row64 = row.to(tl.int64)
        if HAS_FLAGS:
            live = tl.load(flags_ptr + row) != 0
        else:
            live = row >= 0  # always: a scalar mask like the flag's
        c = tl.arange(0, BLOCK_C)
        c_ok = (c < num_candidates) & live
        v = tl.load(val_ptr + r.to(tl.int64) * num_candidates + c, mask=c_ok, other=float("-inf"))
        ids = tl.load(idx_ptr + r.to(tl.int64) * num_candidates + c, mask=c_ok, other=0)
        slots = tl.arange(0, BLOCK_K)
        tokens = tl.zeros([BLOCK_K], tl.int32)
        for j in tl.static_range(K):
            at = tl.argmax(v, axis=0)
            tokens = tl.where(slots == j, tl.sum(tl.where(c == at, ids, 0), axis=0), tokens)
            v = tl.where(c == at, float("-inf"), v)
        k_ok = (slots < K) & live
        acc = tl.zeros([BLOCK_K, BLOCK_H], tl.float32)
        for h0 in range(0, HIDDEN, BLOCK_H):  # a model's hidden size: a constant loop
            h = h0 + tl.arange(0, BLOCK_H)
            h_ok = (h < HIDDEN) & live
            a = tl.load(hidden_ptr + row64 * stride_h + h, mask=h_ok, other=0.0).to(tl.float32)
            w = tl.load(head_ptr + tokens.to(tl.int64)[:, None] * stride_w + h[None, :],
                        mask=k_ok[:, None] & h_ok[None, :], other=0.0).to(tl.float32)
            acc += w * a[None, :]
        exact = tl.sum(acc, axis=1)
        tl.store(logits_ptr + row64 * stride_l + tokens, exact, mask=k_ok)

    @triton.jit
    def _chunk_max_kernel(logits_ptr, val_ptr, idx_ptr, vocab, stride_l, num_chunks, CHUNK_SIZE: tl.constexpr):
        row = tl.program_id(0)
        chunk = tl.program_id(1)
        offs = chunk * CHUNK_SIZE + tl.arange(0, CHUNK_SIZE)
        x = tl.load(logits_ptr + row.to(tl.int64) * stride_l + offs, mask=offs < vocab, other=float("-inf"))
        x = tl.where(x != x, float("inf"), x)  # a NaN counts as the largest, as in torch.argmax
        best, at = tl.max(x, axis=0, return_indices=True)  # the first of equal maxima
        tl.store(val_ptr + row * num_chunks + chunk, best)
        tl.store(idx_ptr + row * num_chunks + chunk, chunk * CHUNK_SIZE + at)

    @triton.jit
    def _pick_max_kernel(val_ptr, idx_ptr, out_ptr, num_chunks, BLOCK_C: tl.constexpr):
        row = tl.program_id(0)
        c = tl.arange(0, BLOCK_C)
        ok = c < num_chunks
        v = tl.load(val_ptr + row * num_chunks + c, mask=ok, other=float("-inf"))
        ids = tl.load(idx_ptr + row * num_chunks + c, mask=ok, other=0)
        at = tl.argmax(v, axis=0)  # the first chunk holding the max: the row's first maximal index
        tl.store(out_ptr + row, tl.sum(tl.where(c == at, ids, 0), axis=0).to(tl.int64))


def refine_top_logits_(logits: torch.Tensor, hidden: torch.Tensor, head_rows: torch.Tensor, k: int,
                       rows: torch.Tensor | None = None, flags: torch.Tensor | None = None) -> torch.Tensor:
    """In place on fp32 ``logits`` [n, vocab] (rows contiguous): the ``k`` largest of each row become the fp32 dot
    products of ``hidden`` [n, h] with those tokens' rows of ``head_rows`` [vocab, h]. ``rows``: only those rows
    (int64 indices); ``flags`` ([n], nonzero = refine): only the flagged ones, the grid covering all (CUDA graphs,
    where the set changes per replay). Returns ``logits``."""
    n, vocab = logits.shape
    assert logits.dtype == torch.float32 and logits.stride(1) == 1 and hidden.stride(1) == 1 and head_rows.stride(1) == 1
    programs = n if rows is None else rows.shape[0]
    k = min(k, vocab)
    if programs == 0 or k == 0:
        return logits
    num_chunks = triton.cdiv(vocab, CHUNK)
    block_k = pow2(k)
    values = torch.empty(programs, num_chunks * block_k, dtype=torch.float32, device=logits.device)
    ids = torch.empty(programs, num_chunks * block_k, dtype=torch.int32, device=logits.device)
    row_ids = rows if rows is not None else values  # an unread placeholder without rows
    _chunk_top_kernel[(programs, num_chunks)](logits, row_ids, values, ids, vocab, logits.stride(0), num_chunks,
                                              K=k, BLOCK_K=block_k, CHUNK_SIZE=CHUNK, HAS_ROW_IDS=rows is not None)
    hidden_size = hidden.shape[1]
    _refine_top_kernel[(programs,)](
        logits, hidden, head_rows, row_ids, flags if flags is not None else values, values, ids,
        logits.stride(0), hidden.stride(0), head_rows.stride(0), num_chunks * block_k, HIDDEN=hidden_size, K=k,
        BLOCK_K=block_k, BLOCK_C=pow2(num_chunks * block_k), BLOCK_H=min(256, pow2(hidden_size)),
        HAS_ROW_IDS=rows is not None, HAS_FLAGS=flags is not None)
    return logits


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """int64 [n]: each row's first maximal index, as ``logits.argmax(dim=-1)`` (fp32 [n, vocab], rows contiguous)."""
    n, vocab = logits.shape
    assert logits.dtype == torch.float32 and logits.stride(1) == 1
    out = torch.empty(n, dtype=torch.int64, device=logits.device)
    if n == 0:
        return out
    num_chunks = triton.cdiv(vocab, CHUNK)
    values = torch.empty(n, num_chunks, dtype=torch.float32, device=logits.device)
    ids = torch.empty(n, num_chunks, dtype=torch.int32, device=logits.device)
    _chunk_max_kernel[(n, num_chunks)](logits, values, ids, vocab, logits.stride(0), num_chunks, CHUNK_SIZE=CHUNK)
    _pick_max_kernel[(n,)](values, ids, out, num_chunks, BLOCK_C=pow2(num_chunks))
    return out
