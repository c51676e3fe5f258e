"""Child processes of the serving benchmark: each in its own session (Ctrl-C reaches only the
benchmark), killed if the benchmark dies; readiness helpers."""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path


def _die_with_parent() -> None:
    with contextlib.suppress(Exception):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


@dataclass
class Child:
    name: str
    proc: subprocess.Popen
    log_path: Path
    address: str = ""

    def log_tail(self, lines: int = 30) -> str:
        with contextlib.suppress(OSError):
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        return ""


class Children:
    """``insecure``: the services run plaintext (--insecure); otherwise on the default mutual-TLS
    plane, with certificates made for this run (``plane(role)`` for the benchmark's own clients)."""

    def __init__(self, insecure: bool = False) -> None:
        from tokenfleet.security import certs

        self.log_dir = Path(tempfile.mkdtemp(prefix="tokenfleet-serve-bench-"))
        self.children: list[Child] = []
        self.etcd = None
        self.insecure = insecure
        self.certs = None if insecure else self.log_dir / "certs"
        if self.certs is not None:
            certs.ensure(self.certs)

    def plane(self, role: str):  # type: ignore[no-untyped-def]
        from tokenfleet.security.identity import Identity
        from tokenfleet.security.plane import Plane

        return Plane.plaintext() if self.certs is None else Plane(Identity(self.certs, role))

    def start_etcd(self):  # type: ignore[no-untyped-def]
        """etcd for the run: TLS with client certificates unless ``insecure``."""
        from tokenfleet.cluster.etcd_server import EtcdServer

        self.etcd = EtcdServer.create(certs=self.certs).start()
        return self.etcd

    def spawn(self, name: str, argv: list[str], env: dict[str, str] | None = None, stdout_pipe: bool = False) -> Child:
        log_path = self.log_dir / f"{name}.log"
        log = open(log_path, "w")  # noqa: SIM115 - the child keeps it
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE if stdout_pipe else log, stderr=log, text=True,
                                env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
                                start_new_session=True, preexec_fn=_die_with_parent)
        log.close()
        child = Child(name, proc, log_path)
        self.children.append(child)
        return child

    def spawn_service(self, name: str, module: str, *args: str, threads: int = 1, timeout: float = 300,
                      cores: str | None = None) -> Child:
        """``python -m module args``, ready when it prints ``LISTENING host:port``; ``cores`` pins it (taskset -c)."""
        pin = ["taskset", "-c", cores] if cores is not None else []
        plane = ["--insecure"] if self.certs is None else ["--certs", str(self.certs)]
        child = self.spawn(name, [*pin, sys.executable, "-m", module, *args, *plane],
                           env={"TOKENFLEET_NUM_THREADS": str(threads)}, stdout_pipe=True)
        assert child.proc.stdout is not None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            line = child.proc.stdout.readline()
            if line.startswith("LISTENING "):
                child.address = line.split()[1]
                threading.Thread(target=child.proc.stdout.read, daemon=True).start()  # keep the pipe drained
                return child
            if not line and child.proc.poll() is not None:
                break
        raise RuntimeError(f"{name} did not start (exit {child.proc.poll()}):\n{child.log_tail()}")

    def stop(self, child: Child, timeout: float = 30) -> None:
        if child.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(child.proc.pid, signal.SIGTERM)
            try:
                child.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                pass
        with contextlib.suppress(ProcessLookupError):  # stragglers of its session (vLLM's engine core)
            os.killpg(child.proc.pid, signal.SIGKILL)
        child.proc.wait()
        if child in self.children:
            self.children.remove(child)

    def stop_all(self) -> None:
        for child in reversed(list(self.children)):
            self.stop(child)
        if self.etcd is not None:
            self.etcd.cleanup()
            self.etcd = None

    def remove_logs(self) -> None:
        shutil.rmtree(self.log_dir, ignore_errors=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_completion(url: str, model: str, timeout: float, alive: Callable[[], bool]) -> None:
    """Until a one-token completion succeeds (the server has a model and, for tokenfleet, a worker)."""
    body = json.dumps({"model": model, "prompt": [300, 301, 302], "max_tokens": 1}).encode()
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not alive():
            raise RuntimeError(f"server behind {url} exited while starting")
        request = urllib.request.Request(f"{url}/v1/completions", data=body, headers={"content-type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=60):
                return
        except OSError:
            time.sleep(1.0)
    raise TimeoutError(f"{url} not serving after {timeout}s")




def worker_pids(up_pid: int) -> list[int]:
    """The engine worker processes alive under ``tokenfleet up`` (serving, standby or starting alike); none when up
    itself is gone."""
    import psutil

    try:
        children = psutil.Process(up_pid).children(recursive=True)
    except psutil.Error:
        return []
    pids = []
    for child in children:
        try:
            if "tokenfleet.services.decode" in " ".join(child.cmdline()):
                pids.append(child.pid)
        except psutil.Error:  # exited meanwhile
            pass
    return pids
