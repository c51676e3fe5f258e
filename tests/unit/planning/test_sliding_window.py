"""Sliding-window attention (Gemma 3) in the planning arithmetic: HF configs, the presets, KV per
request, concurrency, the roofline step cost and KV transfers."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from dataclasses import replace

import pytest

from tokenfleet.engine.block_manager import BlockManager
from tokenfleet.engine.request import Request
from tokenfleet.engine.sampling_params import SamplingParams
from tokenfleet.engine.scheduler import Scheduler, SchedulerConfig
from tokenfleet.planning.calc import (
    GB,
    GPUS,
    MODELS,
    Layout,
    Model,
    attended_keys,
    attention_pairs,
    decode_step_seconds,
    plan,
    prefill_seconds,
    resident_tokens,
)
from tokenfleet.planning.costs import Roofline, StepShape
from tokenfleet.planning.scenario import add_scenario_flags, scenario_from_args
from tokenfleet.planning.sim import FleetConfig

G27 = MODELS["gemma3-27b"]
H100 = GPUS["h100"]
GEMMA_270M_CONFIG = {  # google/gemma-3-270m's config.json, the keys that matter here
    "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "vocab_size": 262144, "hidden_size": 640,
    "intermediate_size": 2048, "num_hidden_layers": 18, "num_attention_heads": 4, "num_key_value_heads": 1,
    "head_dim": 256, "tie_word_embeddings": True, "sliding_window": 512,
    "layer_types": (["sliding_attention"] * 5 + ["full_attention"]) * 3, "_sliding_window_pattern": 6,
}


def full_attention(model: Model) -> Model:
    """The same model as if every layer attended to (and kept) the whole context."""
    return replace(model, sliding_window=None, num_sliding_layers=0)


def write_config(tmp_path, config: dict) -> str:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    return str(path)


def test_a_gemma3_config_is_read_with_its_layer_types(tmp_path):
    model = Model.from_config(write_config(tmp_path, GEMMA_270M_CONFIG))
    assert replace(model, name="") == replace(MODELS["gemma3-270m"], name="")
    assert (model.sliding_window, model.num_sliding_layers, model.num_global_layers) == (512, 15, 3)
    assert model.tie_word_embeddings and model.num_params == pytest.approx(268e6, rel=0.01)  # published: 268M


def test_without_layer_types_gemma3_has_one_global_layer_in_six(tmp_path):
    config = {k: v for k, v in GEMMA_270M_CONFIG.items() if k not in ("layer_types", "_sliding_window_pattern")}
    config.update(num_hidden_layers=26, hidden_size=1152, intermediate_size=6912, sliding_window_pattern=6)
    config.pop("tie_word_embeddings")  # Gemma 3's default: tied
    model = Model.from_config(write_config(tmp_path, config))
    assert replace(model, name="") == replace(MODELS["gemma3-1b"], name="")
    assert model.num_sliding_layers == 22 and model.tie_word_embeddings
    config.pop("sliding_window_pattern")  # the default pattern of gemma3_text
    assert Model.from_config(write_config(tmp_path, config)).num_sliding_layers == 22
    nested = {"architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3",
              "text_config": {**config, "model_type": "gemma3_text"}}
    assert Model.from_config(write_config(tmp_path, nested)).num_sliding_layers == 22


def test_a_sliding_window_without_a_layer_pattern_is_not_guessed(tmp_path):
    qwen2 = {"model_type": "qwen2", "num_hidden_layers": 28, "hidden_size": 3584, "num_attention_heads": 28,
             "num_key_value_heads": 4, "intermediate_size": 18944, "vocab_size": 152064, "sliding_window": 131072,
             "use_sliding_window": False}
    model = Model.from_config(write_config(tmp_path, qwen2))
    assert model.window is None and not model.tie_word_embeddings
    assert model.kv_bytes_per_token("bf16", 200_000) == model.kv_bytes_per_token("bf16")


def test_gemma3_presets_have_their_published_geometries():
    gemma = {name: m for name, m in MODELS.items() if name.startswith("gemma3-")}
    assert sorted(gemma) == ["gemma3-12b", "gemma3-1b", "gemma3-270m", "gemma3-27b", "gemma3-4b"]
    published = {"gemma3-270m": 0.268e9, "gemma3-1b": 1.0e9, "gemma3-4b": 3.88e9, "gemma3-12b": 11.77e9,
                 "gemma3-27b": 27.0e9}  # text decoders (the 4B-27B checkpoints add a 0.4B vision tower)
    for name, m in gemma.items():
        assert m.num_sliding_layers == m.num_layers - m.num_layers // 6 and m.tie_word_embeddings
        assert m.window == (512 if name in ("gemma3-270m", "gemma3-1b") else 1024)
        assert m.num_params == pytest.approx(published[name], rel=0.01)
    assert (G27.num_layers, G27.hidden_size, G27.num_heads, G27.num_kv_heads, G27.head_dim) == (62, 5376, 32, 16, 128)
    assert (G27.num_global_layers, G27.num_sliding_layers, G27.intermediate_size) == (10, 52, 21504)


def test_kv_per_request_is_full_up_to_the_window_and_smaller_beyond():
    w, per_layer = 1024, 2 * 16 * 128 * 2  # K and V, 16 KV heads of 128, bf16
    naive = full_attention(G27)
    for context in (1, 100, w):
        assert G27.kv_bytes(context, "bf16") == naive.kv_bytes(context, "bf16") == 62 * context * per_layer
    assert G27.kv_bytes(4 * w, "bf16") == per_layer * (10 * 4 * w + 52 * w)
    assert naive.kv_bytes(4 * w, "bf16") / G27.kv_bytes(4 * w, "bf16") == pytest.approx(62 * 4 / (10 * 4 + 52))
    assert G27.kv_bytes_per_token("bf16") == 62 * per_layer  # no context: every layer keeps every token
    assert G27.kv_bytes_per_token("bf16", 4 * w) == G27.kv_bytes(4 * w, "bf16") / (4 * w)


def test_memory_holds_more_requests_of_a_long_context():
    layout = Layout(H100, tp=1, weight_dtype="fp8", kv_dtype="fp8", reserve_bytes=10 * GB)
    p = plan(G27, layout, context=32_768, batch=16)
    budget = p.kv_budget_bytes
    assert p.max_concurrent == int(budget // G27.kv_bytes(32_768, "fp8"))
    assert p.full_max_concurrent == int(budget // (32_768 * G27.kv_bytes_per_token("fp8"))) < p.max_concurrent / 4
    assert p.resident_tokens == resident_tokens(G27, layout, context=32_768) > resident_tokens(G27, layout)
    llama = plan(MODELS["llama3-8b"], layout)
    assert (llama.max_concurrent, llama.kv_bytes_per_token) == (llama.full_max_concurrent, llama.full_kv_bytes_per_token)


def test_pairs_and_keys_of_a_window_match_a_brute_force_count():
    for window in (None, 1, 3, 8):
        for start in range(0, 20, 3):
            for n in range(1, 12):
                seen = [range(max(0, q - window + 1) if window else 0, q + 1) for q in range(start, start + n)]
                assert attention_pairs(start, n, window) == sum(len(keys) for keys in seen)
                assert attended_keys(start, n, window) == len(set().union(*seen))


def test_the_roofline_decode_step_reads_less_kv_at_a_long_context():
    layout = Layout(H100, tp=1, weight_dtype="fp8", kv_dtype="fp8")
    sliding, naive = Roofline(G27, layout, 0.0), Roofline(full_attention(G27), layout, 0.0)
    batch, context = 64, 16_384
    shape = StepShape(batch, batch, batch, batch * context, batch * context)
    bandwidth = H100.hbm_bytes_per_s * layout.decode_efficiency
    read = G27.num_params + batch * 4096 * (10 * context + 52 * 1024)  # fp8: 4 KB per layer and token
    assert sliding.step_seconds(shape) == pytest.approx(read / bandwidth)
    assert naive.step_seconds(shape) == pytest.approx((G27.num_params + batch * context * 62 * 4096) / bandwidth)
    assert sliding.step_seconds(shape) < naive.step_seconds(shape) / 2
    assert decode_step_seconds(G27, layout, batch, context) == pytest.approx(sliding.step_seconds(shape))
    short = StepShape(batch, batch, batch, batch * 512, batch * 512)  # inside the window: the same
    assert sliding.step_seconds(short) == pytest.approx(naive.step_seconds(short))
    n = 8192  # one long prompt: the attention FLOPs shrink too
    assert prefill_seconds(G27, layout, n) < prefill_seconds(full_attention(G27), layout, n)
    prompt = StepShape(n, 1, 1, n * (n + 1) // 2, n)
    assert sliding.step_seconds(prompt) == pytest.approx(prefill_seconds(G27, layout, n), rel=1e-9)


def test_a_scheduled_steps_window_counts_are_per_row():
    scheduler = Scheduler(SchedulerConfig(max_num_batched_tokens=64), BlockManager(64, 16), "salt")
    params = SamplingParams(max_tokens=4)
    scheduler.add_request(Request("a", list(range(10)), params, max_tokens=4))
    scheduler.add_request(Request("b", list(range(100, 170)), params, max_tokens=4))  # chunked to 54
    scheduler.update(scheduler.schedule(0.0), {"a": 7})
    output = scheduler.schedule(0.0)  # "a" decodes at 11 tokens, "b" computes its last 16 after 54
    shape = StepShape.of(output, window=16)
    assert (shape.kv, shape.pairs) == (11 + 70, 11 + 16 * 54 + 16 * 17 // 2)
    assert shape.window_pairs == 11 + 16 * 16 and shape.window_kv == 11 + (16 + 16 - 1)
    assert shape.window_counts(16) == (shape.window_pairs, shape.window_kv)
    assert StepShape.of(output).window_pairs is None  # not counted without a window
    decode = StepShape(3, 3, 3, 3 * 5000, 3 * 5000)  # equal rows: counted from the totals
    assert decode.window_counts(1024) == (3 * 1024, 3 * 1024)


def test_a_transfer_moves_the_window_of_sliding_layers_only():
    fleet = FleetConfig(kv_bytes_per_token=10.0, sliding_window=512, window_kv_bytes_per_token=50.0)
    assert fleet.transfer_bytes(100) == 100 * 10 + 100 * 50
    assert fleet.transfer_bytes(4000) == 4000 * 10 + 512 * 50
    assert FleetConfig(kv_bytes_per_token=10.0).transfer_bytes(4000) == 4000 * 10
    with pytest.raises(ValueError):
        FleetConfig(sliding_window=0)


def test_a_gemma3_scenario_counts_memory_and_transfers_with_the_window():
    parser = argparse.ArgumentParser()
    add_scenario_flags(parser)
    args = parser.parse_args(["--model", "gemma3-27b", "--tp", "1", "--rate", "1"])
    s = scenario_from_args(args)
    per_layer = 2 * 16 * 128  # fp8
    assert (s.fleet.sliding_window, s.fleet.kv_bytes_per_token, s.fleet.window_kv_bytes_per_token) == (
        1024, 10 * per_layer, 52 * per_layer)
    layout = Layout(H100, tp=1, weight_dtype="fp8", kv_dtype="fp8", reserve_bytes=10 * GB)
    context = int(s.conversations.mean_prompt_tokens()) + args.output_tokens
    assert s.fleet.num_blocks == resident_tokens(G27, layout, context=context) // args.block_size
    assert s.fleet.num_blocks > resident_tokens(G27, layout) // args.block_size


def test_cli_shows_the_window_against_full_context_kv():
    done = subprocess.run([sys.executable, "-m", "tokenfleet.cli", "plan", "--model", "gemma3-27b", "--tp", "1",
                           "--context", "32768", "--batch", "16"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "52 of 62 layers keep a 1,024-token window" in done.stdout and "with full-context KV" in done.stdout
    done = subprocess.run([sys.executable, "-m", "tokenfleet.cli", "plan", "--model", "gemma3-27b", "--tp", "1",
                           "--json"], capture_output=True, text=True, timeout=60)
    body = json.loads(done.stdout)
    assert body["kv_bytes_per_token"] < body["full_kv_bytes_per_token"] == 62 * 2 * 16 * 128
    assert body["max_concurrent"] > body["full_max_concurrent"]
