"""Random-weight tiny Llamas: our paged-KV forward equals HF transformers' logits, step by step."""

from __future__ import annotations

import pytest
import torch

from tokenfleet.backends.torch.runner import TorchModelRunner
from tokenfleet.engine.block_manager import BlockManager
from tokenfleet.engine.request import Request
from tokenfleet.engine.sampling_params import SamplingParams
from tokenfleet.engine.scheduler import Scheduler, SchedulerConfig
from tokenfleet.models.loader import load_model

VARIANTS = {
    "gqa-untied": dict(num_key_value_heads=2, tie_word_embeddings=False),
    "mha-tied": dict(num_key_value_heads=4, tie_word_embeddings=True),
    "llama3-rope": dict(
        num_key_value_heads=1,
        rope_scaling={
            "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
        rope_theta=500000.0,
    ),
}


def save_tiny_llama(path, **overrides):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=512, hidden_size=64, intermediate_size=160, num_hidden_layers=3, num_attention_heads=4,
        max_position_embeddings=512, rms_norm_eps=1e-5, **overrides,
    )
    model = LlamaForCausalLM(config).eval()
    model.save_pretrained(str(path))
    return model


def stepwise_logits(model_dir, dtype, prompts, num_steps, block_size=4, chunk=0, device="cpu"):
    """Run prompts together through scheduler + runner; feed back argmax; return logits per request per step."""
    model = load_model(model_dir, dtype, torch.device(device))
    runner = TorchModelRunner(model, num_blocks=64, block_size=block_size)
    scheduler = Scheduler(
        SchedulerConfig(max_prefill_chunk=chunk, max_model_len=512), BlockManager(64, block_size), hash_salt="t"
    )
    logits: dict[str, list[torch.Tensor]] = {}
    for i, prompt in enumerate(prompts):
        params = SamplingParams(max_tokens=num_steps, temperature=0.0, ignore_eos=True)
        scheduler.add_request(Request(f"r{i}", list(prompt), params, arrival_time=i, max_tokens=num_steps))
        logits[f"r{i}"] = []
    while scheduler.has_unfinished():
        out = scheduler.schedule(0.0)
        step_logits = runner.compute_logits(out, scheduler.requests)
        sampling = [s.request_id for s in out.scheduled if s.samples]
        for request_id, row in zip(sampling, step_logits):
            logits[request_id].append(row.cpu())
        scheduler.update(out, {rid: int(row.argmax()) for rid, row in zip(sampling, step_logits)})
    scheduler.block_manager.check_invariants()
    return logits


def hf_reference(model, prompt, ours):
    """HF logits for the same positions, recomputing the whole sequence each step (no cache)."""
    seq = list(prompt)
    ref = []
    for row in ours:
        with torch.inference_mode():
            full = model(torch.tensor([seq])).logits[0, -1].float()
        ref.append(full)
        seq.append(int(row.argmax()))
    return ref


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_fp32_logits_match_transformers_prefill_and_decode(tmp_path, variant):
    hf = save_tiny_llama(tmp_path, **VARIANTS[variant])
    prompts = [[5, 17, 300, 42, 7, 99, 1, 250, 3], [11, 12, 13], list(range(20, 57))]
    ours = stepwise_logits(tmp_path, torch.float32, prompts, num_steps=6)
    for i, prompt in enumerate(prompts):
        ref = hf_reference(hf, prompt, ours[f"r{i}"])
        assert len(ours[f"r{i}"]) == 6
        for step, (a, b) in enumerate(zip(ours[f"r{i}"], ref)):
            assert torch.allclose(a, b, atol=1e-4, rtol=1e-4), f"{variant} prompt {i} step {step}: {(a - b).abs().max()}"


def test_chunked_prefill_logits_match(tmp_path):
    hf = save_tiny_llama(tmp_path, num_key_value_heads=2)
    prompt = list(range(100, 141))
    ours = stepwise_logits(tmp_path, torch.float32, [prompt], num_steps=3, chunk=5)
    for a, b in zip(ours["r0"], hf_reference(hf, prompt, ours["r0"])):
        assert torch.allclose(a, b, atol=1e-4, rtol=1e-4)


def test_bf16_logits_close_and_top1_agrees(tmp_path):
    hf = save_tiny_llama(tmp_path, num_key_value_heads=2)
    prompts = [list(range(30, 60)), [7, 8, 9, 10]]
    ours = stepwise_logits(tmp_path, torch.bfloat16, prompts, num_steps=5)
    agree = total = 0
    for i, prompt in enumerate(prompts):
        for a, b in zip(ours[f"r{i}"], hf_reference(hf, prompt, ours[f"r{i}"])):
            assert (a - b).abs().max() < 0.1
            agree += int(a.argmax() == b.argmax())
            total += 1
    assert agree / total >= 0.9
