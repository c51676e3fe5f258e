"""``tokenfleet plan`` arithmetic, pinned to the sizing seeds, plus roofline sanity and the CLI."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tokenfleet.planning.calc import (
    GB,
    GPUS,
    MODELS,
    Layout,
    Model,
    decode_step_seconds,
    kv_budget,
    plan,
    prefill_seconds,
    replicas_for,
    resident_tokens,
)

L70 = MODELS["llama3-70b"]
H100 = GPUS["h100"]


def test_70b_gqa_kv_per_token_is_320_kb_in_fp16():
    assert L70.kv_bytes_per_token("fp16") == 2 * 80 * 8 * 128 * 2 == 327_680  # "320 KB ~ 0.3 MB"
    assert L70.kv_bytes_per_token("fp8") == 163_840
    assert 70e9 < L70.num_params < 71e9


def test_4xh100_tp4_with_140gb_of_weights_holds_about_560k_tokens():
    layout = Layout(H100, tp=4, kv_dtype="fp16")
    assert kv_budget(L70, layout, 140 * GB) == pytest.approx(180 * GB)
    assert resident_tokens(L70, layout, 140 * GB) == pytest.approx(560_000, rel=0.03)


def test_8xh100_with_140gb_weights_and_100gb_reserve_fits_about_300_4k_requests():
    layout = Layout(H100, tp=8, kv_dtype="fp16", reserve_bytes=100 * GB)
    assert kv_budget(L70, layout, 140 * GB) == pytest.approx(400 * GB)
    assert resident_tokens(L70, layout, 140 * GB) // 4096 == pytest.approx(300, rel=0.02)


def test_1000_users_at_30_tokens_per_s_on_4000_per_replica_need_8_replicas():
    assert replicas_for(1000 * 30, 4000) == 8
    assert replicas_for(8000, 4000) == 2  # exact multiples do not round up


def test_roofline_decode_is_bandwidth_bound_and_prefill_compute_bound():
    fp8 = Layout(H100, tp=8, weight_dtype="fp8", kv_dtype="fp8", decode_efficiency=1.0, prefill_efficiency=1.0)
    one = decode_step_seconds(L70, fp8, batch=1, context=1)
    assert one == pytest.approx(L70.num_params / (8 * H100.hbm_bytes_per_s), rel=0.01)  # weights read once
    assert decode_step_seconds(L70, fp8, 64, 4096) > one  # KV reads add up
    single = Layout(H100, tp=1, weight_dtype="fp8", prefill_efficiency=1.0)
    long = prefill_seconds(L70, single, 3000)
    assert long == pytest.approx(2 * L70.num_params * 3000 / H100.fp8_flops, rel=0.05)  # + attention's few %
    bf16 = Layout(H100, tp=1, weight_dtype="bf16", prefill_efficiency=1.0)
    assert prefill_seconds(L70, bf16, 3000) == pytest.approx(2 * long, rel=0.01)  # half the FP8 FLOP rate
    assert prefill_seconds(L70, fp8, 3000) < long  # eight GPUs share it
    a100 = Layout(GPUS["a100"], tp=8, weight_dtype="fp8")
    assert a100.gpu.flops("fp8") == a100.gpu.bf16_flops  # no FP8 tensor cores


def test_plan_composes_the_pieces(tmp_path):
    layout = Layout(H100, tp=8, weight_dtype="fp8", kv_dtype="fp8", reserve_bytes=10 * GB)
    p = plan(L70, layout, context=4096, batch=64, target_tokens_per_s=30_000)
    assert p.max_concurrent == p.resident_tokens // 4096 and p.tokens_per_s == pytest.approx(64 / p.decode_step_seconds)
    assert p.replicas_for_target == replicas_for(30_000, p.tokens_per_s)
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"num_hidden_layers": 80, "hidden_size": 8192, "num_attention_heads": 64,
                                  "num_key_value_heads": 8, "intermediate_size": 28672, "vocab_size": 128256}))
    assert Model.from_config(config).num_params == L70.num_params


def test_cli_prints_json():
    done = subprocess.run([sys.executable, "-m", "tokenfleet.cli", "plan", "--model", "llama3-8b", "--gpu", "h100",
                           "--tp", "1", "--weight-dtype", "bf16", "--kv-dtype", "bf16", "--target-tps", "10000",
                           "--json"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    body = json.loads(done.stdout)
    assert body["kv_bytes_per_token"] == 2 * 32 * 8 * 128 * 2 and body["replicas_for_target"] >= 1
