"""Native CPU kernels (models/csrc) against the pure-torch path they replace, and the fallback without them.

Attention: the AVX-512 and the portable build of csrc/paged_attention.c against TorchPagedAttention (fp32
math on the same bf16 caches): decode rows, several rows per request (speculative verification),
prefill chunks with and without earlier context, ragged block tables. Layer ops: bitwise equal to the
torch ops (same bf16 rounding points; the RMS sum in torch's order). Without a compiler (or with
TOKENFLEET_NATIVE_KERNELS=0) the model selects the torch path.
"""

from __future__ import annotations

import pytest
import torch

from tokenfleet.models import native
from tokenfleet.models.attention import (
    NativePagedAttention,
    PagedQueries,
    TorchPagedAttention,
    _prefill_attention,
)
from tokenfleet.models.config import ModelConfig
from tokenfleet.models.layer_ops import NativeLayerOps, TorchLayerOps, select_layer_ops
from tokenfleet.models.loader import select_attention

CPU = torch.device("cpu")
needs_compiler = pytest.mark.skipif(native.compiler() is None, reason="no C compiler: the torch path is what runs")

KV_HEADS, HEADS, BLOCK, NUM_BLOCKS = 3, 9, 16, 256
CASES = {  # (context lengths, query rows) per request
    "decode": ([1, 17, 300, 64], [1, 1, 1, 1]),
    "spec-rows": ([40, 33, 5], [3, 5, 5]),
    "prefill-fresh": ([286], [286]),
    "prefill-with-context": ([300, 120], [100, 120]),
    "mixed": ([77, 1, 200, 35], [1, 1, 64, 3]),
}


def paged_case(lens: list[int], rows: list[int], head_dim: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    k_cache = torch.randn(KV_HEADS, NUM_BLOCKS, BLOCK, head_dim, generator=g).bfloat16()
    v_cache = torch.randn(KV_HEADS, NUM_BLOCKS, BLOCK, head_dim, generator=g).bfloat16()
    max_blocks = max(-(-n // BLOCK) for n in lens)
    table = torch.randperm(NUM_BLOCKS, generator=g)[: len(lens) * max_blocks].view(len(lens), max_blocks)
    starts = torch.tensor([0, *torch.tensor(rows).cumsum(0).tolist()])
    meta = PagedQueries(table.contiguous(), torch.tensor(lens), starts, int(starts[-1]), max(rows))
    q = (torch.randn(meta.num_tokens, HEADS, head_dim, generator=g) * 2).bfloat16()
    return q, k_cache, v_cache, meta


def kernels() -> dict[str, NativePagedAttention]:
    out = {}
    for name, defines in (("native", ()), ("portable", ("TF_PORTABLE_ONLY",))):
        lib = native.load("paged_attention", defines)
        assert lib is not None, "a compiler is present but the kernel did not build"
        out[name] = NativePagedAttention(lib)
    return out


@needs_compiler
@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("head_dim", [64, 32])  # 64 takes the AVX-512 path where the CPU has it
def test_paged_attention_kernels_match_the_torch_reference(case, head_dim):
    lens, rows = CASES[case]
    q, k_cache, v_cache, meta = paged_case(lens, rows, head_dim, seed=len(case))
    expected = TorchPagedAttention()(q, k_cache, v_cache, meta).float()
    for name, kernel in kernels().items():
        got = kernel(q, k_cache, v_cache, meta)
        assert got.dtype == torch.bfloat16 and got.shape == q.shape
        # one bf16 rounding of an fp32 result: within 2**-8 relative, plus a little for the sums' order
        torch.testing.assert_close(got.float(), expected, rtol=8e-3, atol=2e-3, msg=f"{name} kernel, {case}")


@needs_compiler
def test_native_prefill_is_closer_to_fp32_than_bf16_sdpa():
    """The kernel's fp32 accumulation is at least as accurate as the SDPA path it replaces for prefill."""
    q, k_cache, v_cache, meta = paged_case([286], [286], 64, seed=5)
    exact = TorchPagedAttention()(q, k_cache, v_cache, meta).float()
    from tokenfleet.models.attention import _gather

    ctx_k = _gather(k_cache, meta.block_table[0])[:, :286]
    ctx_v = _gather(v_cache, meta.block_table[0])[:, :286]
    sdpa = _prefill_attention(q, ctx_k, ctx_v, 0).float()
    ours = kernels()["native"](q, k_cache, v_cache, meta).float()
    assert (ours - exact).abs().mean() <= (sdpa - exact).abs().mean()


@needs_compiler
@pytest.mark.parametrize("kernel_name", ["native", "portable"])
def test_a_row_attends_to_the_same_bits_alone_or_inside_a_prefill_chunk(kernel_name):
    """Batch invariance: a prefill chunk's row (many query vectors per work item: the packed-tile scores)
    equals that row attended alone as a decode row (three vectors: the lane-sum scores), bit for bit, so
    a request's output does not depend on how its tokens were batched."""
    q, k_cache, v_cache, meta = paged_case([300, 120], [100, 120], 64, seed=7)
    kernel = kernels()[kernel_name]
    whole = kernel(q, k_cache, v_cache, meta)
    for request, row in ((0, 0), (0, 57), (0, 99), (1, 0), (1, 64), (1, 119)):
        start = int(meta.query_start[request])
        rows = int(meta.query_start[request + 1]) - start
        context = int(meta.context_lens[request]) - rows + row + 1  # keys that row sees
        alone = PagedQueries(meta.block_table[request: request + 1], torch.tensor([context]), torch.tensor([0, 1]), 1, 1)
        got = kernel(q[start + row: start + row + 1].contiguous(), k_cache, v_cache, alone)
        assert torch.equal(got[0], whole[start + row]), f"request {request}, row {row}"


@needs_compiler
def test_inconsistent_metadata_is_refused_not_read_out_of_bounds():
    q, k_cache, v_cache, meta = paged_case([40], [4], 64, seed=1)
    bad = PagedQueries(meta.block_table, torch.tensor([3]), meta.query_start, 4, 4)  # fewer keys than query rows
    with pytest.raises(ValueError, match="inconsistent"):
        kernels()["native"](q, k_cache, v_cache, bad)
    too_long = PagedQueries(meta.block_table, torch.tensor([10_000]), meta.query_start, 4, 4)  # beyond the table
    with pytest.raises(ValueError, match="inconsistent"):
        kernels()["native"](q, k_cache, v_cache, too_long)


def tiny_config(**overrides) -> ModelConfig:
    raw = dict(vocab_size=100, hidden_size=576, intermediate_size=1536, num_hidden_layers=1, num_attention_heads=HEADS,
               num_key_value_heads=KV_HEADS, max_position_embeddings=4096, rms_norm_eps=1e-5, rope_theta=100000.0)
    raw.update(overrides)
    return ModelConfig.from_dict(raw)


@needs_compiler
def test_layer_ops_are_bitwise_equal_to_the_torch_ops():
    from tokenfleet.models.attention import ForwardBatch
    from tokenfleet.models.llama import rope_inv_freq

    config = tiny_config()
    ops, ref = select_layer_ops(config, torch.bfloat16, CPU), TorchLayerOps(config)
    assert isinstance(ops, NativeLayerOps)
    g = torch.Generator().manual_seed(0)
    tokens, hidden = 37, config.hidden_size
    residual = (torch.randn(tokens, hidden, generator=g) * 3).bfloat16()
    delta = torch.randn(tokens, hidden, generator=g).bfloat16()
    weight = (torch.rand(hidden, generator=g) + 0.5).bfloat16()
    for d in (delta, None):
        got, want = ops.add_rms_norm(residual.clone(), d, weight, 1e-5), ref.add_rms_norm(residual.clone(), d, weight, 1e-5)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    gate_up = (torch.randn(tokens, 2 * config.intermediate_size, generator=g) * 4).bfloat16()
    assert torch.equal(ops.silu_mul(gate_up), ref.silu_mul(gate_up))
    angles = torch.arange(config.max_position_embeddings).float()[:, None] * rope_inv_freq(config)[None, :]
    emb = torch.cat((angles, angles), dim=-1)
    cos, sin = emb.cos().bfloat16(), emb.sin().bfloat16()
    width = (config.num_heads + 2 * config.num_kv_heads) * config.head_dim
    qkv = torch.randn(tokens, width, generator=g).bfloat16()
    positions = torch.randint(0, 4000, (tokens,), generator=g)
    slots = torch.randperm(64 * BLOCK, generator=g)[:tokens]
    batch = ForwardBatch(positions, slots, positions[:1], PagedQueries(slots[None, :1], slots[:1], slots[:2], 1, 1))
    caches = [torch.zeros(config.num_kv_heads, 64, BLOCK, config.head_dim).bfloat16() for _ in range(4)]
    got = ops.rope_store_kv(qkv, batch, cos, sin, caches[0], caches[1])
    want = ref.rope_store_kv(qkv, batch, cos, sin, caches[2], caches[3])
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])


def test_without_a_compiler_the_torch_path_is_selected(monkeypatch):
    monkeypatch.setattr(native, "compiler", lambda: None)
    native.load.cache_clear()
    try:
        assert isinstance(select_attention(torch.bfloat16, CPU), TorchPagedAttention)
        assert isinstance(select_layer_ops(tiny_config(), torch.bfloat16, CPU), TorchLayerOps)
    finally:
        native.load.cache_clear()


def test_native_kernels_can_be_switched_off(monkeypatch):
    monkeypatch.setenv("TOKENFLEET_NATIVE_KERNELS", "0")
    native.load.cache_clear()
    try:
        assert native.load("paged_attention") is None
        assert isinstance(select_attention(torch.bfloat16, CPU), TorchPagedAttention)
    finally:
        native.load.cache_clear()


@needs_compiler
def test_fp32_takes_the_fp32_kernels_and_torch_kernels_takes_the_reference(monkeypatch):
    """fp32 (the CPU default) runs the native kernels' fp32 code, never the bf16 code; TOKENFLEET_KERNELS=torch runs
    the torch reference in every dtype; fp32 with an FP8 cache has no native kernel."""
    from tokenfleet.models.linear import NativeFewRows, select_linear

    attend = select_attention(torch.float32, CPU)
    assert isinstance(attend, NativePagedAttention) and attend.dtype == torch.float32
    assert select_layer_ops(tiny_config(), torch.float32, CPU).dtype == torch.float32
    assert isinstance(select_linear(torch.float32, CPU).few_rows, NativeFewRows)
    assert isinstance(select_attention(torch.float32, CPU, "fp8"), TorchPagedAttention)
    monkeypatch.setenv("TOKENFLEET_KERNELS", "torch")
    for dtype in (torch.float32, torch.bfloat16):
        assert isinstance(select_attention(dtype, CPU), TorchPagedAttention)
        assert isinstance(select_layer_ops(tiny_config(), dtype, CPU), TorchLayerOps)
    assert select_linear(torch.float32, CPU).few_rows is None


@needs_compiler
@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("head_dim", [64, 256])  # 256: Gemma 3's
def test_sliding_window_kernels_match_the_torch_reference_and_never_read_the_null_block(case, head_dim):
    """With a window, rows see only their last ``window`` keys; blocks entirely before every row's window
    are the null block (0) in a sliding-window group's table. Here the null block holds NaN: a kernel
    that read it would return NaN (the torch reference reads it masked, so it gets a zero block)."""
    lens, rows = CASES[case]
    window = 37
    q, k_cache, v_cache, meta = paged_case(lens, rows, head_dim, seed=len(case) + 11)
    table = meta.block_table.clone()
    table[table == 0] = NUM_BLOCKS - 1 if (table == NUM_BLOCKS - 1).sum() == 0 else table.max()  # 0 only as null
    for r, (length, n) in enumerate(zip(lens, rows)):
        table[r, : max(0, length - n + 1 - window) // BLOCK] = 0
    meta = PagedQueries(table, meta.context_lens, meta.query_start, meta.num_tokens, meta.max_query_len, window)
    k_cache[:, 0], v_cache[:, 0] = 0, 0
    expected = TorchPagedAttention()(q, k_cache, v_cache, meta).float()
    k_cache[:, 0], v_cache[:, 0] = float("nan"), float("nan")
    for name, kernel in kernels().items():
        got = kernel(q, k_cache, v_cache, meta)
        torch.testing.assert_close(got.float(), expected, rtol=8e-3, atol=2e-3, msg=f"{name} kernel, {case}")


def test_windowed_sdpa_prefill_matches_a_brute_force_mask():
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(n, h, 16, generator=g) for n, h in ((20, 4), (30, 2), (30, 2)))
    out = _prefill_attention(q, k.transpose(0, 1), v.transpose(0, 1), 10, window=7)
    for i in range(20):
        keys = range(max(0, 10 + i - 6), 10 + i + 1)
        for h in range(4):
            s = torch.stack([q[i, h] @ k[j, h // 2] for j in keys]) * 16**-0.5
            ref = torch.softmax(s, 0) @ torch.stack([v[j, h // 2] for j in keys])
            torch.testing.assert_close(out[i, h], ref, rtol=1e-4, atol=1e-5)
