"""`tokenfleet up` brings the whole topology up on loopback; `tokenfleet down` stops all of it."""

from __future__ import annotations

import os
import subprocess
import sys

import openai

from tests.integration.conftest import wait_for


def test_up_serves_openai_requests_and_down_stops_everything(default_model_dir, tmp_path):
    env = {**os.environ, "TOKENFLEET_CACHE_DIR": str(tmp_path), "PYTHONUNBUFFERED": "1"}
    up = subprocess.Popen(
        [sys.executable, "-m", "tokenfleet.cli", "up", "--port", "0", "--model", str(default_model_dir),
         "--model-name", "smol", "--ask", "What is the capital of France?"],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env,
    )
    try:
        assert up.stdout is not None
        banner = up.stdout.readline()
        assert banner.startswith("gateway: http://127.0.0.1:"), banner
        # --ask went through gateway -> router -> worker. (No fact as the oracle: the 135M model's greedy
        # answer to this one sits on a near-tie in bf16, "The capital..." vs "L'Etoile...".)
        answer = up.stdout.readline()
        assert answer.strip() and not answer.startswith(("Traceback", "error"))
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
