"""The known-answer check at load (models.kernel_check): a kernel that computes a wrong answer on this machine is
caught before the engine uses it, the engine serves from the reference instead and says so; kernels that are right
pass and serve."""

from __future__ import annotations

import pytest
import torch

from tokenfleet.backends.torch.sampler import NativeTemperatureSampler
from tokenfleet.backends.torch.sampler_check import check_temperature_sampler
from tokenfleet.engine.runner import KernelCheck
from tokenfleet.models import kv_fp8, loader
from tokenfleet.models.attention import PagedQueries, TorchPagedAttention
from tokenfleet.models.config import ModelConfig
from tokenfleet.models.kernel_check import checked_attention, checked_layer_ops
from tokenfleet.models.layer_ops import TorchLayerOps

CPU = torch.device("cpu")
SMOL = dict(vocab_size=100, hidden_size=576, intermediate_size=1536, num_hidden_layers=1, num_attention_heads=9,
            num_key_value_heads=3, max_position_embeddings=4096, rms_norm_eps=1e-5, rope_theta=100000.0)


class OneScoreOff:
    """A wrong kernel (test double): the torch reference, except that request 0's first query row, head 0, scores
    its first key ``delta`` higher than it should."""

    handles_prefill = True
    name = "planted kernel (one score off)"

    def __init__(self, delta: float = 1.0):
        self.delta = delta

    def __call__(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: PagedQueries) -> torch.Tensor:
        out = TorchPagedAttention()(q, k_cache, v_cache, meta)
        rows = int(meta.query_start[1] - meta.query_start[0])
        visible = int(meta.context_lens[0]) - rows + 1  # keys that row sees
        keys = kv_fp8.gather(k_cache, meta.block_table[0], torch.float32)[0, :visible]  # KV head 0
        values = kv_fp8.gather(v_cache, meta.block_table[0], torch.float32)[0, :visible]
        scores = keys @ q[0, 0].float() * q.shape[-1] ** -0.5
        scores[0] += self.delta
        out[0, 0] = (torch.softmax(scores, 0) @ values).to(out.dtype)
        return out


def test_a_kernel_off_by_one_score_is_caught_and_the_reference_serves():
    config = ModelConfig.from_dict(SMOL)
    attend, checks = checked_attention([OneScoreOff()], config, torch.bfloat16, CPU)
    assert isinstance(attend, TorchPagedAttention)
    (check,) = checks
    assert not check.passed and check.serving == "torch reference"
    assert check.implementation == "planted kernel (one score off)"
    # the case that caught it, named with its shapes: the first whose request 0 sees more than one key at row 0
    assert "context [100, 33], query rows [37, 33], heads 9/3, head_dim 64, block 16" in check.detail


def test_a_wrong_kernel_is_replaced_by_the_next_candidate_that_passes():
    config = ModelConfig.from_dict(SMOL)
    reference_like = OneScoreOff(delta=0.0)  # right: the reference's own numbers
    attend, checks = checked_attention([OneScoreOff(), reference_like], config, torch.bfloat16, CPU)
    assert attend is reference_like
    assert [c.passed for c in checks] == [False, True]
    assert {c.serving for c in checks} == {"planted kernel (one score off)"}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_this_machines_kernels_pass_and_serve(default_model_dir, dtype):
    from tokenfleet import envs
    from tokenfleet.models import native

    if native.compiler() is None or not envs.native_kernels():
        pytest.skip("no native kernels here (no C compiler, or TOKENFLEET_NATIVE_KERNELS=0): the reference serves")
    model = loader.load_model(default_model_dir, dtype, CPU)
    checks = {c.kernel: c for c in model.kernel_checks}
    # fp32 also checks its few-row matmul (bf16's oneDNN matmul is torch's own)
    assert set(checks) == {"paged_attention", "layer_ops", *(["linear"] if dtype == torch.float32 else [])}
    for c in checks.values():
        assert c.passed and c.serving == c.implementation, c
        assert c.max_error < 0.02
    assert model.attention.name == checks["paged_attention"].implementation  # type: ignore[attr-defined]


def test_a_planted_kernel_in_the_engine_is_replaced_and_the_answers_are_the_references(default_model_dir, monkeypatch):
    """Through the engine: the worker-visible checks say what failed and what serves, and greedy output equals an
    engine built on the torch reference kernels."""
    from tests.model.helpers import greedy, make_core, run_to_completion

    prompt = list(range(300, 340))
    monkeypatch.setenv("TOKENFLEET_KERNELS", "torch")
    reference = run_to_completion(make_core(default_model_dir, dtype="bfloat16", num_blocks=64),
                                  {0: [("r", prompt, greedy(8))]})
    monkeypatch.delenv("TOKENFLEET_KERNELS")
    monkeypatch.setattr(loader, "select_attention", lambda *a, **k: OneScoreOff())
    core = make_core(default_model_dir, dtype="bfloat16", num_blocks=64)
    attention = [c for c in core.model.kernel_checks if c.kernel == "paged_attention"]
    assert [(c.implementation, c.passed, c.serving) for c in attention] == [
        ("planted kernel (one score off)", False, "torch reference")]
    assert isinstance(core.runner.model.attention, TorchPagedAttention)  # type: ignore[attr-defined]
    assert run_to_completion(core, {0: [("r", prompt, greedy(8))]}) == reference


class WrongSilu(TorchLayerOps):
    name = "planted layer ops"

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        out = super().silu_mul(gate_up)
        out[3, 5] += 0.25
        return out


class WrongRow:
    """A few-row matmul (test double) whose outputs for the 9th row of a step are doubled."""

    name = "planted few-row matmul"
    rows = 32

    def takes(self, x: torch.Tensor) -> bool:
        return x.shape[0] <= self.rows

    def __call__(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        out = torch.nn.functional.linear(x, weight)
        if out.shape[0] > 8:
            out[8] *= 2
        return out


def test_a_matmul_wrong_on_one_row_is_caught_and_f_linear_serves():
    from tokenfleet.models.kernel_check import checked_linear
    from tokenfleet.models.linear import DenseLinear

    linear, checks = checked_linear(DenseLinear(WrongRow()), ModelConfig.from_dict(SMOL), torch.float32, CPU)
    assert isinstance(linear, DenseLinear) and linear.few_rows is None
    (check,) = checks
    assert not check.passed and check.serving == "torch reference" and "with 9 rows" in check.detail


def test_layer_ops_that_move_one_value_are_caught():
    config = ModelConfig.from_dict(SMOL)
    ops, (check,) = checked_layer_ops(WrongSilu(config), TorchLayerOps(config), config, torch.bfloat16, CPU)
    assert type(ops) is TorchLayerOps and not check.passed and "silu_mul" in check.detail


def test_a_sampler_that_draws_the_next_token_is_caught():
    real = NativeTemperatureSampler.load()

    class NextToken:
        def __call__(self, logits, params, uniforms):
            return real(logits, params, uniforms) + 1 if real is not None else torch.zeros(len(params), dtype=torch.long)

    check = check_temperature_sampler(NextToken())  # type: ignore[arg-type]
    assert isinstance(check, KernelCheck) and not check.passed and check.serving == "torch sampler"
    assert "drew token" in check.detail
    if real is not None:
        assert check_temperature_sampler(real).passed


def test_a_failed_check_reads_zero_in_the_workers_metrics_with_what_serves():
    from prometheus_client import CollectorRegistry
    from tokenfleet.services.common import convert

    from tokenfleet.telemetry.metrics import WorkerCollector
    from tokenfleet.v1 import engine_pb2

    failed = KernelCheck("paged_attention", "native paged attention (AVX-512 BF16)", False, 0.3, "t", 0.01,
                         "context [37]: max |error| 0.3", "native paged attention (portable C)")
    report = engine_pb2.LoadReport(kernel_checks=[convert.kernel_check_to_proto(failed)])
    registry = CollectorRegistry()
    registry.register(WorkerCollector(lambda: report))
    value = registry.get_sample_value("tokenfleet_worker_kernel_check", {
        "kernel": "paged_attention", "implementation": "native paged attention (AVX-512 BF16)",
        "serving": "native paged attention (portable C)"})
    assert value == 0.0


def test_the_engine_resolves_auto_before_anything_reads_the_dtype(default_model_dir):
    from tokenfleet.backends.torch.builder import build_engine_core
    from tokenfleet.engine.config import EngineConfig
    from tokenfleet.models.loader import resolve_dtype

    core = build_engine_core(EngineConfig(model=str(default_model_dir), num_blocks=32, num_threads=2, device="cpu"))
    here = resolve_dtype("auto", CPU, model_dir=default_model_dir)  # this machine's choice (tests/unit/models/test_auto_dtype.py)
    assert here in ("float32", "bfloat16")
    assert core.runner.model.dtype == getattr(torch, here)  # type: ignore[attr-defined]
    assert core.kv_layout().dtype == here
