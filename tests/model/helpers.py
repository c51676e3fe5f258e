"""Helpers for tests that run the engine on real weights and compare with HF transformers."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch

from tokenfleet.backends.torch.builder import build_engine_core
from tokenfleet.engine.block_manager import BlockManager
from tokenfleet.engine.config import EngineConfig
from tokenfleet.engine.core import CoreParts, EngineCore
from tokenfleet.engine.request_spec import RequestSpec
from tokenfleet.engine.sampling_params import SamplingParams


def make_core(model_dir: str | Path, **options: object) -> EngineCore:
    options.setdefault("dtype", "float32")
    options.setdefault("num_threads", 2)
    options.setdefault("num_blocks", 512)
    return build_engine_core(EngineConfig(model=str(model_dir), **options))  # type: ignore[arg-type]


def with_parts(core: EngineCore, **parts: object) -> EngineCore:
    """``core``'s scheduler, runner and model, built again with ``parts`` (CoreParts) before any request ran."""
    return EngineCore(core.scheduler, core.runner, core.tokenizer, core.model, CoreParts(**parts))  # type: ignore[arg-type]


def greedy(max_tokens: int, **kw: object) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, **kw)  # type: ignore[arg-type]


def run_to_completion(core: EngineCore, arrivals: dict[int, list[tuple[str, list[int], SamplingParams]]]) -> dict[str, list[int]]:
    """Run the core; ``arrivals[step]`` requests are added before that step. Returns token ids by request id."""
    outputs: dict[str, list[int]] = {}
    step = 0
    while step <= max(arrivals, default=0) or core.has_unfinished():
        for request_id, prompt, params in arrivals.get(step, []):
            core.add_request(RequestSpec(prompt, params, request_id=request_id))
            outputs[request_id] = []
        for out in core.step():
            outputs[out.request_id] += out.new_token_ids
        step += 1
    return outputs


def assert_no_leak(block_manager: BlockManager) -> None:
    block_manager.check_invariants()
    assert block_manager.num_used_blocks == 0, f"{block_manager.num_used_blocks} blocks still in use"


def hf_greedy(model, prompt: Sequence[int], max_new_tokens: int) -> tuple[list[int], torch.Tensor]:
    """HF greedy tokens and the logits that chose each of them ([steps, vocab])."""
    ids = torch.tensor([list(prompt)])
    with torch.inference_mode():
        out = model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False,
            output_logits=True, return_dict_in_generate=True, pad_token_id=0,
        )
    tokens = out.sequences[0, ids.shape[1]:].tolist()
    return tokens, torch.stack([step[0] for step in out.logits]).float()
