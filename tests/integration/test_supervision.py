"""`tokenfleet up` supervises its services like compose's restart policy: kill -9 of a worker (mid-stream), of the
router and of the registry each brings that service back on its address, and the cluster keeps serving.

Before, the launcher stopped the whole cluster when any one process died ("a service exited; stopping the
cluster"), even after the killed worker's stream had resumed elsewhere and completed."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import openai

from tests.integration.conftest import wait_for
from tests.integration.test_launcher import _children


def service_pid(up_pid: int, needle: str) -> int:
    for pid in _children(up_pid):
        try:
            if needle in Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode():
                return pid
        except OSError:
            continue
    raise AssertionError(f"no child runs {needle!r}")


def test_up_restarts_a_killed_worker_router_and_registry_and_keeps_serving(default_model_dir, tmp_path):
    env = {**os.environ, "TOKENFLEET_CACHE_DIR": str(tmp_path), "PYTHONUNBUFFERED": "1"}
    log = tmp_path / "up.stderr"
    with open(log, "w") as err:
        up = subprocess.Popen([sys.executable, "-m", "tokenfleet.cli", "up", "--workers", "2", "--port", "0", "--model",
                               str(default_model_dir), "--model-name", "smol"],
                              stdout=subprocess.PIPE, stderr=err, text=True, env=env)
    try:
        assert up.stdout is not None
        banner = up.stdout.readline()
        assert banner.startswith("gateway: http://127.0.0.1:"), banner
        client = openai.OpenAI(base_url=banner.split()[1], api_key="unused", max_retries=0, timeout=120)

        def restarted(service: str, times: int = 1) -> bool:
            return log.read_text().count(f"[supervisor] {service} restarted") >= times

        # the worker serving a stream killed mid-way (the one x-tokenfleet-replica names): the stream resumes on the
        # other worker and delivers every token it asked for; the killed one comes back
        done: list[tuple[int, int, str]] = []

        def stream() -> None:
            with client.chat.completions.with_streaming_response.create(
                    model="smol", messages=[{"role": "user", "content": "Tell a story."}], max_tokens=120, stream=True,
                    temperature=0, stream_options={"include_usage": True}, extra_body={"ignore_eos": True}) as response:
                replica, content, usage = response.headers["x-tokenfleet-replica"], 0, 0
                for chunk in response.parse():
                    content += bool(chunk.choices and chunk.choices[0].delta.content)
                    usage = chunk.usage.completion_tokens if chunk.usage else usage
                    if content == 10 and not done:
                        os.kill(service_pid(up.pid, f"--replica-id {replica} "), signal.SIGKILL)
                        done.append((0, 0, replica))
            done.append((content, usage, replica))

        reader = threading.Thread(target=stream)
        reader.start()
        reader.join(timeout=300)
        assert len(done) == 2, done  # killed mid-stream, then completed
        killed, (content, usage, _) = done[0][2], done[1]
        assert usage == 120 and content >= 100, done  # every token (a chunk may carry a few)
        wait_for(lambda: restarted(killed), f"{killed} restarted", 180)

        for service, needle in (("router", "tokenfleet.services.router"), ("registry", "tokenfleet.services.registry")):
            os.kill(service_pid(up.pid, needle), signal.SIGKILL)
            wait_for(lambda s=service: restarted(s), f"{service} restarted", 120)
            assert up.poll() is None  # the cluster stays up

            def serves() -> bool:
                try:
                    return bool(client.chat.completions.create(
                        model="smol", messages=[{"role": "user", "content": "Hi"}], max_tokens=4).choices)
                except openai.APIError:
                    return False

            wait_for(serves, f"serving after the {service} came back", 120)
        listed = subprocess.run([sys.executable, "-m", "tokenfleet.cli", "models", "list"], env=env, capture_output=True,
                                text=True, timeout=120)  # the restarted registry, on the address the CLI knows
        assert listed.returncode == 0 and "smol@v1" in listed.stdout, listed.stderr
        assert "exited: code -9" in log.read_text() and "stopping the cluster" not in log.read_text()
        down = subprocess.run([sys.executable, "-m", "tokenfleet.cli", "down"], env=env, capture_output=True, text=True,
                              timeout=120)
        assert down.returncode == 0
        assert up.wait(timeout=120) == 0
    finally:
        if up.poll() is None:
            up.kill()
