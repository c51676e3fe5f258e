"""`tokenfleet up` brings the whole topology up on loopback; `tokenfleet down` stops all of it."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import openai
import pytest
import torch

from tests.integration.conftest import wait_for


def test_up_serves_openai_requests_and_down_stops_everything(default_model_dir, tmp_path):
    env = {**os.environ, "TOKENFLEET_CACHE_DIR": str(tmp_path), "PYTHONUNBUFFERED": "1"}
    up = subprocess.Popen(
        [sys.executable, "-m", "tokenfleet.cli", "up", "--port", "0", "--model", str(default_model_dir),
         "--model-name", "smol", "--ask", "What is the capital of Japan?"],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env,
    )
    try:
        assert up.stdout is not None
        banner = up.stdout.readline()
        assert banner.startswith("gateway: http://127.0.0.1:"), banner
        notice = up.stdout.readline()  # said on the console, not only in a log line
        assert notice.startswith("NO API KEYS") and "loopback only" in notice, notice
        # --ask went through gateway -> router -> worker, on up's defaults (the README's question: no near-tie in fp32
        # or bf16, so the answer does not hang on the machine's dtype or rounding; tests/integration/
        # test_correctness_gate.py holds the default path's answers)
        answer = up.stdout.readline()
        assert answer.strip() and not answer.startswith(("Traceback", "error"))
        assert "Tokyo" in answer or torch.cuda.is_available(), answer
        client = openai.OpenAI(base_url=banner.split()[1], api_key="unused", max_retries=0)
        reply = client.chat.completions.create(model="smol", messages=[{"role": "user", "content": "Hi"}], max_tokens=8)
        assert reply.choices[0].message.content
        assert (tmp_path / "cluster.json").exists()
        children = _children(up.pid)
        assert len(children) >= 4  # etcd, worker, router, gateway
        down = subprocess.run([sys.executable, "-m", "tokenfleet.cli", "down"], env=env, capture_output=True, text=True,
                              timeout=120)
        assert down.returncode == 0 and "stopped" in down.stdout
        assert up.wait(timeout=120) == 0
        assert not (tmp_path / "cluster.json").exists()
        wait_for(lambda: not any(_alive(pid) for pid in children), "services stopped", 30)
    finally:
        if up.poll() is None:
            up.kill()


def _children(pid: int) -> list[int]:
    result = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True)
    return [int(p) for p in result.stdout.split()]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_up_with_auth_on_requires_keys_from_tenants_it_prints_how_to_add(default_model_dir, tmp_path):
    env = {**os.environ, "TOKENFLEET_CACHE_DIR": str(tmp_path), "PYTHONUNBUFFERED": "1"}
    up = subprocess.Popen(
        [sys.executable, "-m", "tokenfleet.cli", "up", "--port", "0", "--model", str(default_model_dir),
         "--model-name", "smol", "--auth", "on"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)
    try:
        assert up.stdout is not None
        banner = up.stdout.readline()
        assert banner.startswith("gateway: http://127.0.0.1:"), banner
        assert "tokenfleet tenants add" in up.stdout.readline()
        base_url = banner.split()[1]
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=base_url, api_key="none", max_retries=0).models.list()
        added = subprocess.run([sys.executable, "-m", "tokenfleet.cli", "tenants", "add", "acme"], env=env,
                               capture_output=True, text=True, timeout=120)  # the cluster's etcd, over TLS
        assert added.returncode == 0, added.stderr
        key = added.stdout.strip().splitlines()[-1]
        client = openai.OpenAI(base_url=base_url, api_key=key, max_retries=0, timeout=120)
        reply = wait_for(lambda: _chat(client), "the gateway sees the new key")
        assert reply.choices[0].message.content
    finally:
        subprocess.run([sys.executable, "-m", "tokenfleet.cli", "down"], env=env, capture_output=True, timeout=120)
        if up.poll() is None:
            up.kill()


def test_up_refuses_to_serve_another_network_without_keys(tmp_path):
    env = {**os.environ, "TOKENFLEET_CACHE_DIR": str(tmp_path)}
    done = subprocess.run([sys.executable, "-m", "tokenfleet.cli", "up", "--host", "0.0.0.0", "--port", "0"],
                          env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "--auth on" in done.stderr and "--insecure-no-auth" in done.stderr
    assert not (tmp_path / "cluster.json").exists()


def test_down_signals_only_the_process_that_wrote_the_state(tmp_path):
    """A stale state file whose pid now belongs to another program: removed, nothing signalled."""
    env = {**os.environ, "TOKENFLEET_CACHE_DIR": str(tmp_path)}
    stranger = subprocess.Popen(["sleep", "60"])
    try:
        (tmp_path / "cluster.json").write_text(json.dumps({"pid": stranger.pid, "started": "1"}))
        done = subprocess.run([sys.executable, "-m", "tokenfleet.cli", "down"], env=env, capture_output=True,
                              text=True, timeout=60)
        assert done.returncode == 1 and "no running cluster" in done.stdout
        assert stranger.poll() is None  # still running: never signalled
        assert not (tmp_path / "cluster.json").exists()
    finally:
        stranger.kill()


def _chat(client):  # type: ignore[no-untyped-def]
    try:
        return client.chat.completions.create(model="smol", messages=[{"role": "user", "content": "Hi"}], max_tokens=4)
    except openai.APIError:
        return None


@pytest.mark.nightly  # tests/integration/test_registry.py serves two models on their own workers in the suite
def test_up_serves_two_models_at_once(default_model_dir, tmp_path):
    """One `tokenfleet up` with the default model and Gemma 3: both listed, both answer chats through the
    official client, streaming and not (Gemma 3 is a base model: its answers are only checked to exist)."""
    env = {**os.environ, "TOKENFLEET_CACHE_DIR": str(tmp_path), "PYTHONUNBUFFERED": "1"}
    from tokenfleet.models.gguf_import import GEMMA3_MODEL_NAME, ensure_model

    gemma = ensure_model(GEMMA3_MODEL_NAME)  # the shared cache's import, named explicitly below
    up = subprocess.Popen(
        [sys.executable, "-m", "tokenfleet.cli", "up", "--port", "0", "--model", f"smol={default_model_dir}",
         "--model", f"gemma={gemma}"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)
    try:
        assert up.stdout is not None
        banner = up.stdout.readline()
        assert banner.startswith("gateway: http://127.0.0.1:") and "smol, gemma" in banner, banner
        client = openai.OpenAI(base_url=banner.split()[1], api_key="unused", max_retries=0, timeout=120)
        assert {"smol", "gemma"} <= {m.id for m in client.models.list()}
        for model in ("smol", "gemma"):
            messages = [{"role": "user", "content": "What is the capital of France?"}]
            whole = client.chat.completions.create(model=model, messages=messages, max_tokens=8, temperature=0)
            assert whole.model == model and whole.usage.completion_tokens > 0
            streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
                model=model, messages=messages, max_tokens=8, temperature=0, stream=True) if c.choices)
            assert streamed == whole.choices[0].message.content
        # Gemma's own tokenizer (262k tokens) under a grammar: a JSON schema, then a forced tool call
        schema = {"type": "object", "properties": {"city": {"enum": ["Paris", "Lyon"]}}, "required": ["city"],
                  "additionalProperties": False}  # else a base model keeps inventing keys until max_tokens
        answer = client.chat.completions.create(
            model="gemma", messages=[{"role": "user", "content": "Capital of France, as JSON."}], max_tokens=64,
            temperature=0, response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": schema}})
        assert json.loads(answer.choices[0].message.content)["city"] in ("Paris", "Lyon")
        tool = {"type": "function", "function": {"name": "weather", "parameters": schema}}
        call = client.chat.completions.create(
            model="gemma", messages=[{"role": "user", "content": "Weather in Paris?"}], max_tokens=64, tools=[tool],
            temperature=0,
            tool_choice={"type": "function", "function": {"name": "weather"}})
        calls = call.choices[0].message.tool_calls
        assert calls and calls[0].function.name == "weather"
        assert json.loads(calls[0].function.arguments)["city"] in ("Paris", "Lyon")
    finally:
        subprocess.run([sys.executable, "-m", "tokenfleet.cli", "down"], env=env, capture_output=True, timeout=120)
        if up.poll() is None:
            up.kill()
