from __future__ import annotations

import os
import subprocess
import sys


def run_cli(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "TOKENFLEET_NUM_THREADS": "1"}
    return subprocess.run(
        [sys.executable, "-m", "tokenfleet.cli", *args], capture_output=True, text=True, env=env, timeout=300
    )


def test_generate_prints_text_and_counts(default_model_dir):
    result = run_cli("generate", "Once upon a time", "--max-tokens", "5", "--dtype", "float32")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip()
    assert "[5 tokens, finish=length]" in result.stderr


def test_chat_answers_one_message(default_model_dir):
    result = run_cli("chat", "What is the capital of France?", "--max-tokens", "12", "--dtype", "float32")
    assert result.returncode == 0, result.stderr
    assert "Paris" in result.stdout  # greedy fp32 answer of the default model (see test_hf_parity)


def test_bad_arguments_give_a_clear_error_without_traceback():
    result = run_cli("chat", "Hi", "--max-tokens", "0")
    assert result.returncode == 2
    assert "max_tokens must be a positive integer" in result.stderr
    assert "Traceback" not in result.stderr


def test_no_command_prints_help():
    result = run_cli()
    assert result.returncode == 2 and "usage" in result.stdout.lower()
