"""Greedy output of the real default model in fp32 equals HF transformers token for token."""

from __future__ import annotations

import warnings

import pytest
import torch

from tests.model.helpers import assert_no_leak, greedy, hf_greedy, make_core, run_to_completion
from tokenfleet.api.chat_template import render_chat
from tokenfleet.engine.request_spec import RequestSpec

CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": "Write a haiku about the sea."}],
    [{"role": "system", "content": "You are a terse assistant."}, {"role": "user", "content": "Name three colors."}],
    [{"role": "user", "content": "Explain gravity to a child in two sentences. Be precise and kind, and avoid jargon."}],
    [
        {"role": "user", "content": "I am planning a trip to Japan in spring."},
        {"role": "assistant", "content": "That sounds lovely! Cherry blossom season is a great time to visit."},
        {"role": "user", "content": "Which cities should I visit, and what should I pack for the weather there?"},
    ],
]
MAX_TOKENS = 32
LOW_MARGIN = 1e-4


def chat_ids(core, messages) -> list[int]:
    return core.tokenizer.encode(render_chat(core.tokenizer, messages))


def test_chat_template_tokens_match_hf(fp32_core, default_model_dir):
    from transformers import AutoTokenizer

    hf_tok = AutoTokenizer.from_pretrained(str(default_model_dir))
    for messages in CHATS:
        expected = hf_tok.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)["input_ids"]
        assert chat_ids(fp32_core, messages) == list(expected)


@pytest.mark.parametrize("index", range(len(CHATS)))
def test_greedy_matches_transformers(fp32_core, hf_model, index):
    prompt = chat_ids(fp32_core, CHATS[index])
    ours = run_to_completion(fp32_core, {0: [(f"parity-{index}", prompt, greedy(MAX_TOKENS))]})[f"parity-{index}"]
    ref, ref_logits = hf_greedy(hf_model, prompt, MAX_TOKENS)
    assert len(ours) > 0
    for pos, (a, b) in enumerate(zip(ours, ref)):
        if a != b:
            top2 = torch.topk(ref_logits[pos], 2).values
            margin = float(top2[0] - top2[1])
            if margin < LOW_MARGIN:
                warnings.warn(f"prompt {index}: divergence at {pos} with reference top-2 margin {margin:.2e}")
                return
            pytest.fail(f"prompt {index}: token {pos} differs ({a} vs {b}), reference margin {margin:.3f}")
    assert ours == ref[: len(ours)] and len(ours) == len(ref)
    assert_no_leak(fp32_core.scheduler.block_manager)


def test_bf16_close_to_fp32_reference(default_model_dir, hf_model):
    """bf16 is checked with tolerances: teacher-forced top-1 agreement and logit closeness."""
    core = make_core(default_model_dir, dtype="bfloat16", num_blocks=64)
    prompt = chat_ids(core, CHATS[3])
    ref, ref_logits = hf_greedy(hf_model, prompt, 24)
    # Teacher forcing: feed the reference continuation as the prompt, read logits at each position.
    agree, max_err = 0, 0.0
    for pos in range(len(ref)):
        request_id = core.add_request(RequestSpec(prompt + ref[:pos], greedy(1), request_id=f"bf16-{pos}"))
        schedule = core.scheduler.schedule(0.0)
        logits = core.runner.compute_logits(schedule, core.scheduler.requests)[0]
        core.scheduler.update(schedule, {request_id: int(logits.argmax())})
        agree += int(logits.argmax()) == int(ref_logits[pos].argmax())
        max_err = max(max_err, float((logits - ref_logits[pos]).abs().max()))
    assert agree / len(ref) >= 0.9, f"bf16 top-1 agreement {agree}/{len(ref)}"
    assert max_err < 1.5, f"bf16 logits differ by up to {max_err}"
    assert_no_leak(core.scheduler.block_manager)
