"""Real service processes on loopback."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, cast

import grpc
import pytest

from tokenfleet import envs
from tokenfleet.security.identity import Identity
from tokenfleet.security.plane import Plane
from tokenfleet.v1 import engine_pb2, engine_pb2_grpc


@dataclass
class UpCluster:
    """A `tokenfleet up` process (``start_up``): what it announced, its environment, and its stdout after that."""

    proc: subprocess.Popen
    announced: dict[str, str]  # "gateway:" -> its URL, "autoscaler metrics:" -> ...
    env: dict[str, str]
    log: Path  # its stderr
    said: list[str] = field(default_factory=list)  # stdout lines after the announcements (the launcher's own log)

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=120)


def start_up(tmp_path: Path, *args: str, wait: tuple[str, ...] = ("gateway:",), env: dict[str, str] | None = None
             ) -> UpCluster:
    """`tokenfleet up --port 0 ARGS` with its own cache folder, once it has printed every ``wait`` line."""
    env = {**os.environ, "TOKENFLEET_CACHE_DIR": str(tmp_path), "PYTHONUNBUFFERED": "1", **(env or {})}
    log = tmp_path / "up.stderr"
    with open(log, "w") as err:
        proc = subprocess.Popen([sys.executable, "-m", "tokenfleet.cli", "up", "--port", "0", *args],
                                stdout=subprocess.PIPE, stderr=err, text=True, env=env)
    stdout = cast("IO[str]", proc.stdout)  # stdout=PIPE
    announced: dict[str, str] = {}
    while not all(w in announced for w in wait):
        line = stdout.readline()
        if not line:
            proc.kill()
            raise AssertionError(f"tokenfleet up exited: {log.read_text()[-3000:]}")
        announced.update({w: line[len(w):].split()[0] for w in wait if line.startswith(w)})
    up = UpCluster(proc, announced, env, log)
    threading.Thread(target=lambda: up.said.extend(stdout), daemon=True).start()
    return up


@dataclass
class ServiceProcess:
    proc: subprocess.Popen
    address: str
    stderr_lines: list[str] = field(default_factory=list)
    stdout_lines: list[str] = field(default_factory=list)  # printed before LISTENING (e.g. "GRPC host:port")

    def announced(self, tag: str) -> str:
        """The address of a ``TAG host:port`` line the service printed on start."""
        return next(line.split()[1] for line in self.stdout_lines if line.startswith(f"{tag} "))

    def stop(self, timeout: float = 60) -> int:
        if self.proc.poll() is None:
            self.proc.terminate()
        return self.proc.wait(timeout=timeout)


def start_service(module: str, *args: str, startup_timeout: float = 180) -> ServiceProcess:
    """Start ``python -m module args`` and wait for its ``LISTENING host:port`` line."""
    env = {**os.environ, "TOKENFLEET_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", module, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
    )
    service = ServiceProcess(proc, "")
    threading.Thread(target=lambda: service.stderr_lines.extend(proc.stderr), daemon=True).start()
    deadline = time.monotonic() + startup_timeout
    assert proc.stdout is not None
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if line.startswith("LISTENING "):
            service.address = line.split()[1]
            return service
        service.stdout_lines.append(line)
        if not line and proc.poll() is not None:
            break
    proc.kill()
    raise RuntimeError(f"{module} did not start: {''.join(service.stderr_lines[-20:])}")


@pytest.fixture(scope="module")
def worker(default_model_dir) -> Iterator[ServiceProcess]:
    service = start_service(
        "tokenfleet.services.decode", "--model", str(default_model_dir), "--dtype", "float32",
        "--threads", "1", "--num-blocks", "256",
    )
    yield service
    service.stop()


def wait_for(predicate, what: str, deadline_s: float = 60.0):
    """Poll until ``predicate()`` is truthy (returns it); a generous deadline, never a speed assertion."""
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def plane(role: str) -> Plane:
    """The internal plane as a process of ``role`` sees it (the session's certificates)."""
    return Plane(Identity(envs.certs_dir(), role))


def channel(address: str, peer: str, role: str) -> grpc.Channel:
    """A channel to a ``peer`` server (worker, router, registry) with ``role``'s certificate."""
    return plane(role).sync_channel(address, peer)


def load_report(address: str) -> engine_pb2.LoadReport:
    """One load report from a worker's Load stream (as the router asks for it)."""
    with channel(address, "worker", "router") as channel_:
        stream = engine_pb2_grpc.EngineServiceStub(channel_).Load(engine_pb2.LoadRequest(interval_ms=50))
        report = next(iter(stream))
        stream.cancel()
        return report
