"""The fault benchmark's cluster (benchmarks/faults.py): `tokenfleet up` as a child process in its own cache folder,
its services found by command line or listening port, workers behind a fault proxy, etcd killed and started again,
the ledger read back, the batch in flight, and small file systems to fill."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import io
import json
import os
import re
import signal
import sqlite3
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import psutil

from benchmarks.serving.fault_load import MODEL, QUESTIONS
from benchmarks.serving.fault_proxy import FaultProxy
from benchmarks.serving.procs import free_port
from tokenfleet.cli.launcher import wait_listening

# --- the cluster ----------------------------------------------------------------------------------------------------

def default_model() -> str:
    from tokenfleet.models.gguf_import import DEFAULT_MODEL_NAME, ensure_model

    return str(ensure_model(DEFAULT_MODEL_NAME))


class Cluster:
    """`tokenfleet up` in its own cache folder (state file, ledger, certificates, audit log), as a child process."""

    def __init__(self, args: list[str], workdir: Path, model_dir: str, tmpdir: Path | None = None):
        self.workdir = workdir
        self.disks: Disks | None = None
        self.env = {**os.environ, "TOKENFLEET_CACHE_DIR": str(workdir), "PYTHONUNBUFFERED": "1"}
        if tmpdir is not None:  # where `up` makes its etcd's data folder
            self.env["TMPDIR"] = str(tmpdir)
        self.env.pop("TOKENFLEET_CERTS", None)
        self.log = workdir / "up.stderr"
        with open(self.log, "w") as err:
            # float32 unless the args name a dtype: the scenarios compare every completed text with the fault-free
            # run's, exactly, to catch a token lost or repeated on resume; in bf16 a resumed stream's recomputed
            # prefix (and a step shared with other requests) rounds in another order, so a continuation may leave
            # the fault-free text at a near-tie (tests/model/test_batch_invariance.py holds that bound)
            dtype = [] if "--dtype" in args else ["--dtype", "float32"]
            self.proc = subprocess.Popen([sys.executable, "-m", "tokenfleet.cli", "up", "--port", "0", "--model",
                                          model_dir, "--model-name", MODEL, *dtype, *args], stdout=subprocess.PIPE,
                                         stderr=err, text=True, env=self.env)
        assert self.proc.stdout is not None
        banner = self.proc.stdout.readline()
        if not banner.startswith("gateway: "):
            self.stop()
            raise RuntimeError(f"`tokenfleet up` did not start: {banner!r}\n{self.log.read_text()[-3000:]}")
        self.gateways = [banner.split()[1].removesuffix("/v1")]
        threading.Thread(target=self._read_banner, daemon=True).start()
        deadline = time.monotonic() + 30
        while "--gateways" in args and len(self.gateways) < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        self.restarted_etcd: subprocess.Popen | None = None
        self.proxies: dict[str, FaultProxy] = {}
        self.extra: list[subprocess.Popen] = []

    def _read_banner(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith("more gateways:"):
                self.gateways += [url.removesuffix("/v1") for url in line.split()[2:]]

    @property
    def state(self) -> dict[str, Any]:
        return json.loads((self.workdir / "cluster.json").read_text())

    @property
    def ledger(self) -> Path:
        return self.workdir / "ledger.sqlite3"

    def cli(self, *args: str) -> str:
        done = subprocess.run([sys.executable, "-m", "tokenfleet.cli", *args], env=self.env, capture_output=True,
                              text=True, timeout=120)
        if done.returncode:
            raise RuntimeError(f"tokenfleet {' '.join(args)}: {done.stderr[-2000:]}")
        return done.stdout

    def add_tenant(self, name: str, *flags: str) -> str:
        out = self.cli("tenants", "add", name, *flags)
        return re.search(r"tfk_\S+", out).group(0)  # type: ignore[union-attr]

    def pid_of(self, needle: str) -> int:
        """The `up` child whose command line contains ``needle``."""
        for child in _children(self.proc.pid):
            with contextlib.suppress(psutil.Error):
                if needle in " ".join(child.cmdline()) + " ":
                    return child.pid
        raise LookupError(f"no child of `up` runs {needle!r}")

    def restarts(self, service: str) -> int:
        return self.log.read_text().count(f"[supervisor] {service} restarted")

    def wait_restarted(self, service: str, before: int, since: float, timeout: float = 180) -> float | None:
        """Seconds from ``since`` until `up` reports ``service`` restarted (more than ``before`` times)."""
        while time.monotonic() - since < timeout:
            if self.restarts(service) > before:
                return time.monotonic() - since
            time.sleep(0.25)
        return None

    def metric(self, name: str, labels: str = "") -> float:
        """A counter summed over the gateways' /metrics."""
        total = 0.0
        for service, m in self.state.get("metrics", {}).items():
            if not service.startswith("gateway"):
                continue
            with contextlib.suppress(OSError), urllib.request.urlopen(f"http://{m['address']}/metrics", timeout=10) as r:
                for line in r.read().decode().splitlines():
                    if line.startswith(name + labels + " ") or (not labels and line.startswith(name + " ")):
                        total += float(line.rsplit(" ", 1)[1])
        return total

    def pid_listening(self, address: str) -> int:
        """The `up` child listening on ``address`` (host:port)."""
        port = int(address.rpartition(":")[2])
        for child in _children(self.proc.pid):
            with contextlib.suppress(psutil.Error):
                if any(c.laddr and c.laddr.port == port and c.status == psutil.CONN_LISTEN
                       for c in child.net_connections("tcp")):
                    return child.pid
        raise LookupError(f"no child of `up` listens on {address}")

    def kill_etcd(self) -> list[str]:
        """SIGKILL etcd; its command line, to start it again on the same data."""
        if self.restarted_etcd is not None:  # started again by an earlier scenario: this process's own child
            pid = self.restarted_etcd.pid
        else:
            pid = self.pid_of("--data-dir")
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")[:-1]
        os.kill(pid, signal.SIGKILL)
        if self.restarted_etcd is not None:
            self.restarted_etcd.wait()
        return cmdline

    def start_etcd(self, cmdline: list[str]) -> None:
        self.restarted_etcd = subprocess.Popen(cmdline, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def members(self) -> tuple[int, int] | None:
        """(replicas, gateways) registered in the cluster's etcd now, as the operator reads them; None: unreadable."""
        from tokenfleet.cli.context import ClusterContext
        from tokenfleet.cluster.etcd import EtcdClient

        state = self.state
        context = ClusterContext(state=state, registry=state.get("registry", ""), etcd=state["etcd"],
                                 certs=state.get("certs") or None, insecure=bool(state.get("insecure")))
        identity = context.plane.identity

        async def read() -> tuple[int, int]:
            client = EtcdClient(state["etcd"], identity=identity)
            try:
                return (len(await client.get_prefix("replicas/")), len(await client.get_prefix("gateways/")))
            finally:
                await client.close()

        try:
            return asyncio.run(asyncio.wait_for(read(), 5))
        except Exception:  # noqa: BLE001 - etcd down or restarting: not yet
            return None

    def wait_members(self, expected: tuple[int, int], since: float, timeout: float = 60) -> float | None:
        """Seconds from ``since`` until etcd lists at least ``expected`` (replicas, gateways) again."""
        while time.monotonic() - since < timeout:
            now = self.members()
            if now is not None and now[0] >= expected[0] and now[1] >= expected[1]:
                return time.monotonic() - since
            time.sleep(0.25)
        return None

    def add_proxied_worker(self, role: str) -> None:
        """One more worker (as `up`'s worker-0 was started, with ``role``) that advertises a fault proxy's address:
        every call to it (the gateway's, the router's, a decode worker's KV pull) goes through ``proxies[role]``."""
        pid = self.pid_of("--replica-id worker-0 ")
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")[:-1]
        argv[argv.index("--replica-id") + 1] = f"proxied-{role}"
        argv[argv.index("--role") + 1] = role
        if "--kv-tier" in argv:
            i = argv.index("--kv-tier")
            del argv[i:i + 4 if "--kv-tier-bytes" in argv else i + 2]
        port = free_port()
        proxy = self.proxies[role] = FaultProxy(f"127.0.0.1:{port}")
        proxy.name = f"proxied-{role}"
        argv += ["--host", "127.0.0.1", "--port", str(port), "--advertise-address", proxy.address]
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True,
                                env={**self.env, "TOKENFLEET_NUM_THREADS": "1"})
        self.extra.append(proc)
        wait_listening(f"proxied-{role}", proc)

    def stop(self) -> None:
        for proc in self.extra:
            proc.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=60)
            if proc.poll() is None:
                proc.kill()
        for proxy in self.proxies.values():
            proxy.close()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=120)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        if self.restarted_etcd is not None and self.restarted_etcd.poll() is None:
            self.restarted_etcd.kill()
            self.restarted_etcd.wait()


def _children(pid: int) -> list[psutil.Process]:
    try:
        return psutil.Process(pid).children()
    except psutil.Error:  # `up` gone
        return []


def ledger_rows(path: Path) -> list[tuple[str, str, int]]:
    """(request_id, status, completion_tokens) of every ledger record."""
    if not path.exists():
        return []
    with contextlib.closing(sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=30)) as db:
        return db.execute("SELECT request_id, status, completion_tokens FROM usage").fetchall()


# --- the batch in flight --------------------------------------------------------------------------------------------

def submit_batch(gateway: str, key: str, lines: int, tag: str) -> str:
    client = openai.OpenAI(base_url=f"{gateway}/v1", api_key=key, max_retries=2, timeout=60)
    data = "".join(json.dumps({"custom_id": f"{tag}-{i}", "method": "POST", "url": "/v1/chat/completions", "body": {
        "model": MODEL, "messages": [{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}], "max_tokens": 12,
        "temperature": 0}}) + "\n" for i in range(lines)).encode()
    file_id = client.files.create(file=("input.jsonl", io.BytesIO(data)), purpose="batch").id
    return client.batches.create(input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h").id


def batch_outcome(gateways: list[str], key: str, batch_id: str, lines: int, tag: str, timeout: float) -> dict[str, Any]:
    """Wait for the batch to finish; its lines missing from / duplicated in the output and error files."""
    deadline = time.monotonic() + timeout
    batch = None
    while time.monotonic() < deadline:
        for url in gateways:
            client = openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=30)
            with contextlib.suppress(openai.APIError):
                batch = client.batches.retrieve(batch_id)
                break
        if batch is not None and batch.status in ("completed", "failed", "expired", "cancelled"):
            break
        time.sleep(2)
    if batch is None or batch.status != "completed":
        return {"status": batch.status if batch else "unreachable", "missing": lines, "duplicated": 0}
    ids: list[str] = []
    for file_id in (batch.output_file_id, batch.error_file_id):
        if file_id:
            text = client.files.content(file_id).text
            ids += [json.loads(line)["custom_id"] for line in text.splitlines() if line.strip()]
    counts = collections.Counter(ids)
    expected = {f"{tag}-{i}" for i in range(lines)}
    return {"status": batch.status, "missing": len(expected - set(counts)),
            "duplicated": sum(c - 1 for c in counts.values() if c > 1),
            "errors": batch.request_counts.failed if batch.request_counts else None}


# --- small file systems, to fill ------------------------------------------------------------------------------------

class Disks:
    """Small tmpfs mounts under the cluster (where this machine lets the benchmark mount: root, in a container that
    allows it): ``state`` (the cache folder: the gateways' ledger and batch database, certificates, audit log),
    ``etcd`` (TMPDIR of `up`, where its etcd keeps its data) and ``tier`` (the workers' disk KV tier)."""

    SIZES = {"state": "128m", "etcd": "320m", "tier": "64m"}

    def __init__(self, root: Path):
        self.root, self.mounted, self.reason = root, [], ""
        for name, size in self.SIZES.items():
            path = root / name
            path.mkdir(parents=True, exist_ok=True)
            done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                                  capture_output=True, text=True)
            if done.returncode:
                self.reason = f"cannot mount a tmpfs here ({done.stderr.strip() or done.returncode})"
                break
            self.mounted.append(path)

    @property
    def ok(self) -> bool:
        return not self.reason

    def path(self, name: str) -> Path:
        return self.root / name

    @contextlib.contextmanager
    def full(self, name: str) -> Iterator[int]:
        """``name``'s file system filled to the last byte while inside; the bytes taken."""
        filler, taken = self.path(name) / ".filler", 0
        chunk = b"\0" * (1 << 20)
        try:
            with open(filler, "wb", buffering=0) as f:
                for size in (1 << 20, 4096, 1):
                    with contextlib.suppress(OSError):
                        while True:
                            taken += f.write(chunk[:size])
            yield taken
        finally:
            filler.unlink(missing_ok=True)

    def unmount(self) -> None:
        for path in reversed(self.mounted):
            subprocess.run(["umount", "-l", str(path)], capture_output=True)
