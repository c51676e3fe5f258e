"""Gemma 3 270M in fp32 through our engine equals HF transformers greedily, token for token, on chat
prompts of different lengths, one longer than the sliding window (512 tokens: its local layers then
attend to the last 512 only, and their blocks before the window are released), and its prefix-cache
hits and chunked prefill change nothing."""

from __future__ import annotations

import pytest
import torch

from tests.model.helpers import assert_no_leak, greedy, hf_greedy, make_core, run_to_completion
from tokenfleet.api.chat_template import render_chat
from tokenfleet.models.gguf_import import GEMMA3_MODEL_NAME, ensure_model

pytestmark = pytest.mark.slow
CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "Answer in one word."}, {"role": "user", "content": "Name a primary colour."}],
    [{"role": "user", "content": "Write a short poem about autumn leaves falling in a quiet park."}],
    [{"role": "user", "content": "Tell me about the history of Rome. " * 8}],
    [{"role": "user", "content": "I am planning a trip to Japan in spring."},
     {"role": "assistant", "content": "That sounds lovely! Cherry blossom season is a great time to visit."},
     {"role": "user", "content": "Which cities should I visit, and what should I pack? " * 12}],
    [{"role": "system", "content": "You are a careful assistant. Summarize what the user pastes."},
     {"role": "user", "content": " ".join(f"Line {i}: the river rose {i % 7} inches near mill {i % 13}." for i in range(50))
      + "\nSummarize the readings above in one sentence."}],
]
MAX_TOKENS = 16


@pytest.fixture(scope="module")
def gemma_dir():
    return ensure_model(GEMMA3_MODEL_NAME)


@pytest.fixture(scope="module")
def core(gemma_dir):
    return make_core(gemma_dir, num_blocks=256, max_num_batched_tokens=64)  # 64: longer prompts prefill in chunks


@pytest.fixture(scope="module")
def hf(gemma_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(gemma_dir, dtype=torch.float32).eval()


def test_greedy_matches_transformers_on_chats_of_different_lengths(core, hf):
    prompts = [core.tokenizer.encode(render_chat(core.tokenizer, chat)) for chat in CHATS]
    assert all(p[0] == 2 for p in prompts) and max(map(len, prompts)) > 512  # <bos>, and one past the window
    assert all(len(p) + MAX_TOKENS <= core.model.max_model_len for p in prompts)
    ours = run_to_completion(core, {0: [(f"g{i}", p, greedy(MAX_TOKENS)) for i, p in enumerate(prompts)]})
    for i, prompt in enumerate(prompts):
        reference, _ = hf_greedy(hf, prompt, MAX_TOKENS)
        assert ours[f"g{i}"] == reference[: len(ours[f"g{i}"])] and ours[f"g{i}"], (i, ours[f"g{i}"], reference)
    long = len(CHATS) - 1
    again = run_to_completion(core, {0: [("g0-again", prompts[0], greedy(MAX_TOKENS)),  # prefix-cache hits
                                         ("long-again", prompts[long], greedy(MAX_TOKENS))]})
    assert again["g0-again"] == ours["g0"] and again["long-again"] == ours[f"g{long}"]
    assert_no_leak(core.scheduler.block_manager)
