"""KV export/import (disaggregated prefill) through the torch runner on the CPU and (when present)
CUDA: blocks exported from one engine and imported into another continue greedy decoding exactly
as the engine that computed them does."""

from __future__ import annotations

import pytest
import torch

from tests.unit.models.test_llama_parity import save_tiny_llama
from tokenfleet.engine.request_spec import RequestSpec

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def make_core(path, device: str):
    from tokenfleet.backends.torch.runner import TorchModelRunner
    from tokenfleet.engine.block_manager import BlockManager
    from tokenfleet.engine.core import EngineCore
    from tokenfleet.engine.runner import ModelInfo
    from tokenfleet.engine.scheduler import Scheduler, SchedulerConfig
    from tokenfleet.models.loader import load_model

    model = load_model(path, torch.bfloat16, torch.device(device))
    runner = TorchModelRunner(model, num_blocks=64, block_size=4)
    scheduler = Scheduler(SchedulerConfig(max_model_len=512), BlockManager(64, 4), hash_salt="kv")
    return EngineCore(scheduler, runner, None, ModelInfo(vocab_size=512, max_model_len=512, eos_token_ids=()))


@pytest.mark.parametrize("device", DEVICES)
def test_exported_blocks_continue_decoding_on_another_engine(tmp_path, device):
    from tokenfleet.engine.sampling_params import SamplingParams

    save_tiny_llama(tmp_path, num_key_value_heads=2)
    prefill, decode = make_core(tmp_path, device), make_core(tmp_path, device)
    prompt = list(range(30, 53))  # 23 tokens: 5 full blocks of 4 and a partial one
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)

    prefill.add_request(RequestSpec(prompt, greedy, request_id="colocated"))
    expected: list[int] = []
    while prefill.has_unfinished():
        expected += [t for o in prefill.step() for t in o.new_token_ids]

    prefill.add_request(RequestSpec(prompt, SamplingParams(max_tokens=1, temperature=0.0), request_id="p", hold_kv=True))
    first = [t for o in _drain(prefill) for t in o.new_token_ids]
    table = prefill.kv.held_block_ids("p")
    assert first == expected[:1] and table is not None and len(table) == 6

    assert decode.kv.add_remote(RequestSpec(prompt, greedy, "d")) == 0
    decode.kv.remote_first_token("d", first[0], None)
    layers = prefill.runner.kv_geometry()[0]
    for layer in range(layers):
        k, v = prefill.runner.export_kv(layer, table)
        decode.kv.import_kv("d", layer, 0, k, v, len(table))
    prefill.kv.release_held("p")
    decode.kv.activate_remote("d")
    got = first + [t for o in _drain(decode) for t in o.new_token_ids]
    assert got == expected
    assert decode.stats.num_prompt_tokens_computed == 0  # the decode engine computed no prompt token
    for core in (prefill, decode):
        core.scheduler.block_manager.check_invariants()
        assert core.scheduler.block_manager.num_used_blocks == 0


def _drain(core):
    outs = []
    while core.has_unfinished():
        outs += core.step()
    return outs
