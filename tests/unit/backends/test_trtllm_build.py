"""FP8 engine build plan, the accuracy gate's arithmetic and verdicts, the registry record, and the
CLI; the gate's measurements run against the test double of the TensorRT-LLM API."""

from __future__ import annotations

import asyncio
import math
import subprocess
import sys

from tests import trtllm_double as double
from tokenfleet.backends.trtllm.build import BuildPlan, agreement, judge, perplexity, record_for, run_gate


def test_build_commands_quantize_fp8_weights_and_kv_then_build_for_h100():
    quantize, build = BuildPlan("/ckpt/llama-70b", "/engines/llama-70b-fp8", tp=8).commands()
    q = " ".join(quantize)
    assert "--qformat fp8" in q and "--kv_cache_dtype fp8" in q and "--tp_size 8" in q
    b = " ".join(build)
    for flag in ("--use_fp8_context_fmha enable", "--use_paged_context_fmha enable", "--gather_context_logits",
                 "--workers 8", "--checkpoint_dir /engines/llama-70b-fp8.ckpt"):
        assert flag in b, flag


def test_gate_arithmetic_and_verdicts():
    assert math.isclose(perplexity([-1.0, -1.0]), math.e)
    assert agreement([1, 2, 3, 4], [1, 2, 9, 4]) == 0.5 and agreement([], [5]) == 1.0
    ok = judge(5.0, 5.2, [1.0, 0.5])
    assert ok.passed and "passed" in ok.describe()
    worse = judge(5.0, 5.5, [0.2, 0.3])
    assert not worse.passed and len(worse.reasons) == 2 and "FAILED" in worse.describe()
    assert not judge(5.0, float("nan"), [1.0]).passed


def test_gate_measures_both_instances_and_the_record_follows_the_verdict():
    tokenize = lambda text: [10 + ord(c) % 50 for c in text]  # noqa: E731
    good = asyncio.run(run_gate(double.api(), "/engines/e", "/ckpt", tokenize))
    bad = asyncio.run(run_gate(double.api(logprob_offset=0.5), "/engines/e", "/ckpt", tokenize))
    assert good.passed and good.agreement == 1.0 and math.isclose(good.engine_ppl, good.reference_ppl)
    assert not bad.passed and bad.engine_ppl > bad.reference_ppl * 1.05
    plan = BuildPlan("/ckpt", "/engines/e", tp=8)
    assert record_for(plan, "llama", "fp8", good).status == "ready"
    record = record_for(plan, "llama", "fp8", bad)
    assert (record.status, record.backend, record.quantization, record.tensor_parallel_size) == \
        ("disabled", "trtllm", "fp8", 8)
    assert "FAILED" in record.description


def test_cli_dry_run_prints_the_commands_and_the_record():
    done = subprocess.run([sys.executable, "-m", "tokenfleet.cli", "engines", "build", "--checkpoint", "/ckpt/m",
                           "--output", "/engines/m-fp8", "--tp", "4", "--dry-run"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].startswith("$ ") and "quantize.py" in lines[0] and lines[1].startswith("$ trtllm-build")
    assert '"status": "disabled"' in done.stdout and '"backend": "trtllm"' in done.stdout
