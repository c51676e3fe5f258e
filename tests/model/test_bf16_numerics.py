"""bf16 decode and prefill stay as close to fp32 as HF transformers' own bf16 run.

Our engine decodes greedily in bf16, reporting each sampled token's logprob (decode steps) and the
prompt's logprobs (prefill). HF transformers then teacher-forces the same tokens in fp32 (the
reference) and in bf16. In decode our mean |logprob - fp32| must be at most 1.1x HF bf16's, on the same
tokens (rounding attention scores to bf16 before the softmax failed this: ~1.5-2x). In prefill the same mean moves
with the machine's rounding (1.01x on a CPU with AVX-512 BF16, 1.19x on one without, where our attention is closer
to fp32 than HF's in every layer: the next test), so it is held only to 1.5x, which a wrong kernel exceeds by far;
benchmarks/bf16_numerics.py reports both figures.
"""

from __future__ import annotations

import pytest
import torch

from tests.model.helpers import assert_no_leak, greedy, make_core
from tests.model.test_hf_parity import CHATS, chat_ids
from tokenfleet.engine.request_spec import RequestSpec

MAX_TOKENS = 32
CHATS_WITH_FACTS = [*CHATS, [{"role": "user", "content": "What is the boiling point of water at sea level?"}]]
# More text than the parity chats: one near-tie can swing a mean over ~300 tokens by 10-15 % either way.
MORE_CHATS = [[{"role": "user", "content": c}] for c in (
    "Tell me a story about a dragon who learns to cook.",
    "What are the main causes of climate change? Answer in detail.",
    "Write a python function that reverses a linked list and explain it.",
    "Summarize the plot of Romeo and Juliet.",
    "How do vaccines work?",
    "Give me five tips for a job interview, with a sentence of explanation each.",
    "Why is the sky blue?",
    "Describe the water cycle for a ten year old student.",
)]


@pytest.fixture(scope="module")
def bf16_core(default_model_dir):
    return make_core(default_model_dir, dtype="bfloat16", num_blocks=256)


@pytest.fixture(scope="module")
def hf_bf16_model(default_model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(default_model_dir), dtype=torch.bfloat16).eval()


def teacher_forced_logprobs(model, ids: list[int]) -> torch.Tensor:
    """[len(ids) - 1]: logprob of ids[i + 1] after ids[: i + 1], computed in the model's dtype, reported fp32."""
    with torch.inference_mode():
        logits = model(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long)).logits[0].float()
    lps = torch.log_softmax(logits[:-1], dim=-1)
    return lps.gather(1, torch.tensor(ids[1:])[:, None]).squeeze(1)


def ours(core, prompt: list[int], request_id: str) -> tuple[list[int], list[float], list[float]]:
    """Greedy tokens, their logprobs (decode), and the prompt's logprobs (prefill), in bf16."""
    core.add_request(RequestSpec(prompt, greedy(MAX_TOKENS, logprobs=0, prompt_logprobs=0), request_id=request_id))
    tokens: list[int] = []
    logprobs: list[float] = []
    prompt_logprobs: list[float] = []
    while core.has_unfinished():
        for out in core.step():
            tokens += out.new_token_ids
            logprobs += [lp.logprob for lp in out.logprobs]
            prompt_logprobs += [lp.logprob for lp in out.prompt_logprobs]
    return tokens, logprobs, prompt_logprobs


@pytest.mark.nightly  # ~35 s where bf16 is slow; the per-layer prefill check below stays in the suite
def test_bf16_decode_and_prefill_as_close_to_fp32_as_hf_bf16(bf16_core, hf_model, hf_bf16_model):
    decode = {"ours": [], "hf_bf16": []}
    prefill = {"ours": [], "hf_bf16": []}
    for index, messages in enumerate(CHATS_WITH_FACTS + MORE_CHATS):
        prompt = chat_ids(bf16_core, messages)
        tokens, logprobs, prompt_lps = ours(bf16_core, prompt, f"numerics-{index}")
        assert len(tokens) == len(logprobs) > 1 and len(prompt_lps) == len(prompt) - 1
        ids = prompt + tokens
        ref = teacher_forced_logprobs(hf_model, ids)
        hf_bf16 = teacher_forced_logprobs(hf_bf16_model, ids)
        n = len(prompt) - 1  # ref[n + i] scores output token i; output 0 comes from the prefill
        decode["ours"] += (torch.tensor(logprobs[1:]) - ref[n + 1:]).abs().tolist()
        decode["hf_bf16"] += (hf_bf16[n + 1:] - ref[n + 1:]).abs().tolist()
        prefill["ours"] += (torch.tensor(prompt_lps + logprobs[:1]) - ref[: n + 1]).abs().tolist()
        prefill["hf_bf16"] += (hf_bf16[: n + 1] - ref[: n + 1]).abs().tolist()
    assert_no_leak(bf16_core.scheduler.block_manager)
    for name, errors in (("decode", decode), ("prefill", prefill)):
        mean_ours = sum(errors["ours"]) / len(errors["ours"])
        mean_hf = sum(errors["hf_bf16"]) / len(errors["hf_bf16"])
        assert mean_hf > 0  # the references differ: the comparison means something
        assert mean_ours <= (1.1 if name == "decode" else 1.5) * mean_hf, (
            f"{name}: mean |dlogprob| vs fp32 {mean_ours:.4f} over {len(errors['ours'])} tokens, HF bf16 {mean_hf:.4f}")


def test_prefill_attention_is_as_close_to_fp32_as_bf16_sdpa_in_every_layer(bf16_core):
    """On the real model's own activations (a chat prompt's prefill), each layer's attention output is compared
    with the fp32 reference on the same stored bf16 inputs: ours may be no further from it than torch's bf16 SDPA
    (what HF bf16 runs), layer by layer."""
    from tokenfleet.models.attention import TorchPagedAttention, _gather, _prefill_attention

    model = bf16_core.runner.model
    attend = model.attention
    if not attend.handles_prefill:
        pytest.skip("the torch reference serves attention here: prefill chunks go through SDPA itself")
    captured = []

    class Record:
        handles_prefill = attend.handles_prefill

        def __call__(self, q, k_cache, v_cache, meta):
            captured.append((q.clone(), k_cache.clone(), v_cache.clone(), meta))
            return attend(q, k_cache, v_cache, meta)

    model.attention = Record()
    try:
        prompt = chat_ids(bf16_core, MORE_CHATS[3])
        bf16_core.add_request(RequestSpec(prompt, greedy(1), request_id="layers"))
        while bf16_core.has_unfinished():
            bf16_core.step()
    finally:
        model.attention = attend
    assert len(captured) == model.config.num_layers
    for layer, (q, k_cache, v_cache, meta) in enumerate(captured):
        exact = TorchPagedAttention()(q.float(), k_cache, v_cache, meta)
        ours_error = (attend(q, k_cache, v_cache, meta).float() - exact).abs().mean()
        length = int(meta.context_lens[0])
        k = _gather(k_cache, meta.block_table[0])[:, :length]
        v = _gather(v_cache, meta.block_table[0])[:, :length]
        sdpa_error = (_prefill_attention(q, k, v, 0).float() - exact).abs().mean()
        assert ours_error <= sdpa_error * 1.02, f"layer {layer}: ours {ours_error:.3g}, bf16 SDPA {sdpa_error:.3g}"
