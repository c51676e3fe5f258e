"""The `tokenfleet` CLI, run as a real subprocess (`python -m tokenfleet.cli`)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest


def run_cli(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "TOKENFLEET_NUM_THREADS": "1"}
    return subprocess.run(
        [sys.executable, "-m", "tokenfleet.cli", *args],
        capture_output=True, text=True, env=env, timeout=300, input=stdin if stdin is not None else "",
    )


def test_generate_prints_text_and_token_count(default_model_dir):
    result = run_cli("generate", "Once upon a time", "--max-tokens", "5", "--dtype", "float32",
                     "--model", str(default_model_dir))
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip()
    assert "[5 tokens, finish=length]" in result.stderr
    assert "Traceback" not in result.stderr


def test_chat_with_a_message_prints_a_reply(default_model_dir):
    result = run_cli("chat", "What is the capital of France?", "--max-tokens", "12", "--dtype", "float32")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip()
    assert "Paris" in result.stdout  # the default model's greedy fp32 answer


@pytest.mark.parametrize("command", ["chat", "generate"])
def test_max_tokens_zero_is_a_clear_error_without_traceback(command):
    result = run_cli(command, "Hi", "--max-tokens", "0")
    assert result.returncode == 2
    assert "max_tokens" in result.stderr
    assert result.stderr.startswith("tokenfleet: error:")
    assert "Traceback" not in result.stderr
    assert result.stdout == ""


def test_bad_temperature_is_a_clear_error():
    result = run_cli("chat", "Hi", "--temperature", "-1")
    assert result.returncode == 2
    assert "temperature" in result.stderr and "Traceback" not in result.stderr


def test_missing_model_folder_is_a_clear_error(tmp_path):
    result = run_cli("generate", "Hi", "--max-tokens", "1", "--model", str(tmp_path / "nope"))
    assert result.returncode == 2
    assert "tokenfleet: error:" in result.stderr and "Traceback" not in result.stderr


def test_no_subcommand_exits_2_with_usage():
    result = run_cli()
    assert result.returncode == 2
    assert "usage" in result.stdout.lower()
    assert "generate" in result.stdout and "chat" in result.stdout


def test_unknown_subcommand_exits_2():
    result = run_cli("frobnicate")
    assert result.returncode == 2
    assert "invalid choice" in result.stderr


def test_generate_without_prompt_exits_2():
    result = run_cli("generate")
    assert result.returncode == 2
    assert "prompts" in result.stderr


def test_a_detached_up_passes_every_option_to_the_cluster_process():
    from tokenfleet.cli import build_parser
    from tokenfleet.cli.up import detached_up_argv

    given = ["up", "--workers", "2", "--prefill-workers", "1", "--threads", "3", "--port", "0", "--role", "decode",
             "--dtype", "float32", "--model", "/m", "--model", "g=/g", "--model-name", "smol", "--detach", "--ask", "hi",
             "--host", "10.0.0.5", "--auth", "on", "--insecure-no-auth", "--certs", "/c", "--insecure",
             "--autoscale", "--max-workers", "3", "--target-concurrency", "2.5", "--warm-pool", "1",
             "--ttft-objective", "0.7", "--scale-down-after", "5", "--scale-down-cooldown", "8",
             "--kv-pool-bytes", "123456789"]
    parent = build_parser().parse_args(given)
    child = build_parser().parse_args(detached_up_argv(parent))
    skip = {"detach", "ask", "func"}
    assert {k: v for k, v in vars(child).items() if k not in skip} == \
        {k: v for k, v in vars(parent).items() if k not in skip}
