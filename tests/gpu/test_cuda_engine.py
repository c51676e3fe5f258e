"""The torch backend on CUDA: same logits as HF on tiny random Llamas, and a full engine run.

Skipped without CUDA (CI has none); run on a GPU machine with `pytest tests/gpu`.
"""

from __future__ import annotations

import pytest
import torch

from tests.unit.models.test_llama_parity import VARIANTS, hf_reference, save_tiny_llama, stepwise_logits
from tokenfleet.engine.request_spec import RequestSpec

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_cuda_fp32_logits_match_transformers(tmp_path, variant):
    hf = save_tiny_llama(tmp_path, **VARIANTS[variant])
    prompts = [[5, 17, 300, 42, 7, 99, 1, 250, 3], [11, 12, 13], list(range(20, 57))]
    ours = stepwise_logits(tmp_path, torch.float32, prompts, num_steps=6, device="cuda")
    for i, prompt in enumerate(prompts):
        for step, (a, b) in enumerate(zip(ours[f"r{i}"], hf_reference(hf, prompt, ours[f"r{i}"]))):
            assert torch.allclose(a, b, atol=1e-3, rtol=1e-3), f"{variant} prompt {i} step {step}: {(a - b).abs().max()}"


def test_cuda_bf16_engine_runs_batches_without_leaks(tmp_path):
    from tokenfleet.backends.torch.runner import TorchModelRunner
    from tokenfleet.engine.block_manager import BlockManager
    from tokenfleet.engine.core import EngineCore
    from tokenfleet.engine.runner import ModelInfo
    from tokenfleet.engine.sampling_params import SamplingParams
    from tokenfleet.engine.scheduler import Scheduler, SchedulerConfig
    from tokenfleet.models.loader import load_model

    save_tiny_llama(tmp_path, num_key_value_heads=2)
    model = load_model(tmp_path, torch.bfloat16, torch.device("cuda"))
    runner = TorchModelRunner(model, num_blocks=32, block_size=16)
    scheduler = Scheduler(SchedulerConfig(max_model_len=512), BlockManager(32, 16), hash_salt="gpu")
    core = EngineCore(scheduler, runner, None, ModelInfo(vocab_size=512, max_model_len=512, eos_token_ids=()))
    params = SamplingParams(max_tokens=40, temperature=0.8, top_p=0.9, seed=3, ignore_eos=True)
    for i in range(12):  # 12 x (20..42 + 40) tokens overflow 32 blocks: forces preemption on the GPU path too
        core.add_request(RequestSpec(list(range(10 + i, 30 + 2 * i)), params, request_id=f"g{i}"))
    counts: dict[str, int] = {}
    while core.has_unfinished():
        for out in core.step():
            counts[out.request_id] = counts.get(out.request_id, 0) + len(out.new_token_ids)
    assert counts == {f"g{i}": 40 for i in range(12)}
    scheduler.block_manager.check_invariants()
    assert scheduler.block_manager.num_used_blocks == 0
