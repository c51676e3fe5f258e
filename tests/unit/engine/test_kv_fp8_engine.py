"""An engine with an FP8 KV cache (``kv_cache_dtype="fp8"``, models.kv_fp8) on the default model's real weights, fp32
activations (so only the cache rounds): prefix-cache hits, chunked prefill, preemption, a disaggregated hand-off
and the second KV tier give the same greedy tokens as one plain run of the same engine; the cache holds about
1.6x the tokens of a bf16 one in the same bytes (head_dim 64); its layout is its own (no block is installed across dtypes)."""

from __future__ import annotations

import asyncio

import pytest

from tests.model.helpers import greedy, make_core, run_to_completion
from tests.unit.engine.test_async_engine import chat_ids, collect, make_engine
from tests.unit.engine.test_disaggregation import GREEDY, check_idle, disaggregated, tokens
from tokenfleet.backends.torch.builder import build_engine_core
from tokenfleet.engine.config import EngineConfig
from tokenfleet.engine.kv_transfer import KVLayoutError
from tokenfleet.engine.request_spec import RequestSpec
from tokenfleet.models.tokenizer import Tokenizer

SYSTEM = "You are a patient tutor who explains physics to curious students with simple examples. " * 3


@pytest.fixture(scope="module")
def tokenizer(default_model_dir) -> Tokenizer:
    return Tokenizer(default_model_dir)


@pytest.fixture(scope="module")
def core(default_model_dir):
    return make_core(default_model_dir, kv_cache_dtype="fp8", num_threads=1)


def test_the_cache_is_packed_fp8_and_holds_1_6x_the_tokens(default_model_dir, core):
    kv = core.runner.kv
    assert kv.k.dtype.itemsize == 1 and kv.k.shape[-1] == 64 + 16
    layout = core.kv_layout()
    assert layout.dtype == "fp8_e4m3" and layout.head_dim == 64
    assert layout.block_bytes == 3 * 16 * 80  # kv heads x block size x (64 values, an fp32 scale, 12 zero bytes)
    budget = 64 << 20
    bf16 = build_engine_core(EngineConfig(model=str(default_model_dir), dtype="bfloat16", kv_cache_bytes=budget,
                                          num_threads=1))
    fp8 = build_engine_core(EngineConfig(model=str(default_model_dir), dtype="bfloat16", kv_cache_bytes=budget,
                                         num_threads=1, kv_cache_dtype="fp8"))
    ratio = fp8.scheduler.block_manager.num_blocks / bf16.scheduler.block_manager.num_blocks
    assert 1.55 < ratio < 1.62  # 128 bytes a row against 80
    assert fp8.scheduler.hash_salt != bf16.scheduler.hash_salt  # its prefix hashes never match a bf16 cache's
    assert fp8.scheduler.hash_salt.endswith("|kv-fp8-r16")  # nor those of the unpadded FP8 rows of before
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        EngineConfig(model=str(default_model_dir), kv_cache_dtype="int8")


def test_prefix_hits_chunks_and_preemption_give_the_plain_run_s_tokens(default_model_dir, core, tokenizer):
    prompt = chat_ids(tokenizer, SYSTEM + "Why is the sky blue?")
    plain = run_to_completion(core, {0: [("plain", prompt, greedy(12))]})["plain"]
    # the same prompt again: its full blocks come from the prefix cache, FP8 as they were written
    hits = core.stats.num_prefix_hit_tokens
    again = run_to_completion(core, {0: [("again", prompt, greedy(12))]})["again"]
    assert again == plain
    assert core.stats.num_prefix_hit_tokens - hits >= (len(prompt) // 16 - 1) * 16
    # chunks of 48 rows: the plain run's prefill rows take MKL's matmul, and steps of up to 32 rows the few-row one
    # (models.linear), whose fp32 sums run in another order; rounding K/V to e4m3 can turn that 1e-7 difference into a
    # whole e4m3 step of a value, so the chunks stay on MKL's matmul like the plain run
    chunked = make_core(default_model_dir, kv_cache_dtype="fp8", num_threads=1, max_prefill_chunk=48,
                        enable_prefix_caching=False)
    assert run_to_completion(chunked, {0: [("chunked", prompt, greedy(12))]})["chunked"] == plain
    # a pool where two prompts fit but not their decoding past the next block boundary: one is preempted and
    # recomputed, and each request still reads its own FP8 K/V
    longer = run_to_completion(core, {0: [("longer", prompt, greedy(24, ignore_eos=True))]})["longer"]
    assert longer[:12] == plain
    # (the ITL guard off: it would recompute the preempted prompt in chunks sized to the decoding one, off MKL's matmul)
    tight = make_core(default_model_dir, kv_cache_dtype="fp8", num_threads=1, enable_prefix_caching=False,
                      num_blocks=-(-len(prompt) // 16) * 2 + 1, itl_guard=0)
    runs = run_to_completion(tight, {0: [(f"p{i}", prompt, greedy(24, ignore_eos=True)) for i in range(3)]})
    assert tight.snapshot().num_preemptions > 0
    # a preempted request's recompute prefills its generated tokens in one matmul where its decode steps computed
    # them a row at a time: a 1e-7 fp32 difference can round to another e4m3 step and, later, another token (seen on
    # an AVX-512 CPU). Each run starts as the plain one did, and every run that was not preempted matches it whole.
    preempted = tight.snapshot().num_preemptions
    assert all(out[:12] == longer[:12] for out in runs.values()), runs
    assert sum(out == longer for out in runs.values()) >= len(runs) - preempted, runs


@pytest.fixture(scope="module")
def engines(default_model_dir):
    prefill = make_engine(default_model_dir, kv_cache_dtype="fp8")
    decode = make_engine(default_model_dir, kv_cache_dtype="fp8")
    plain = make_engine(default_model_dir)  # fp32 KV
    for engine in (prefill, decode, plain):
        asyncio.run(engine.start())
    yield prefill, decode, plain
    for engine in (prefill, decode, plain):
        asyncio.run(engine.shutdown())


def test_fp8_blocks_travel_between_fp8_replicas_only(engines, tokenizer):
    prefill, decode, plain = engines
    prompt = chat_ids(tokenizer, SYSTEM + "What is inertia?")
    colocated = asyncio.run(collect(prefill, prompt, GREEDY, "colo"))
    before = decode.core.stats.num_prompt_tokens_computed
    received = decode.core.stats.num_kv_blocks_received
    outputs = asyncio.run(disaggregated(prefill, decode, prompt, GREEDY, "disagg"))
    assert tokens(outputs) == tokens(colocated)
    assert decode.core.stats.num_prompt_tokens_computed == before  # every prompt token's K/V came over the wire
    assert decode.core.stats.num_kv_blocks_received - received == -(-len(prompt) // 16)

    async def refused():
        async for _ in prefill.prefill(RequestSpec(prompt, GREEDY, "mismatch", 0), (), plain.kv_layout()):
            pass

    with pytest.raises(KVLayoutError, match="KV layout mismatch: hash_salt .*kv-fp8"):
        asyncio.run(refused())
    check_idle(prefill, decode)


def test_fp8_blocks_round_trip_through_the_second_tier(default_model_dir, tokenizer):
    core = make_core(default_model_dir, kv_cache_dtype="fp8", num_threads=1, num_blocks=40, kv_tier="memory",
                     kv_tier_bytes=64 << 20)
    assert core.tier is not None and core.runner.block_bytes() == 2 * 30 * 3 * 16 * 80
    prompt = chat_ids(tokenizer, SYSTEM + "Explain friction.")
    first = run_to_completion(core, {0: [("first", prompt, greedy(8))]})["first"]
    flood = [[(i * 131 + j * 17) % 20_000 + 500 for j in range(150)] for i in range(6)]  # evicts every cached block
    run_to_completion(core, {0: [(f"flood-{i}", p, greedy(2)) for i, p in enumerate(flood)]})
    hits = core.snapshot().tier_hit_blocks
    again = run_to_completion(core, {0: [("again", prompt, greedy(8))]})["again"]
    assert again == first
    assert core.snapshot().tier_hit_blocks - hits >= len(prompt) // 16 - 1
    core.scheduler.block_manager.check_invariants()
