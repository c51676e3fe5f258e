"""FP8 KV cache (models.kv_fp8): the packed rows' rounding, writes at slots, the torch reference reading them, and
the Triton kernels (attention and the RoPE + KV write) against that reference.

Without CUDA the Triton kernels run in Triton's interpreter (tests/conftest.py); tests/gpu runs them on a GPU."""

from __future__ import annotations

import itertools

import pytest
import torch

from tests.unit.models.test_native_kernels import CASES as NATIVE_CASES
from tests.unit.models.test_native_kernels import paged_case
from tests.unit.models.test_triton_attention import CASES, random_step
from tokenfleet.models import kv_fp8, native, triton_attention, triton_ops
from tokenfleet.models.attention import (
    ForwardBatch,
    NativePagedAttention,
    PagedQueries,
    PrefillSpan,
    TorchPagedAttention,
    paged_attention,
)
from tokenfleet.models.layer_ops import TorchLayerOps
from tokenfleet.models.loader import select_attention

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
needs_triton = pytest.mark.skipif(not triton_attention.available(), reason="triton is not installed")


def packed(cache: torch.Tensor) -> torch.Tensor:
    """A [kv_heads, blocks, block_size, head_dim] cache as FP8 rows."""
    return kv_fp8.quantize(cache)


def test_rows_round_to_e4m3_with_a_scale_per_row():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(6, 4, 64, generator=g) * torch.logspace(-3, 3, 6)[:, None, None]  # rows of very different size
    x[2, 1] = 0.0  # an all-zero row
    x[3, 0, 5] = 50.0  # an outlier channel
    rows = kv_fp8.quantize(x)
    assert rows.dtype == torch.uint8 and rows.shape == (6, 4, 80)
    back = kv_fp8.dequantize(rows)
    amax = x.abs().amax(-1, keepdim=True)
    scale = amax.clamp(min=kv_fp8.MIN_AMAX) / 448.0
    # rounded to nearest: within half a step of e4m3 (3 mantissa bits: 1/16 of the value for normals; subnormals
    # are multiples of 2^-9, half of that) in units of the row's scale; the row's largest value becomes 448 exactly
    err = (back - x).abs() / scale
    assert (err <= torch.maximum((x.abs() / scale) / 16, torch.tensor(2.0**-10)) * (1 + 1e-6)).all()
    assert torch.allclose(back.abs().amax(-1, keepdim=True), amax, rtol=1e-6)
    assert torch.equal(back[2, 1], torch.zeros(64))
    scales = rows[..., 64:68].contiguous().view(torch.float32)
    assert not rows[..., 68:].any()  # 16-byte rows: the scale, then zeros
    assert torch.equal(scales, amax.clamp(min=kv_fp8.MIN_AMAX) / 448.0)
    for head_dim in (66, 72):  # 72: a multiple of 4 (the unpadded rows of before), not of 16
        with pytest.raises(ValueError, match="divisible by 16"):
            kv_fp8.row_width(head_dim)
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        kv_fp8.check_kv_cache_dtype("int8")


def test_an_fp8_cache_on_a_gpu_without_e4m3_conversions_is_refused_at_load(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100")
    with pytest.raises(ValueError, match="8.9 or newer.*A100 is 8.0"):
        kv_fp8.check_device("fp8", torch.device("cuda"))
    kv_fp8.check_device("", torch.device("cuda"))  # a bf16 cache: anywhere
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    kv_fp8.check_device("fp8", torch.device("cuda"))


def test_store_writes_only_its_slots_and_gather_reads_them_back():
    g = torch.Generator().manual_seed(1)
    kv_heads, blocks, block_size, head_dim = 2, 5, 4, 32
    cache = torch.zeros(kv_heads, blocks, block_size, kv_fp8.row_width(head_dim), dtype=torch.uint8)
    x = torch.randn(3, kv_heads, head_dim, generator=g).to(torch.bfloat16)
    slots = torch.tensor([6, 0, 17])  # block 1 offset 2, block 0 offset 0, block 4 offset 1
    kv_fp8.store(cache, slots, x)
    got = kv_fp8.gather(cache, torch.tensor([1, 0, 4]), torch.float32)  # [kv_heads, 12, head_dim]
    expect = kv_fp8.dequantize(kv_fp8.quantize(x)).transpose(0, 1)  # [kv_heads, 3, head_dim]
    assert torch.equal(got[:, [2, 4, 9]], expect)
    untouched = torch.ones(kv_heads, blocks * block_size, dtype=torch.bool)
    untouched[:, slots] = False
    assert (cache.view(kv_heads, -1, cache.shape[-1])[untouched] == 0).all()
    assert kv_fp8.gather(cache, torch.tensor([1]), torch.bfloat16).dtype == torch.bfloat16


@pytest.mark.parametrize("case", ["decode-gqa3", "verify", "window"])
def test_reference_attention_over_fp8_rows_is_attention_over_their_values(case):
    """The torch reference reads an FP8 cache as exactly the values it holds."""
    counts, contexts, heads, kv_heads, head_dim, block_size, window = CASES[case]
    q, k_cache, v_cache, meta = random_step(counts, contexts, heads, kv_heads, head_dim, block_size, torch.float32,
                                            seed=7)
    meta.window = window
    k8, v8 = packed(k_cache.cpu()), packed(v_cache.cpu())
    out = TorchPagedAttention()(q.cpu(), k8, v8, _cpu(meta))
    ref = TorchPagedAttention()(q.cpu(), kv_fp8.dequantize(k8), kv_fp8.dequantize(v8), _cpu(meta))
    assert torch.equal(out, ref)
    exact = TorchPagedAttention()(q.cpu(), k_cache.cpu(), v_cache.cpu(), _cpu(meta))
    err = ((out - exact).norm() / exact.norm()).item()
    assert 0 < err < 0.05  # the FP8 rounding shows, and stays small


def test_a_fresh_prefill_chunk_reads_its_own_keys_as_the_cache_stores_them():
    """A prompt's first chunk (SDPA over its own K/V) and the same tokens read back from the cache as a prefix give
    the same attention: prefix-cache hits and misses see the same FP8 values."""
    g = torch.Generator().manual_seed(3)
    n, heads, kv_heads, head_dim, block_size = 12, 4, 2, 32, 4
    q = torch.randn(n, heads, head_dim, generator=g)
    k = torch.randn(n, kv_heads, head_dim, generator=g)
    v = torch.randn(n, kv_heads, head_dim, generator=g)
    k_cache = torch.zeros(kv_heads, 4, block_size, kv_fp8.row_width(head_dim), dtype=torch.uint8)
    v_cache = torch.zeros_like(k_cache)
    slots = torch.arange(n)
    kv_fp8.store(k_cache, slots, k)
    kv_fp8.store(v_cache, slots, v)
    rows = torch.arange(n)
    fresh = ForwardBatch(positions=rows, slot_mapping=slots, logits_indices=rows[-1:],
                         prefills=[PrefillSpan(0, n, n, None)])
    cached = ForwardBatch(positions=rows, slot_mapping=slots, logits_indices=rows[-1:],
                          prefills=[PrefillSpan(0, n, n, torch.arange(3))])  # the same tokens as a cached prefix
    attend = TorchPagedAttention()
    a = paged_attention(q, k, v, k_cache, v_cache, fresh, attend)
    b = paged_attention(q, k, v, k_cache, v_cache, cached, attend)
    assert torch.allclose(a, b, rtol=1e-5, atol=1e-6)
    unrounded = paged_attention(q, k, v, torch.zeros(kv_heads, 4, block_size, head_dim), torch.zeros(kv_heads, 4,
                                block_size, head_dim), fresh, attend)
    assert not torch.allclose(a, unrounded, rtol=1e-5, atol=1e-6)


@pytest.mark.skipif(native.compiler() is None, reason="no C compiler: the torch path is what runs")
@pytest.mark.parametrize("case", sorted(NATIVE_CASES))
@pytest.mark.parametrize("head_dim", [64, 48])
def test_native_kernel_over_fp8_rows_matches_the_reference(case, head_dim):
    """csrc/paged_attention.c's FP8 variant (CPU, bf16 queries): decode rows, speculative rows, prefill chunks with
    and without context, against the torch reference over the same rows."""
    lens, rows = NATIVE_CASES[case]
    q, k_cache, v_cache, meta = paged_case(lens, rows, head_dim, seed=11)
    k8, v8 = packed(k_cache), packed(v_cache)
    assert isinstance(select_attention(torch.bfloat16, torch.device("cpu"), "fp8"), NativePagedAttention)
    ref = TorchPagedAttention()(q, k8, v8, meta)
    # the build for this CPU (AVX-512 for head_dim 64 where it has AVX512-BF16) and the portable C one
    for defines in ((), ("TF_PORTABLE_ONLY",)):
        attend = NativePagedAttention(native.load("paged_attention", defines), fp8=True)
        out = attend(q, k8, v8, meta)
        assert out.dtype == torch.bfloat16
        err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
        assert err < 4e-3, (defines, err)  # both fp32 inside; each rounds once to bf16 at the output
        windowed = PagedQueries(meta.block_table, meta.context_lens, meta.query_start, meta.num_tokens,
                                meta.max_query_len, window=24)
        want = TorchPagedAttention()(q, k8, v8, windowed).float()
        err = ((attend(q, k8, v8, windowed).float() - want).norm() / want.norm()).item()
        assert err < 4e-3, (defines, err)


@pytest.mark.skipif(native.compiler() is None, reason="no C compiler: the torch path is what runs")
def test_native_kernel_reads_every_e4m3_code_exactly():
    """One key: the output is its value row, so every finite e4m3 code (subnormals and signs included) must come
    back as torch's float8_e4m3fn reads it (exact in bf16, at scale 1): head_dim 256 (the portable C path) and
    head_dim 64 in four parts (the AVX-512 path where the CPU has it; its key tiles use the same conversion)."""
    codes = torch.arange(256, dtype=torch.uint8)
    codes[codes & 0x7F == 0x7F] = 0  # e4m3fn's two NaN codes; quantized rows never hold them
    attend = NativePagedAttention(native.load("paged_attention"), fp8=True)
    meta = PagedQueries(torch.tensor([[1]]), torch.tensor([1]), torch.tensor([0, 1]), 1, 1)
    for part in codes.view(1, 256), codes.view(4, 64):
        for row_codes in part:
            hd = row_codes.numel()
            row = torch.cat([row_codes, torch.tensor([1.0]).view(torch.uint8), torch.zeros(12, dtype=torch.uint8)])
            v8 = row.view(1, 1, 1, hd + 16).expand(1, 2, 16, hd + 16).contiguous()
            out = attend(torch.ones(1, 1, hd).bfloat16(), torch.zeros_like(v8), v8, meta)
            assert torch.equal(out[0, 0].float(), row_codes.view(torch.float8_e4m3fn).float()), hd


@pytest.mark.skipif(native.compiler() is None, reason="no C compiler: the torch path is what runs")
def test_native_rope_store_writes_the_torch_version_s_fp8_bytes():
    """csrc/fused_ops.c's FP8 write (RoPE, then each K and V head row quantized): bitwise the bytes of
    kv_fp8.quantize after the torch RoPE, rows of very different sizes included (subnormal e4m3 codes, ties)."""
    from tests.unit.models.test_native_kernels import BLOCK, tiny_config
    from tokenfleet.models.layer_ops import NativeLayerOps, select_layer_ops
    from tokenfleet.models.llama import rope_inv_freq

    config = tiny_config()
    ops, ref = select_layer_ops(config, torch.bfloat16, torch.device("cpu")), TorchLayerOps(config)
    assert isinstance(ops, NativeLayerOps)
    g = torch.Generator().manual_seed(5)
    tokens = 37
    angles = torch.arange(config.max_position_embeddings).float()[:, None] * rope_inv_freq(config)[None, :]
    emb = torch.cat((angles, angles), dim=-1)
    cos, sin = emb.cos().bfloat16(), emb.sin().bfloat16()
    width = (config.num_heads + 2 * config.num_kv_heads) * config.head_dim
    magnitudes = torch.logspace(-4, 2, tokens)[:, None]  # rows from tiny to large
    qkv = (torch.randn(tokens, width, generator=g) * magnitudes * torch.rand(tokens, width, generator=g) ** 4).bfloat16()
    positions = torch.randint(0, 4000, (tokens,), generator=g)
    slots = torch.randperm(64 * BLOCK, generator=g)[:tokens]
    batch = ForwardBatch(positions, slots, positions[:1])
    shape = (config.num_kv_heads, 64, BLOCK, kv_fp8.row_width(config.head_dim))
    caches = [torch.full(shape, 7, dtype=torch.uint8) for _ in range(4)]  # the padding must be written, as zeros
    got = ops.rope_store_kv(qkv, batch, cos, sin, caches[0], caches[1])
    want = ref.rope_store_kv(qkv, batch, cos, sin, caches[2], caches[3])
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])
    values = caches[0][..., :config.head_dim]
    assert ((values & 0x78) == 0).logical_and(values & 7 != 0).any()  # some subnormal codes were written


def _cpu(meta: PagedQueries) -> PagedQueries:
    return PagedQueries(meta.block_table.cpu(), meta.context_lens.cpu(), meta.query_start.cpu(), meta.num_tokens,
                        meta.max_query_len, meta.window)


@needs_triton
@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, pytest.param(torch.float16, marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="fp16 scaled probabilities: a GPU check"))], ids=["fp32", "bf16", "fp16"])
def test_triton_attention_over_fp8_rows_matches_the_reference(case, dtype):
    counts, contexts, heads, kv_heads, head_dim, block_size, window = CASES[case]
    q, k_cache, v_cache, meta = random_step(counts, contexts, heads, kv_heads, head_dim, block_size, dtype,
                                            seed=sum(map(ord, case)) + 1)
    meta.window = window
    k8, v8 = packed(k_cache), packed(v_cache)
    ref = TorchPagedAttention()(q, k8, v8, meta).float()
    # P.V's operands (envs.attn_pv) each way on a GPU in 16-bit; the interpreter and fp32 models keep fp32 ones
    pvs = ("fp32", "tf32x3", "model") if torch.device(DEVICE).type == "cuda" and dtype != torch.float32 else ("fp32",)
    for split, pv in itertools.product((0, 1 << 20), pvs):
        attend = triton_attention.TritonPagedAttention(block_n=32, prefill_tokens=8, partition=64, split_below=split,
                                                       pv=pv)
        out = attend(q, k8, v8, meta)
        assert out.dtype == dtype and out.shape == q.shape
        err = ((out.float() - ref).norm() / ref.norm()).item()
        # the kernel scales each score column after the dot, the reference each key before it: fp32 rounding apart
        # (and P rounded to bf16 with pv "model")
        assert err < (1e-5 if dtype == torch.float32 else 8e-3 if pv != "model" else 1.2e-2), (split, pv, err)


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_triton_rope_store_quantizes_rows_as_the_torch_version(dtype):
    from tests.unit.models.test_triton_ops import CONFIG, rope_inputs

    kv_heads, head_dim, blocks, block_size = 2, 32, 6, 4
    qkv, batch, cos, sin = rope_inputs(dtype, magnitude=3.0)
    slots = batch.slot_mapping
    shape = (kv_heads, blocks, block_size, kv_fp8.row_width(head_dim))
    caches = [torch.full(shape, 7, dtype=torch.uint8, device=DEVICE) for _ in range(4)]
    q_ref, k_ref, _ = TorchLayerOps(CONFIG).rope_store_kv(qkv, batch, cos, sin, caches[0], caches[1])
    q, k, _ = triton_ops.TritonLayerOps(CONFIG).rope_store_kv(qkv, batch, cos, sin, caches[2], caches[3])
    untouched = torch.ones(kv_heads, blocks * block_size, dtype=torch.bool, device=DEVICE)
    untouched[:, slots] = False
    for mine, ref in ((caches[2], caches[0]), (caches[3], caches[1])):
        flat_mine, flat_ref = mine.view(kv_heads, -1, shape[-1]), ref.view(kv_heads, -1, shape[-1])
        assert torch.equal(flat_mine[untouched], flat_ref[untouched])  # other slots keep their bytes
        got, want = kv_fp8.dequantize(flat_mine[:, slots]), kv_fp8.dequantize(flat_ref[:, slots])
        mine_scale = flat_mine[:, slots, head_dim:head_dim + 4].contiguous().view(torch.float32)
        ref_scale = flat_ref[:, slots, head_dim:head_dim + 4].contiguous().view(torch.float32)
        assert not flat_mine[:, slots, head_dim + 4:].any()  # the row's padding: zeros, as kv_fp8.quantize writes
        # the row scales agree (rows of k as each side rounded them); values within one e4m3 step, on a GPU equal
        # almost everywhere (the interpreter's fp8 cast is not the hardware's: it halves values just under a power
        # of two, as tests/unit/models/test_triton_ops.py found for the weights' quantization)
        assert torch.allclose(mine_scale, ref_scale, rtol=1e-2 if dtype == torch.bfloat16 else 1e-6)
        within = (got - want).abs() <= want.abs() / 8 + ref_scale * 2**-6
        if got.is_cuda:
            assert within.all()
            if dtype == torch.float32:  # the same e4m3 codes almost everywhere (RoPE's fp32 rounding may move a
                # row's scale by an ulp on the GPU, which moves every dequantized value of the row, not its codes)
                codes_equal = flat_mine[:, slots, :head_dim] == flat_ref[:, slots, :head_dim]
                assert codes_equal.float().mean() > 0.99
        else:
            assert within.float().mean() > 0.9
