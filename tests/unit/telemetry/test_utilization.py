"""MFU/MBU accounting: a step's model FLOPs and bytes from its shape, against the model's own geometry."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from tests.unit.models.test_llama_parity import save_tiny_llama
from tokenfleet.backends.torch.runner import TorchModelRunner
from tokenfleet.models.loader import load_model
from tokenfleet.telemetry.utilization import StepCost, measure, peaks


def test_step_cost_counts_matmuls_head_attention_weights_and_kv(tmp_path):
    save_tiny_llama(tmp_path)  # hidden 64, intermediate 160, 3 layers, 4 heads (head_dim 16), vocab 512, untied
    model = load_model(tmp_path, torch.float32, torch.device("cpu"))
    runner = TorchModelRunner(model, num_blocks=16, block_size=4)
    cost = runner.cost
    layer = 4 * 64 * 64 + 3 * 64 * 160  # q, k, v, o (4 KV heads: full width), gate, up, down
    assert cost.matmul_params == 3 * layer  # not the embedding, not the LM head
    assert cost.head_flops_per_sample == 2 * 512 * 64
    assert cost.attention_flops_per_pair == 4 * 3 * 4 * 16
    params = 3 * (layer + 2 * 64) + 64 + 2 * 512 * 64  # + norms, the embedding and the (untied) LM head
    assert 4 * params <= cost.weight_bytes <= 2 * 4 * params  # fp32; a prepared copy of a matrix may be kept
    assert cost.kv_bytes_per_token == 2 * 3 * 4 * 16 * 4  # K and V, layers, KV heads, head_dim, fp32
    # a step: one request prefilling 5 tokens after 3 cached, one decoding at position 9, one chunk not sampling
    scheduled = [SimpleNamespace(num_new_tokens=5, start=3, samples=True, forks=()),
                 SimpleNamespace(num_new_tokens=1, start=9, samples=True, forks=()),
                 SimpleNamespace(num_new_tokens=4, start=0, samples=False, forks=())]
    flops, read = runner.step_cost(SimpleNamespace(scheduled=scheduled))
    pairs = (5 * 3 + 15) + (9 + 1) + (0 + 10)
    assert flops == 2 * cost.matmul_params * 10 + cost.head_flops_per_sample * 2 + cost.attention_flops_per_pair * pairs
    assert read == cost.weight_bytes + cost.kv_bytes_per_token * (8 + 10 + 4)


def test_peaks_are_measured_on_a_device_with_no_datasheet():
    flops, read = measure(torch.device("cpu"), torch.float32, seconds=0.01)
    assert flops > 1e8 and read > 1e8  # any CPU does better than 100 MFLOP/s and 100 MB/s
    *_, source = peaks(torch.device("cpu"), torch.float32)
    assert source == "measured at start"
    assert StepCost(0, 1, 0, 0, 0).of(3, 0, 0, 0) == (6, 0)
