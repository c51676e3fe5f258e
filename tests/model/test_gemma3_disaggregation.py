"""Disaggregated prefill of Gemma 3 270M (fp32) with a prompt past its 512-token sliding window: the
KV layout is per layer group, so the global layers send every prompt block and the sliding-window
layers only the blocks their window reaches from the next position; the decode side computes no
prompt token and its greedy output equals the colocated one."""

from __future__ import annotations

import asyncio

import pytest

from tests.model.test_gemma3_parity import CHATS
from tests.unit.engine.test_async_engine import collect, make_engine
from tests.unit.engine.test_disaggregation import GREEDY, check_idle, disaggregated, tokens
from tokenfleet.api.chat_template import render_chat
from tokenfleet.engine.kv_transfer import KVChunkData, PrefillStarted
from tokenfleet.models.gguf_import import GEMMA3_MODEL_NAME, ensure_model

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def engines():
    model_dir = ensure_model(GEMMA3_MODEL_NAME)
    prefill, decode = make_engine(model_dir, num_blocks=1024), make_engine(model_dir, num_blocks=1024)
    asyncio.run(prefill.start())
    asyncio.run(decode.start())
    yield prefill, decode
    asyncio.run(prefill.shutdown())
    asyncio.run(decode.shutdown())


def test_a_prompt_past_the_window_transfers_window_blocks_for_sliding_layers(engines):
    prefill, decode = engines
    prompt = prefill.core.tokenizer.encode(render_chat(prefill.core.tokenizer, CHATS[-1]))
    layout = decode.kv_layout()
    window, bs = max(layout.layer_windows), layout.block_size
    assert len(prompt) > window + 2 * bs
    colocated = asyncio.run(collect(prefill, prompt, GREEDY, "colo"))
    before = decode.core.stats.num_prompt_tokens_computed
    log: list = []
    outputs = asyncio.run(disaggregated(prefill, decode, prompt, GREEDY, "disagg", log))
    assert tokens(outputs) == tokens(colocated)
    assert decode.core.stats.num_prompt_tokens_computed == before
    started = log[0]
    assert isinstance(started, PrefillStarted) and started.first_block == 0
    sent: dict[int, int] = {}
    for event in log:
        if isinstance(event, KVChunkData):
            sent[event.layer] = sent.get(event.layer, 0) + event.num_blocks
    num_blocks = -(-len(prompt) // bs)
    for layer, w in enumerate(layout.layer_windows):
        expected = num_blocks if w == 0 else num_blocks - max(0, len(prompt) - w + 1) // bs
        assert sent[layer] == expected, layer
    assert min(sent.values()) <= window // bs + 1 < num_blocks
    check_idle(prefill, decode)
