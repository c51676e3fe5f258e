"""The Triton paged-attention kernel against the torch reference, on random caches and block tables.

Without CUDA it runs in Triton's interpreter (numpy on the CPU): the same kernel source, the same
masks and loop bounds; the GPU run of the same checks is tests/gpu/test_graphs_device.py."""

from __future__ import annotations

import itertools

import pytest
import torch

from tokenfleet.models import triton_attention
from tokenfleet.models.attention import PagedQueries, TorchPagedAttention

pytestmark = pytest.mark.skipif(not triton_attention.available(), reason="triton is not installed")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # no CUDA: the interpreter (tests/conftest.py)


def random_step(counts: list[int], contexts: list[int], heads: int, kv_heads: int, head_dim: int, block_size: int,
                dtype: torch.dtype, seed: int, num_blocks: int = 64) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor,
                                                                                 PagedQueries]:
    g = torch.Generator().manual_seed(seed)
    width = max(-(-c // block_size) for c in contexts) + 1  # one spare column: the kernel must not read it
    num_blocks = max(num_blocks, len(counts) * width)
    k_cache = torch.randn(kv_heads, num_blocks, block_size, head_dim, generator=g).to(DEVICE, dtype)
    v_cache = torch.randn(kv_heads, num_blocks, block_size, head_dim, generator=g).to(DEVICE, dtype)
    table = torch.randperm(num_blocks, generator=g)[: len(counts) * width].view(len(counts), width)
    starts = [0]
    for c in counts:
        starts.append(starts[-1] + c)
    q = torch.randn(starts[-1], heads, head_dim, generator=g).to(DEVICE, dtype)
    meta = PagedQueries(block_table=table.to(DEVICE), context_lens=torch.tensor(contexts, device=DEVICE),
                        query_start=torch.tensor(starts, device=DEVICE), num_tokens=starts[-1],
                        max_query_len=max(counts))
    return q, k_cache, v_cache, meta


CASES = {
    # counts (query rows per request), context lengths, heads, kv heads, head dim, block size, window
    "decode-gqa3": ([1, 1, 1], [1, 37, 160], 9, 3, 64, 16, 0),
    "decode-gqa4-hd128": ([1, 1], [129, 64], 8, 2, 128, 16, 0),
    "verify": ([3, 1, 5], [40, 17, 100], 9, 3, 64, 16, 0),
    "prefix-prefill": ([1, 70], [50, 150], 4, 2, 64, 16, 0),
    "window": ([1, 4, 40], [90, 120, 200], 4, 1, 32, 8, 24),
    "mha-odd-head": ([2, 1], [33, 5], 2, 2, 48, 16, 0),
}


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_triton_paged_attention_matches_reference(case, dtype):
    counts, contexts, heads, kv_heads, head_dim, block_size, window = CASES[case]
    q, k_cache, v_cache, meta = random_step(counts, contexts, heads, kv_heads, head_dim, block_size, dtype,
                                            seed=sum(map(ord, case)))
    meta.window = window
    ref = TorchPagedAttention()(q, k_cache, v_cache, meta).float()
    # P.V's operands (envs.attn_pv): on a GPU in bf16 each way; the interpreter computes them all in fp32
    pvs = ("fp32", "tf32x3", "model") if torch.device(DEVICE).type == "cuda" and dtype == torch.bfloat16 else ("fp32",)
    # one program per request x KV head; partitions of 64 keys (as many as the table holds); three partitions per
    # request x KV head, each spanning a third of the context in whole tiles; split ones merged by a second kernel
    # or by their last partition (envs.attn_merge)
    splits = (0, 1 << 20, 3 * len(counts) * kv_heads)
    runs = [(split, pv, merge) for split, pv in itertools.product(splits, pvs)
            for merge in (("kernel", "fused") if split == splits[-1] else ("kernel",))]
    for split, pv, merge in runs:
        attend = triton_attention.TritonPagedAttention(block_n=32, prefill_tokens=8, partition=64, split_below=split,
                                                       pv=pv, merge=merge)
        out = attend(q, k_cache, v_cache, meta)
        assert out.dtype == dtype and out.shape == q.shape
        assert torch.isfinite(out.float()).all()
        err = ((out.float() - ref).norm() / ref.norm()).item()
        # fp32: same math in another order; bf16: both accumulate in fp32 and round once at the output (P rounded
        # to bf16 too with pv "model")
        assert err < (1e-5 if dtype == torch.float32 else 8e-3 if pv != "model" else 1.2e-2), (split, pv, merge, err)


def test_triton_kernel_ignores_padding_rows_and_stale_table_columns():
    """Graph replay pads the batch: padding requests (context 1 on a scratch block) and table columns past a
    request's context hold anything; the real rows' outputs must not change."""
    q, k_cache, v_cache, meta = random_step([1, 1], [20, 45], 9, 3, 64, 16, torch.float32, seed=5)
    attend = triton_attention.TritonPagedAttention(block_n=16, partition=32, split_below=1 << 20)  # split, too
    before = attend(q, k_cache, v_cache, meta)
    table = meta.block_table.clone()
    table[0, 2:] = 63  # past request 0's two blocks
    padded = PagedQueries(block_table=torch.cat([table, torch.full_like(table[:1], 63)]),
                          context_lens=torch.cat([meta.context_lens, torch.ones_like(meta.context_lens[:1])]),
                          query_start=torch.cat([meta.query_start, meta.query_start[-1:] + 1]),
                          num_tokens=3, max_query_len=1)
    after = attend(torch.cat([q, torch.randn_like(q[:1])]), k_cache, v_cache, padded)
    assert torch.equal(after[:2], before)


@pytest.mark.parametrize("merge", ["kernel", "fused"])
@pytest.mark.parametrize("split_below", [1 << 20, 2 * 3], ids=["64-key-partitions", "two-partitions"])
def test_split_decode_over_a_wide_table_merges_only_the_partitions_that_hold_keys(split_below, merge):
    """A captured graph's table is as wide as the longest context the model allows (128k tokens: 8k columns), while
    the contexts decoded are short. The grid's partitions cover the table's width (or fill the GPU); most find no
    keys and exit without writing their state, and the merge must fold exactly the ones that wrote. Their state
    buffers start as NaN here, so reading one that was never written shows."""
    q, k_cache, v_cache, meta = random_step([1, 1, 1], [5, 100, 300], 6, 3, 64, 16, torch.float32, seed=11,
                                            num_blocks=200)
    wide = torch.cat([meta.block_table, torch.randint(0, 200, (3, 40), device=DEVICE)], dim=1)  # 61 columns
    meta = PagedQueries(block_table=wide, context_lens=meta.context_lens, query_start=meta.query_start,
                        num_tokens=meta.num_tokens, max_query_len=1)
    ref = TorchPagedAttention()(q, k_cache, v_cache, meta)
    empty, empty_like = torch.empty, torch.empty_like

    def poisoned(*args, **kwargs):
        return empty(*args, **kwargs).fill_(float("nan"))

    def poisoned_like(*args, **kwargs):
        return empty_like(*args, **kwargs).fill_(float("nan"))

    attend = triton_attention.TritonPagedAttention(block_n=16, partition=32, split_below=split_below, merge=merge)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(triton_attention.torch, "empty", poisoned)
        patch.setattr(triton_attention.torch, "empty_like", poisoned_like)
        out = attend(q, k_cache, v_cache, meta)
    assert torch.isfinite(out).all()
    assert ((out - ref).norm() / ref.norm()).item() < 1e-5


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_a_work_list_runs_only_the_listed_tiles(dtype):
    """``PagedQueries.work``: (request, tile) programs instead of every request x tile (a mixed-step graph's fixed
    grid, padded with request -1): the same output as the full grid, whatever order the list takes."""
    q, k_cache, v_cache, meta = random_step([1, 70, 3, 1], [50, 150, 40, 9], 8, 2, 64, 16, dtype, seed=21)
    attend = triton_attention.TritonPagedAttention(block_n=32, prefill_tokens=8, split_below=0)
    tokens = attend.rows_per_program(8, 2, meta.max_query_len)
    pairs = [(r, t) for r, count in enumerate([1, 70, 3, 1]) for t in range(-(-count // tokens))]
    assert len(pairs) < 4 * -(-70 // tokens)  # fewer programs than the full grid's
    pairs = pairs[::-1] + [(-1, 0)] * 5
    meta.work = torch.tensor(pairs, device=DEVICE).t().contiguous()
    ref = TorchPagedAttention()(q, k_cache, v_cache, meta).float()
    out = attend(q, k_cache, v_cache, meta).float()
    meta.work = None
    full = attend(q, k_cache, v_cache, meta).float()
    assert torch.equal(out, full)
    assert ((out - ref).norm() / ref.norm()).item() < (1e-5 if dtype == torch.float32 else 8e-3)


def test_an_unknown_pv_mode_is_refused(monkeypatch):
    with pytest.raises(ValueError, match="TOKENFLEET_ATTN_PV"):
        triton_attention.TritonPagedAttention(pv="fp16")
    monkeypatch.setenv("TOKENFLEET_ATTN_PV", "int8")
    with pytest.raises(ValueError, match="tf32x3"):
        triton_attention.TritonPagedAttention()
    monkeypatch.setenv("TOKENFLEET_ATTN_PV", "tf32x3")
    assert triton_attention.TritonPagedAttention().pv == "tf32x3"


def test_fused_merges_leave_their_counters_at_zero_for_the_next_call():
    """The last partition of each request x KV head to finish merges and resets its arrival count: the next layer
    (or graph replay) finds zeros, and the same inputs give the same output again; an unsplit call touches none."""
    q, k_cache, v_cache, meta = random_step([1, 1, 1], [5, 100, 300], 6, 3, 64, 16, torch.float32, seed=12,
                                            num_blocks=120)
    attend = triton_attention.TritonPagedAttention(block_n=16, partition=32, split_below=1 << 10, merge="fused")
    first = attend(q, k_cache, v_cache, meta)
    counters = attend._counters[q.device]
    assert counters.numel() >= 9 and int(counters.abs().sum()) == 0
    assert torch.equal(attend(q, k_cache, v_cache, meta), first)
    reference = triton_attention.TritonPagedAttention(block_n=16, partition=32, split_below=1 << 10, merge="kernel")
    assert ((first - reference(q, k_cache, v_cache, meta)).abs().max()).item() < 1e-6


def test_an_unknown_merge_is_refused(monkeypatch):
    monkeypatch.setenv("TOKENFLEET_ATTN_MERGE", "atomic")
    with pytest.raises(ValueError, match="TOKENFLEET_ATTN_MERGE"):
        triton_attention.TritonPagedAttention()


def test_fused_merges_agree_with_the_merge_kernel_call_after_call():
    """On a GPU the partitions race to be last: many calls, each the merge kernel's output (the same states folded in
    the same order; a stale or missing state would be far off). The interpreter runs programs in turn: one call."""
    contexts = [700, 33, 260, 1, 515, 128] if DEVICE == "cuda" else [200, 33, 1, 130]
    q, k_cache, v_cache, meta = random_step([1] * len(contexts), contexts, 8, 2, 64, 16, torch.float32, seed=13,
                                            num_blocks=300)
    fused = triton_attention.TritonPagedAttention(block_n=16, partition=32, split_below=1 << 10, merge="fused")
    kernel = triton_attention.TritonPagedAttention(block_n=16, partition=32, split_below=1 << 10, merge="kernel")
    expected = kernel(q, k_cache, v_cache, meta)
    for _ in range(200 if DEVICE == "cuda" else 1):
        torch.testing.assert_close(fused(q, k_cache, v_cache, meta), expected, rtol=1e-6, atol=1e-6)
    assert int(fused._counters[q.device].abs().sum()) == 0
