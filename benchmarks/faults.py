"""Faults under load, as one standing report: a real `tokenfleet up` cluster (3 workers, --autoscale, --auth on, two
tenants and an --internal one, two gateways sharing one database, a batch in flight) under a steady open-loop load of
mixed greedy requests (chat, streaming chat, json_schema, a forced tool call, n=2), while each scenario breaks one
thing: SIGKILL of the worker serving the most streams (3x), of the router, of the registry, of a gateway; SIGSTOP of a
worker for 20 s; etcd killed for 10 s and 60 s and restarted with its data. Then a noisy neighbour (one tenant's
full-context prompts beside another's streams) and load (1,024 concurrent streams; 256 streams back to back for 60 s)
through `up` on its defaults.

Per scenario the report counts requests sent, completed, failed (by status), resumed (the gateways' resume counter),
acknowledged responses lost (a response whose final chunk or whole body reached the client but whose ledger record
is missing), ledger records duplicated, streams whose text differs from a fault-free run of the same seeded load,
invalid JSON (schema or tool arguments), streams cut without a finish or an error, batch lines missing or duplicated,
and the time until a new request was served again after the fault.

    python benchmarks/faults.py                      # every scenario (~15 minutes on 2 cores)
    python benchmarks/faults.py --scenarios worker-kill router-kill
    python benchmarks/faults.py --short              # one scenario per kind (what the test suite runs)

Writes benchmarks/reports/<date>-<machine>-faults.md and .json (``--out``).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import io
import json
import os
import re
import signal
import sqlite3
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jsonschema
import openai

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.serving.fault_proxy import FaultProxy  # noqa: E402
from benchmarks.serving.procs import free_port  # noqa: E402
from benchmarks.serving.report import git_head, machine_line  # noqa: E402
from tokenfleet.launcher import wait_listening  # noqa: E402

REPORTS = Path(__file__).resolve().parent / "reports"
MODEL = "smol"
CITY = {"type": "object", "properties": {"city": {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 20}, "country": {"enum": ["FR", "IT", "DE", "ES"]}},
    "required": ["name", "country"], "additionalProperties": False}, "sunny": {"type": "boolean"}},
    "required": ["city", "sunny"], "additionalProperties": False}
WEATHER_PARAMETERS = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                       "unit": {"enum": ["celsius", "fahrenheit"]}},
                      "required": ["city", "unit"], "additionalProperties": False}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
                                            "parameters": WEATHER_PARAMETERS}}
QUESTIONS = ["What is the capital of France?", "Name three colours of the rainbow.", "Why is the sky blue?",
             "Give me a tip for learning to cook.", "What is two plus two?", "Describe a cat in one sentence."]
CITIES = ["Paris", "Rome", "Berlin", "Madrid", "Lyon", "Milan"]
KINDS = ("chat", "stream", "json", "tool", "n2")
CLIENT_TIMEOUT_S = 120.0


# --- the load -------------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Spec:
    """One request of the seeded load: the i-th of a scenario is the same in every scenario (kind, prompt, tenant)."""

    index: int
    kind: str
    prompt: int
    tenant: str

    @property
    def key(self) -> tuple[str, int]:
        return self.kind, self.prompt

    @staticmethod
    def of(i: int, tenants: tuple[str, ...]) -> Spec:
        return Spec(i, KINDS[i % len(KINDS)], (i // len(KINDS)) % len(QUESTIONS), tenants[i % len(tenants)])

    def body(self) -> dict[str, Any]:
        q, city = QUESTIONS[self.prompt], CITIES[self.prompt]
        if self.kind == "json":
            return dict(messages=[{"role": "user", "content": f"Describe the weather in {city} as JSON."}],
                        max_tokens=60, response_format={"type": "json_schema", "json_schema": {
                            "name": "city", "schema": CITY, "strict": True}})
        if self.kind == "tool":
            return dict(messages=[{"role": "user", "content": f"What's the weather in {city}?"}], max_tokens=60,
                        tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "get_weather"}},
                        parallel_tool_calls=False)
        return dict(messages=[{"role": "user", "content": q}], max_tokens=24, **({"n": 2} if self.kind == "n2" else {}))


@dataclass
class Result:
    spec: Spec
    gateway: str
    started: float
    ended: float = 0.0
    status: str = ""  # "ok", an HTTP status, "connection", "timeout", "cut" (a stream ended without a finish)
    response_id: str = ""
    replica: str = ""
    texts: dict[int, str] = field(default_factory=dict)  # per choice: content, or the tool call's arguments
    finish: dict[int, str] = field(default_factory=dict)
    completion_tokens: int | None = None
    error: str = ""

    @property
    def acknowledged(self) -> bool:
        """Its final chunk (every choice's finish) or whole body reached the client."""
        return self.status == "ok"


def run_one(spec: Spec, gateway: str, key: str, on_replica: Callable[[str, int], None] | None = None,
            preamble: str = "", salt: str = "") -> Result:
    """One request through the official client (retries off); a stream's replica is told to ``on_replica`` (+1 when it
    starts, -1 when it ends) so a scenario can kill the busiest worker. ``preamble``: a system message before the
    request's own (a prompt long enough to be prefilled on a prefill worker); ``salt``: its prefix-cache salt."""
    client = openai.OpenAI(base_url=f"{gateway}/v1", api_key=key, max_retries=0, timeout=CLIENT_TIMEOUT_S)
    result = Result(spec, gateway, time.monotonic())
    body = dict(model=MODEL, temperature=0, **spec.body())
    if preamble:
        body["messages"] = [{"role": "system", "content": preamble}, *body["messages"]]
    if salt:
        body["extra_body"] = {"cache_salt": salt}
    try:
        if spec.kind == "chat":
            raw = client.chat.completions.with_raw_response.create(**body)
            result.replica = raw.headers.get("x-tokenfleet-replica", "")
            reply = raw.parse()
            result.response_id = reply.id
            for choice in reply.choices:
                result.texts[choice.index] = choice.message.content or ""
                result.finish[choice.index] = choice.finish_reason
            result.completion_tokens = reply.usage.completion_tokens if reply.usage else None
            result.status = "ok"
        else:
            _stream(client, body, result, on_replica)
    except openai.APIStatusError as e:
        result.status, result.error = str(e.status_code), _message(e)
    except openai.APITimeoutError as e:
        result.status, result.error = "timeout", str(e)
    except openai.APIConnectionError as e:
        result.status, result.error = "connection", str(e)
    except openai.APIError as e:  # an error event inside the stream
        code = (e.body or {}).get("code") if isinstance(e.body, dict) else None
        result.status, result.error = f"stream-error:{code or 'error'}", str(e)
    result.ended = time.monotonic()
    return result


def _stream(client: openai.OpenAI, body: dict[str, Any], result: Result,
            on_replica: Callable[[str, int], None] | None) -> None:
    n = body.get("n", 1)
    with client.chat.completions.with_streaming_response.create(
            stream=True, stream_options={"include_usage": True}, **body) as response:
        result.replica = response.headers.get("x-tokenfleet-replica", "")
        if on_replica is not None and result.replica:
            on_replica(result.replica, +1)
        try:
            for chunk in response.parse():
                result.response_id = result.response_id or chunk.id
                for choice in chunk.choices:
                    calls = choice.delta.tool_calls or []
                    piece = choice.delta.content or "".join(c.function.arguments or "" for c in calls if c.function)
                    result.texts[choice.index] = result.texts.get(choice.index, "") + piece
                    if choice.finish_reason:
                        result.finish[choice.index] = choice.finish_reason
                if chunk.usage:
                    result.completion_tokens = chunk.usage.completion_tokens
        finally:
            if on_replica is not None and result.replica:
                on_replica(result.replica, -1)
    result.status = "ok" if len(result.finish) == n and result.completion_tokens is not None else "cut"


def _message(e: openai.APIStatusError) -> str:
    body = e.body if isinstance(e.body, dict) else {}
    retry_after = e.response.headers.get("retry-after")
    return f"{body.get('message', str(e))[:160]} (retry-after {retry_after})"


def valid(result: Result) -> bool | None:
    """Whether a constrained completion's output is valid (JSON that fits the schema / the tool's parameters)."""
    if result.spec.kind not in ("json", "tool") or not result.acknowledged:
        return None
    schema = CITY if result.spec.kind == "json" else WEATHER_PARAMETERS
    try:
        for text in result.texts.values():
            jsonschema.validate(json.loads(text), schema)
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


class Load:
    """A steady open-loop load: request i starts at i / rate seconds, whatever the others do."""

    def __init__(self, gateways: list[str], keys: dict[str, str], rate: float, long_prompts: str = ""):
        """``long_prompts``: a name; each request then starts with a system message of its own (~200 tokens) and a
        cache salt of that name (nothing cached from another scenario: every prompt is prefilled in full)."""
        self.gateways, self.keys, self.rate, self.long_prompts = gateways, keys, rate, long_prompts
        self.results: list[Result] = []
        self.open_streams: collections.Counter[str] = collections.Counter()  # replica -> streams open on it
        self._lock = threading.Lock()

    def _on_replica(self, replica: str, delta: int) -> None:
        with self._lock:
            self.open_streams[replica] += delta

    def busiest(self, wait: float = 10.0) -> str | None:
        """The replica with the most open streams (waiting up to ``wait`` s for one to have any)."""
        deadline = time.monotonic() + wait
        while True:
            with self._lock:
                ranked = [r for r, n in self.open_streams.most_common() if n > 0]
            if ranked or time.monotonic() > deadline:
                return ranked[0] if ranked else None
            time.sleep(0.05)

    def run(self, duration: float, during: Callable[[Load, float], None] | None = None) -> list[Result]:
        """Send for ``duration`` seconds (``during(load, t0)`` runs beside, e.g. the fault), then wait for every
        request to end."""
        tenants = tuple(self.keys)
        count = int(duration * self.rate)
        t0 = time.monotonic()
        side = threading.Thread(target=during, args=(self, t0), daemon=True) if during else None
        if side:
            side.start()
        with ThreadPoolExecutor(max_workers=64) as pool:
            futures = []
            for i in range(count):
                delay = t0 + i / self.rate - time.monotonic()
                if delay > 0:
                    time.sleep(delay)
                spec = Spec.of(i, tenants)
                futures.append(pool.submit(run_one, spec, self.gateways[i % len(self.gateways)],
                                           self.keys[spec.tenant], self._on_replica,
                                           preamble(i % (len(KINDS) * len(QUESTIONS))) if self.long_prompts else "",
                                           f"{self.long_prompts}-{i}" if self.long_prompts else ""))
            results = [f.result() for f in futures]
        if side:
            side.join()
        self.results = results
        return results


def preamble(i: int) -> str:
    """A system message of ~200 tokens, one per (kind, prompt) of the load (``i``: request index modulo their
    number), so that a request's text can be compared with the baseline's."""
    words = (Path(__file__).resolve().parent / "data" / "perplexity_text.txt").read_text().split()
    start = (i * 37) % (len(words) - 160)
    return "Background reading: " + " ".join(words[start:start + 150])


def probe_until_served(gateway_urls: list[str], key: str, since: float, timeout: float = 90.0) -> float | None:
    """Seconds from ``since`` until a new one-token request is served (tried every 0.25 s on every gateway)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for url in gateway_urls:
            client = openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=10)
            with contextlib.suppress(openai.APIError):
                client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=1)
                return time.monotonic() - since
        time.sleep(0.25)
    return None


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
            self.proc = subprocess.Popen([sys.executable, "-m", "tokenfleet.cli", "up", "--port", "0", "--model",
                                          model_dir, "--model-name", MODEL, *args], stdout=subprocess.PIPE,
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
        for pid in _children(self.proc.pid):
            with contextlib.suppress(OSError):
                if needle in Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode() + " ":
                    return pid
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
        inodes = set()
        for table in ("/proc/net/tcp", "/proc/net/tcp6"):
            with contextlib.suppress(OSError):
                for row in Path(table).read_text().splitlines()[1:]:
                    fields = row.split()
                    if int(fields[1].rpartition(":")[2], 16) == port and fields[3] == "0A":  # LISTEN
                        inodes.add(f"socket:[{fields[9]}]")
        for pid in _children(self.proc.pid):
            with contextlib.suppress(OSError):
                if any(os.readlink(fd) in inodes for fd in Path(f"/proc/{pid}/fd").iterdir()):
                    return pid
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


def _children(pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


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


# --- scenarios ------------------------------------------------------------------------------------------------------

@dataclass
class Scenario:
    name: str
    kind: str
    duration: float  # seconds of load
    fault: Callable[[Cluster, Load, float, dict[str, Any]], None] | None  # (cluster, load, t0, notes)
    skipped: str = ""  # why it is not run here


def at(t0: float, seconds: float) -> None:
    time.sleep(max(0.0, t0 + seconds - time.monotonic()))


def kill_busiest_worker(cluster: Cluster, load: Load, t0: float, notes: dict[str, Any]) -> None:
    at(t0, 8)
    replica = load.busiest() or "worker-0"
    before = cluster.restarts(replica)
    notes["killed"] = f"{replica} (with {load.open_streams[replica]} open streams seen by the internal tenant)"
    os.kill(cluster.pid_of(f"--replica-id {replica} "), signal.SIGKILL)
    notes["fault_at"] = time.monotonic()
    notes["restarted_after_s"] = cluster.wait_restarted(replica, before, since=notes["fault_at"])


def kill_service(service: str, needle: str) -> Callable[[Cluster, Load, float, dict[str, Any]], None]:
    """SIGKILL of ``service``: the `up` child whose command line has ``needle``, or (a gateway) listens on its URL."""
    def fault(cluster: Cluster, load: Load, t0: float, notes: dict[str, Any]) -> None:
        at(t0, 6)
        before = cluster.restarts(service)
        pid = (cluster.pid_listening(cluster.gateways[int(service.rpartition("-")[2])].removeprefix("http://"))
               if service.startswith("gateway-") else cluster.pid_of(needle))
        os.kill(pid, signal.SIGKILL)
        notes["fault_at"] = time.monotonic()
        notes["recovered_s"] = probe_until_served(cluster.gateways, load.keys["ops"], notes["fault_at"])
        notes["restarted_after_s"] = cluster.wait_restarted(service, before, since=notes["fault_at"])
    return fault


def stop_worker(cluster: Cluster, load: Load, t0: float, notes: dict[str, Any]) -> None:
    at(t0, 5)
    replica = load.busiest() or "worker-0"
    pid = cluster.pid_of(f"--replica-id {replica} ")
    notes["stopped"] = f"{replica} (with {load.open_streams[replica]} open streams) for 20 s"
    os.kill(pid, signal.SIGSTOP)
    notes["fault_at"] = time.monotonic()
    try:
        notes["recovered_s"] = probe_until_served(cluster.gateways, load.keys["ops"], notes["fault_at"], timeout=19)
        at(notes["fault_at"], 20)
    finally:
        os.kill(pid, signal.SIGCONT)


def etcd_down(seconds: float) -> Callable[[Cluster, Load, float, dict[str, Any]], None]:
    def fault(cluster: Cluster, load: Load, t0: float, notes: dict[str, Any]) -> None:
        at(t0, 5)
        cmdline = cluster.kill_etcd()
        notes["fault_at"] = time.monotonic()
        at(notes["fault_at"], seconds)
        cluster.start_etcd(cmdline)
        back = time.monotonic()
        notes["served_again_after_return_s"] = probe_until_served(cluster.gateways, load.keys["ops"], back)
    return fault


def disk_full(name: str, seconds: float = 12) -> Callable[[Cluster, Load, float, dict[str, Any]], None]:
    def fault(cluster: Cluster, load: Load, t0: float, notes: dict[str, Any]) -> None:
        at(t0, 5)
        assert cluster.disks is not None
        with cluster.disks.full(name) as taken:
            notes["fault_at"] = time.monotonic()
            notes["filled"] = f"{name} file system full for {seconds:g} s ({taken >> 20} MiB written to fill it)"
            at(notes["fault_at"], seconds)
        freed = time.monotonic()
        notes["served_again_after_freed_s"] = probe_until_served(cluster.gateways, load.keys["ops"], freed)
    return fault


def certs_unreadable(cluster: Cluster, load: Load, t0: float, notes: dict[str, Any]) -> None:
    """A rotation that cannot be read: every certificate and key replaced by a half-written file for 15 s (services
    keep their loaded pair), then the originals rotated back in."""
    at(t0, 5)
    folder = Path(cluster.state["certs"])
    saved = {p: p.read_bytes() for p in folder.glob("*.pem")} | {p: p.read_bytes() for p in folder.glob("*.key")}
    try:
        for path, data in saved.items():
            path.write_bytes(data[: len(data) // 3])  # a truncated PEM
        notes["fault_at"] = time.monotonic()
        notes["rotated"] = f"{len(saved)} certificate and key files half-written for 15 s"
        at(notes["fault_at"], 15)
    finally:
        for path, data in saved.items():
            path.write_bytes(data)
    back = time.monotonic()
    notes["served_again_after_restored_s"] = probe_until_served(cluster.gateways, load.keys["ops"], back)


def proxy_fault(cluster: Cluster, load: Load, t0: float, notes: dict[str, Any], which: str, mode: str, delay_s: float,
                seconds: float) -> None:
    """The proxy in front of the ``which`` worker set to ``mode`` for ``seconds``, then back to passing bytes."""
    at(t0, 5)
    proxy = cluster.proxies[which]
    before = proxy.forwarded
    proxy.set(mode, delay_s)
    notes["fault_at"] = time.monotonic()
    notes["proxied"] = (f"{mode} {delay_s * 1000:.0f} ms" if mode == "delay" else mode) + \
        f" between the fleet and {proxy.name} for {seconds:g} s"
    at(notes["fault_at"], seconds)
    proxy.set("pass")
    notes["proxied"] += f" ({(proxy.forwarded - before) >> 10} KiB through it meanwhile, {proxy.dropped >> 10} KiB " \
        "dropped)"
    notes["served_again_after_healed_s"] = probe_until_served(cluster.gateways, load.keys["ops"], time.monotonic())


SCENARIOS = [
    Scenario("baseline", "none", 30, None),
    Scenario("worker-kill-1", "process", 24, kill_busiest_worker),
    Scenario("worker-kill-2", "process", 24, kill_busiest_worker),
    Scenario("worker-kill-3", "process", 24, kill_busiest_worker),
    Scenario("router-kill", "process", 20, kill_service("router", "tokenfleet.services.router")),
    Scenario("registry-kill", "process", 20, kill_service("registry", "tokenfleet.services.registry")),
    Scenario("gateway-kill", "process", 20, kill_service("gateway-1", "")),
    Scenario("autoscaler-kill", "process", 0, None, skipped="`tokenfleet up --autoscale` runs the autoscaler inside "
             "its own process (killing it is killing `up`); the standalone `tokenfleet autoscale` service is not "
             "exercised here"),
    Scenario("worker-sigstop-20s", "process", 32, stop_worker),
    Scenario("etcd-down-10s", "etcd", 24, etcd_down(10)),
    Scenario("etcd-down-60s", "etcd", 75, etcd_down(60)),
    Scenario("etcd-disk-full", "disk", 24, disk_full("etcd")),
    Scenario("ledger-disk-full", "disk", 24, disk_full("state")),
    Scenario("kv-tier-disk-full", "disk", 24, disk_full("tier")),
    Scenario("certs-unreadable-at-rotation", "disk", 24, certs_unreadable),
    Scenario("partition-gateway-worker", "network", 30, lambda c, lo, t0, n: proxy_fault(c, lo, t0, n, "decode",
                                                                                          "partition", 0.0, 20)),
    Scenario("kv-transfer-latency-200ms", "network", 30, lambda c, lo, t0, n: proxy_fault(c, lo, t0, n, "prefill",
                                                                                           "delay", 0.2, 20)),
]
SHORT = ["baseline", "worker-kill-1", "router-kill", "etcd-down-10s", "ledger-disk-full"]
SHORT_SECONDS, SHORT_RATE = 12.0, 2.5  # the short version's load per scenario (the baseline's covers every request)


def summarize(results: list[Result], expected: dict[tuple[str, int], dict[int, str]], ledger: list[tuple[str, str, int]]
              ) -> dict[str, Any]:
    rows = collections.defaultdict(list)
    for request_id, status, tokens in ledger:
        rows[request_id].append((status, tokens))
    acknowledged = [r for r in results if r.acknowledged]
    lost = [r for r in acknowledged if not any(s == "ok" for s, _ in rows.get(r.response_id, []))]
    charged_twice = [r for r in acknowledged if len(rows.get(r.response_id, [])) > 1]
    differ = [r for r in acknowledged if r.spec.key in expected and r.texts != expected[r.spec.key]]
    invalid = [r for r in acknowledged if valid(r) is False]
    failed = collections.Counter(r.status for r in results if not r.acknowledged)
    return {
        "sent": len(results), "completed": len(acknowledged), "failed": dict(failed),
        "acknowledged_lost": len(lost), "duplicated_charges": len(charged_twice),
        "differ_from_fault_free": len(differ), "invalid_json": len(invalid),
        "cut_streams": failed.get("cut", 0),
        "constrained_completed": sum(1 for r in acknowledged if r.spec.kind in ("json", "tool")),
        "examples": {"lost": [r.response_id for r in lost[:3]],
                     "differ": [(r.spec.kind, r.spec.prompt, r.texts, expected.get(r.spec.key)) for r in differ[:2]],
                     "errors": sorted({f"{r.status}: {r.error[:200]}" for r in results if not r.acknowledged})[:5]},
    }


def run_scenarios(cluster: Cluster, keys: dict[str, str], chosen: list[Scenario], rate: float, batch_lines: int,
                  max_duration: float | None, out: dict[str, Any], long_prompts: bool = False) -> None:
    """``chosen`` in order on ``cluster`` (the first a fault-free baseline), each under the same seeded load;
    ``max_duration``: every scenario's load at most this long (the short version)."""
    expected: dict[tuple[str, int], dict[int, str]] = {}
    batches = []
    for scenario in chosen:
        if scenario.skipped:
            out[scenario.name] = {"kind": scenario.kind, "skipped": scenario.skipped}
            continue
        tag = scenario.name
        batch_id = submit_batch(cluster.gateways[-1], keys["a"], batch_lines, tag) if batch_lines else ""
        batches.append((scenario.name, batch_id, tag))
        notes: dict[str, Any] = {}
        resumes = cluster.metric("tokenfleet_gateway_resumes_total", '{result="ok"}')
        load = Load(cluster.gateways, keys, rate, long_prompts=scenario.name if long_prompts else "")
        started = time.monotonic()
        fault = scenario.fault
        duration = min(scenario.duration, max_duration or scenario.duration)
        if scenario.kind == "none":  # every (kind, prompt) the others send, once at least
            duration = max(duration, len(KINDS) * len(QUESTIONS) / rate)
        results = load.run(duration, (lambda lo, t0, f=fault: f(cluster, lo, t0, notes)) if fault else None)
        notes["wall_s"] = round(time.monotonic() - started, 1)
        if scenario.kind == "none":
            expected = {r.spec.key: r.texts for r in results if r.acknowledged}
        time.sleep(3)  # the ledger writer's last batch
        summary = summarize(results, expected, ledger_rows(cluster.ledger))
        resumed = int(cluster.metric("tokenfleet_gateway_resumes_total", '{result="ok"}') - resumes)
        summary["resumed"] = resumed if resumed >= 0 else "n/a (a gateway restarted: its counter too)"
        fault_at = notes.pop("fault_at", None)
        if fault_at is not None:  # requests open when the fault struck, and how many of them completed
            caught = [r for r in results if r.started <= fault_at <= r.ended]
            summary["in_flight_at_fault"] = len(caught)
            summary["in_flight_completed"] = sum(r.acknowledged for r in caught)
        out[scenario.name] = {"kind": scenario.kind, **summary, **notes}
        print(f"[faults] {scenario.name}: {json.dumps({k: v for k, v in summary.items() if k != 'examples'})}"
              f" {notes}", file=sys.stderr, flush=True)
    for name, batch_id, tag in batches:
        if batch_id:
            out[name]["batch"] = batch_outcome(cluster.gateways, keys["a"], batch_id, batch_lines, tag, timeout=240)


def _tenants(cluster: Cluster) -> dict[str, str]:
    keys = {"a": cluster.add_tenant("a"), "b": cluster.add_tenant("b"), "ops": cluster.add_tenant("ops", "--internal")}
    probe_until_served(cluster.gateways, keys["ops"], time.monotonic(), timeout=120)
    return keys


def _ledger_duplicates(cluster: Cluster) -> int:
    return sum(1 for n in collections.Counter(r[0] for r in ledger_rows(cluster.ledger)).values() if n > 1)


MAIN_CLUSTER = ("tokenfleet up --workers 3 --autoscale --max-workers 3 --auth on --gateways 2 --kv-tier disk:DIR "
                "--kv-tier-bytes 16777216 (tenants a, b and --internal ops)")
NETWORK_CLUSTER = ("tokenfleet up --workers 1 --role decode --threads 1 --auth on, plus a decode worker and a "
                   "prefill worker each behind a fault proxy (their advertised address), prompts of ~200 tokens of "
                   "their own (prefilled on the prefill worker, their KV pulled through its proxy)")


KEEP = os.environ.get("TOKENFLEET_FAULTS_KEEP") == "1"  # keep the clusters' folders (logs, ledger) to read after


@contextlib.contextmanager
def _workdir(prefix: str) -> Iterator[str]:
    if KEEP:
        path = tempfile.mkdtemp(prefix=prefix)
        print(f"[faults] cluster folder kept: {path}", file=sys.stderr, flush=True)
        yield path
        return
    with tempfile.TemporaryDirectory(prefix=prefix) as tmp:
        yield tmp


def run_fault_scenarios(names: list[str], rate: float, model_dir: str, batch_lines: int,
                        max_duration: float | None = None) -> dict[str, Any]:
    chosen = [dataclasses.replace(s) for s in SCENARIOS if s.name in names and s.kind != "network"]
    out: dict[str, Any] = {"scenarios": {}, "cluster": MAIN_CLUSTER, "rate": rate}
    with _workdir("tokenfleet-faults-") as tmp:
        disks = Disks(Path(tmp)) if any(s.kind == "disk" for s in chosen) else None
        if disks is not None and not disks.ok:
            for s in chosen:
                s.skipped = s.skipped or (disks.reason if s.kind == "disk" else "")
            disks.unmount()
            disks = None
        workdir = disks.path("state") if disks else Path(tmp) / "state"
        workdir.mkdir(exist_ok=True)
        tier = disks.path("tier") if disks else Path(tmp) / "tier"
        cluster = Cluster(["--workers", "3", "--autoscale", "--max-workers", "3", "--auth", "on", "--gateways", "2",
                           "--kv-tier", f"disk:{tier}", "--kv-tier-bytes", str(16 << 20)], workdir, model_dir,
                          tmpdir=disks.path("etcd") if disks else None)
        cluster.disks = disks
        try:
            run_scenarios(cluster, _tenants(cluster), chosen, rate, batch_lines, max_duration, out["scenarios"])
            out["ledger_duplicates_overall"] = _ledger_duplicates(cluster)
        finally:
            cluster.stop()
            if disks is not None:
                disks.unmount()
    network = [s for s in SCENARIOS if s.name in names and s.kind == "network"]
    if network:
        out["network_cluster"] = NETWORK_CLUSTER
        baseline = Scenario("network-baseline", "none", 30, None)
        with tempfile.TemporaryDirectory(prefix="tokenfleet-faults-net-") as tmp:
            cluster = Cluster(["--workers", "1", "--role", "decode", "--threads", "1", "--auth", "on"], Path(tmp),
                              model_dir)
            try:
                cluster.add_proxied_worker("decode")
                cluster.add_proxied_worker("prefill")
                keys = _tenants(cluster)
                run_scenarios(cluster, keys, [baseline, *network], rate, batch_lines, max_duration, out["scenarios"],
                              long_prompts=True)
                out["ledger_duplicates_overall"] = out.get("ledger_duplicates_overall", 0) + _ledger_duplicates(cluster)
            finally:
                cluster.stop()
    return out


# --- noisy neighbour and load through `up` on its defaults ---------------------------------------------------------

def _streams(url: str, key: str, count: int, max_tokens: int, concurrency: int, content: Callable[[int], str]
             ) -> list[dict[str, Any]]:
    """``count`` streaming chats, ``concurrency`` at a time: per request TTFT, inter-token gaps, status."""
    def one(i: int) -> dict[str, Any]:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=600)
        start, stamps, status = time.monotonic(), [], "ok"
        try:
            stream = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": content(i)}],
                                                    max_tokens=max_tokens, temperature=0, stream=True,
                                                    extra_body={"ignore_eos": True})
            for chunk in stream:
                if chunk.choices and chunk.choices[0].delta.content:
                    stamps.append(time.monotonic())
        except openai.APIStatusError as e:
            status = str(e.status_code)
        except openai.APIError as e:
            status = type(e).__name__
        gaps = [b - a for a, b in zip(stamps, stamps[1:], strict=False)]
        return {"status": status, "started": start, "ttft": (stamps[0] - start) if stamps else None, "gaps": gaps,
                "total": time.monotonic() - start}

    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        return list(pool.map(one, range(count)))


def _p(values: list[float], q: float) -> float | None:
    values = sorted(v for v in values if v is not None)
    return values[min(len(values) - 1, int(q * len(values)))] if values else None


def noisy_neighbour(model_dir: str, b_prompts: int, b_tokens: int = 0, a_alone_s: float = 20.0) -> dict[str, Any]:
    """Tenant B's prompts of the model's full context (``b_tokens``, 0: the context less room for the template and
    16 output tokens), all at once, while tenant A streams 4 requests at a time back to back; against A alone (for
    ``a_alone_s``) and B alone. A's figures with B are those of its requests started while B's ran."""
    from tokenfleet.models.tokenizer import Tokenizer

    with tempfile.TemporaryDirectory(prefix="tokenfleet-noisy-") as tmp:
        cluster = Cluster(["--auth", "on"], Path(tmp), model_dir)
        try:
            keys = {"a": cluster.add_tenant("a"), "b": cluster.add_tenant("b")}
            tokenizer = Tokenizer(model_dir)
            context = json.loads((Path(model_dir) / "config.json").read_text()).get("max_position_embeddings", 8192)
            words = (Path(__file__).resolve().parent / "data" / "perplexity_text.txt").read_text().split()
            text = " ".join(words)
            while len(tokenizer.encode(text)) < context:
                text += " " + text
            ids = tokenizer.encode(text)[: b_tokens or context - 200]
            long_prompt = tokenizer.decode(ids)
            url = cluster.gateways[0]

            def a_steady(stop: threading.Event) -> list[dict[str, Any]]:
                rows: list[dict[str, Any]] = []

                def loop(i: int) -> None:
                    while not stop.is_set():
                        rows.extend(_streams(url, keys["a"], 1, 32, 1, lambda _: QUESTIONS[(i + len(rows)) % 6]))

                with ThreadPoolExecutor(4) as pool:
                    list(pool.map(loop, range(4)))
                return rows

            def b_load() -> list[dict[str, Any]]:
                return _streams(url, keys["b"], b_prompts, 16, b_prompts, lambda i: f"({i}) Summarize: {long_prompt}")

            stop = threading.Event()
            threading.Timer(a_alone_s, stop.set).start()
            a_alone = a_steady(stop)
            b_alone = b_load()
            stop = threading.Event()
            with ThreadPoolExecutor(1) as pool:
                a_future = pool.submit(a_steady, stop)
                time.sleep(2)
                b_started = time.monotonic()
                b_with = b_load()
                b_ended = time.monotonic()
                stop.set()
                a_with = [r for r in a_future.result() if b_started <= r["started"] <= b_ended]
        finally:
            cluster.stop()

    def stats(rows: list[dict[str, Any]]) -> dict[str, Any]:
        return {"requests": len(rows), "failed": sum(r["status"] != "ok" for r in rows),
                "ttft_p99_s": _p([r["ttft"] for r in rows], 0.99),
                "itl_p99_s": _p([g for r in rows for g in r["gaps"]], 0.99),
                "total_max_s": max((r["total"] for r in rows), default=None)}

    out = {"a_alone": stats(a_alone), "a_with_b": stats(a_with), "b_alone": stats(b_alone), "b_with_a": stats(b_with),
           "prompt_tokens_b": len(ids)}
    out["ratios"] = {"a_itl_p99": _ratio(out["a_with_b"]["itl_p99_s"], out["a_alone"]["itl_p99_s"]),
                     "a_ttft_p99": _ratio(out["a_with_b"]["ttft_p99_s"], out["a_alone"]["ttft_p99_s"]),
                     "b_completion_max": _ratio(out["b_with_a"]["total_max_s"], out["b_alone"]["total_max_s"])}
    return out


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 2) if a is not None and b else None


def load_scenarios(model_dir: str, burst: int, loop_streams: int, loop_seconds: float) -> dict[str, Any]:
    """`up` on its defaults: ``burst`` concurrent streams (one request each, 64 tokens); ``loop_streams`` streams
    sending requests back to back for ``loop_seconds`` (48 tokens)."""
    with tempfile.TemporaryDirectory(prefix="tokenfleet-load-") as tmp:
        cluster = Cluster([], Path(tmp), model_dir)
        try:
            url = cluster.gateways[0]
            start = time.monotonic()
            rows = _streams(url, "unused", burst, 64, burst, lambda i: QUESTIONS[i % 6])
            burst_out = {"streams": burst, "failed": collections.Counter(r["status"] for r in rows if r["status"] != "ok"),
                         "wall_s": round(time.monotonic() - start, 1), "ttft_p99_s": _p([r["ttft"] for r in rows], 0.99)}
            stop_at = time.monotonic() + loop_seconds
            statuses: collections.Counter[str] = collections.Counter()
            lock = threading.Lock()

            def loop(i: int) -> None:
                while time.monotonic() < stop_at:
                    (row,) = _streams(url, "unused", 1, 48, 1, lambda _: QUESTIONS[i % 6])
                    with lock:
                        statuses[row["status"]] += 1

            start = time.monotonic()
            with ThreadPoolExecutor(loop_streams) as pool:
                list(pool.map(loop, range(loop_streams)))
            loop_out = {"streams": loop_streams, "seconds": loop_seconds, "requests": sum(statuses.values()),
                        "failed": {k: v for k, v in statuses.items() if k != "ok"},
                        "wall_s": round(time.monotonic() - start, 1)}
        finally:
            cluster.stop()
    return {"burst": {**burst_out, "failed": dict(burst_out["failed"])}, "loop": loop_out}


# --- the report -----------------------------------------------------------------------------------------------------

COLUMNS = [("sent", "sent"), ("completed", "completed"), ("failed", "failed (by status)"),
           ("in_flight", "in flight at the fault: completed"), ("resumed", "resumed"),
           ("acknowledged_lost", "ack. lost"), ("duplicated_charges", "dup. charges"),
           ("differ_from_fault_free", "text differs"), ("invalid_json", "invalid JSON"), ("cut_streams", "cut"),
           ("batch", "batch lines missing / dup."), ("recovery", "recovery")]


def _recovery(s: dict[str, Any]) -> str:
    parts = []
    for key, label in (("recovered_s", "served again"), ("served_again_after_return_s", "served after etcd's return"),
                       ("served_again_after_freed_s", "served after the disk was freed"),
                       ("served_again_after_restored_s", "served after the certificates were restored"),
                       ("served_again_after_healed_s", "served after the path healed"),
                       ("restarted_after_s", "restarted")):
        if s.get(key) is not None:
            parts.append(f"{label} {s[key]:.1f} s")
    return "; ".join(parts) or "-"


def markdown(report: dict[str, Any]) -> str:
    lines = [f"# Faults under load ({report['date']}, commit {report.get('commit', '?')})", "",
             f"Machine: {report['machine']}.", "",
             f"Command: `{report['command']}`", "",
             f"Cluster: `{report['faults'].get('cluster', '-')}`, open-loop load {report['faults'].get('rate')} "
             "requests/s of chat, streaming chat, json_schema, forced tool call and n=2 (greedy), the official "
             "`openai` client with retries off. Texts are compared with the fault-free `baseline` run of the same "
             "seeded load; ledger records are read from the gateways' shared database.", "",
             *([f"Network scenarios: `{report['faults']['network_cluster']}`, compared with their own fault-free "
                "`network-baseline`.", ""] if report["faults"].get("network_cluster") else []),
             "| scenario | " + " | ".join(label for _, label in COLUMNS) + " | notes |",
             "|---" * (len(COLUMNS) + 2) + "|"]
    for name, s in report["faults"].get("scenarios", {}).items():
        if "skipped" in s:
            lines.append(f"| {name} | skipped: {s['skipped']} |" + " |" * len(COLUMNS))
            continue
        cells = []
        for key, _ in COLUMNS:
            if key == "failed":
                cells.append(", ".join(f"{k}: {v}" for k, v in s["failed"].items()) or "0")
            elif key == "batch":
                b = s.get("batch")
                cells.append(f"{b['missing']} / {b['duplicated']} ({b['status']})" if b else "-")
            elif key == "in_flight":
                cells.append(f"{s['in_flight_at_fault']}: {s['in_flight_completed']}" if "in_flight_at_fault" in s
                             else "-")
            elif key == "recovery":
                cells.append(_recovery(s))
            else:
                cells.append(str(s.get(key, "-")))
        notes = "; ".join(str(s[k]) for k in ("killed", "stopped", "filled", "rotated", "proxied") if s.get(k))
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {notes} |")
    errors = {name: s["examples"]["errors"] for name, s in report["faults"].get("scenarios", {}).items()
              if s.get("examples", {}).get("errors")}
    if errors:
        lines += ["", "Failed requests' errors (up to 5 distinct per scenario):", ""]
        lines += [f"- {name}: " + "; ".join(f"`{e}`" for e in errs) for name, errs in errors.items()]
    if "noisy" in report:
        n = report["noisy"]
        lines += ["", "## Noisy neighbour", "",
                  f"Tenant B sends {n['b_with_a']['requests']} prompts of {n['prompt_tokens_b']} tokens at once "
                  "(chunked prefill) while tenant A streams 4 requests at a time back to back (32 tokens each; "
                  f"{n['a_with_b']['requests']} of them started while B's ran); `tokenfleet up --auth on` on its "
                  "defaults.", "",
                  "| | requests | failed | TTFT p99 (s) | ITL p99 (s) | slowest (s) |", "|---|---|---|---|---|---|"]
        for key in ("a_alone", "a_with_b", "b_alone", "b_with_a"):
            r = n[key]
            lines.append(f"| {key.replace('_', ' ')} | {r['requests']} | {r['failed']} | {_fmt(r['ttft_p99_s'])} | "
                         f"{_fmt(r['itl_p99_s'])} | {_fmt(r['total_max_s'])} |")
        ratios = n["ratios"]
        lines += ["", f"A's ITL p99 with B / alone: **{ratios['a_itl_p99']}x** (bar <= 1.5x); A's TTFT p99: "
                  f"**{ratios['a_ttft_p99']}x** (bar <= 2x); B's slowest completion with A / alone: "
                  f"**{ratios['b_completion_max']}x** (bar <= 3x). One run."]
    if "load" in report:
        b, lo = report["load"]["burst"], report["load"]["loop"]
        lines += ["", "## Load through `tokenfleet up` on its defaults", "",
                  f"- {b['streams']} concurrent streams (one request each, 64 tokens): failed {b['failed'] or 0}, "
                  f"all done in {b['wall_s']} s, TTFT p99 {_fmt(b['ttft_p99_s'])} s.",
                  f"- {lo['streams']} streams sending requests back to back for {lo['seconds']:g} s (48 tokens): "
                  f"{lo['requests']} requests, failed {lo['failed'] or 0}, {lo['wall_s']} s."]
    if report.get("wall_s") is not None:
        lines += ["", f"Wall time of the whole run: {report['wall_s']:.0f} s."]
    return "\n".join(lines) + "\n"


def _fmt(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--scenarios", nargs="*", default=None,
                   help=f"fault scenarios (default: all): {' '.join(s.name for s in SCENARIOS)}; "
                   "`noisy` and `load` name the last two parts")
    p.add_argument("--short", action="store_true", help=f"one scenario per kind: {' '.join(SHORT)}, no noisy/load, "
                   f"each {SHORT_SECONDS:g} s of load at {SHORT_RATE:g} requests/s")
    p.add_argument("--rate", type=float, default=None, help="requests/s of the fault scenarios' load (default 1.5)")
    p.add_argument("--batch-lines", type=int, default=8, help="lines of the batch each scenario submits")
    p.add_argument("--noisy-tokens", type=int, default=0, help="tenant B's prompt length (default: the model's "
                   "context, less room for the template and 16 output tokens)")
    p.add_argument("--burst", type=int, default=1024)
    p.add_argument("--loop-streams", type=int, default=256)
    p.add_argument("--loop-seconds", type=float, default=60.0)
    p.add_argument("--out", type=Path, default=REPORTS)
    p.add_argument("--model", default="", help="model folder (default: the imported default model)")
    args = p.parse_args(argv)
    names = SHORT if args.short else (args.scenarios if args.scenarios is not None
                                      else [s.name for s in SCENARIOS] + ["noisy", "load"])
    model_dir = args.model or default_model()
    report: dict[str, Any] = {"date": time.strftime("%Y-%m-%d"), "started": time.strftime("%Y-%m-%d %H:%M:%S"),
                              "machine": machine_line(), "commit": git_head(),
                              "command": "python benchmarks/faults.py " + " ".join(argv if argv is not None
                                                                                 else sys.argv[1:])}
    fault_names = [n for n in names if n not in ("noisy", "load")]
    if fault_names and "baseline" not in fault_names:
        fault_names.insert(0, "baseline")
    started = time.monotonic()
    rate = args.rate or (SHORT_RATE if args.short else 1.5)
    report["faults"] = (run_fault_scenarios(fault_names, rate, model_dir, args.batch_lines,
                                            max_duration=SHORT_SECONDS if args.short else None) if fault_names else {})
    if "noisy" in names:
        report["noisy"] = noisy_neighbour(model_dir, b_prompts=4, b_tokens=args.noisy_tokens)
    if "load" in names:
        report["load"] = load_scenarios(model_dir, args.burst, args.loop_streams, args.loop_seconds)
    report["wall_s"] = round(time.monotonic() - started, 1)
    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.out / f"{time.strftime('%Y-%m-%d-%H%M%S')}-cpu-faults{'-short' if args.short else ''}"
    stem.with_suffix(".json").write_text(json.dumps(report, indent=1, default=str))
    stem.with_suffix(".md").write_text(markdown(report))
    print(stem.with_suffix(".md"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
