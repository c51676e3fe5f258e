"""The engine's features over quantized weights (the default model's GGUF kept quantized, registry ``quantization:
gguf``), beside test_gguf_served.py (prefix hits, chunked prefill, speculation) and test_lora.py (adapters): the
second KV tier and disaggregated prefill. Each compares with the same quantized model served plainly, so the
default int8 activations are what runs."""

from __future__ import annotations

import asyncio

import pytest

from tests.model.helpers import greedy, make_core, run_to_completion
from tests.model.test_gguf_served import kept_quantized
from tests.unit.engine.test_async_engine import chat_ids, collect, make_engine
from tests.unit.engine.test_disaggregation import GREEDY, check_idle, disaggregated, tokens
from tokenfleet.models.ggml_quant import QuantTensor
from tokenfleet.models.tokenizer import Tokenizer

SYSTEM = "You are a meticulous assistant for a hardware store. " * 6


@pytest.fixture(scope="module")
def gguf_dir(default_model_dir, tmp_path_factory):
    return kept_quantized(default_model_dir, tmp_path_factory.mktemp("gguf") / "smollm2-135m-instruct-gguf")


@pytest.fixture(scope="module")
def tokenizer(default_model_dir):
    return Tokenizer(default_model_dir)


def test_blocks_evicted_to_the_second_tier_come_back_with_the_same_answer(gguf_dir, tokenizer):
    core = make_core(gguf_dir, quantization="gguf", num_threads=1, num_blocks=40, kv_tier="memory",
                     kv_tier_bytes=64 << 20)
    assert core.tier is not None and isinstance(core.runner.model.weights.layers[0].qkv, QuantTensor)
    prompt = chat_ids(tokenizer, SYSTEM + "Explain friction.")
    first = run_to_completion(core, {0: [("first", prompt, greedy(8))]})["first"]
    flood = [[(i * 131 + j * 17) % 20_000 + 500 for j in range(150)] for i in range(6)]  # evicts every cached block
    run_to_completion(core, {0: [(f"flood-{i}", p, greedy(2)) for i, p in enumerate(flood)]})
    hits = core.snapshot().tier_hit_blocks
    assert run_to_completion(core, {0: [("again", prompt, greedy(8))]})["again"] == first
    assert core.snapshot().tier_hit_blocks - hits >= len(prompt) // 16 - 1
    core.scheduler.block_manager.check_invariants()


def test_disaggregated_prefill_answers_as_colocated_and_decode_computes_no_prompt(gguf_dir, tokenizer):
    prefill, decode = (make_engine(gguf_dir, quantization="gguf"), make_engine(gguf_dir, quantization="gguf"))
    asyncio.run(prefill.start())
    asyncio.run(decode.start())
    try:
        prompt = chat_ids(tokenizer, SYSTEM + "What is the capital of France?")
        colocated = asyncio.run(collect(prefill, prompt, GREEDY, "colo"))
        # computed again from scratch: a cached prefix would leave a tail of a few rows, which the int8 path
        # computes (steps of up to INT8_ROWS rows), with its own rounding
        prefill.core.scheduler.block_manager.reset_prefix_cache()
        before = decode.core.stats.num_prompt_tokens_computed
        outputs = asyncio.run(disaggregated(prefill, decode, prompt, GREEDY, "disagg"))
        assert tokens(outputs) == tokens(colocated)
        assert decode.core.stats.num_prompt_tokens_computed == before  # every prompt block came over the wire
        check_idle(prefill, decode)
    finally:
        asyncio.run(prefill.shutdown())
        asyncio.run(decode.shutdown())
