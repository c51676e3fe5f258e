"""`tokenfleet up` / `down`: the whole topology as processes on loopback, without Docker.

etcd -> registry (the model is registered there) -> N engine workers (load the model as its
registry record says, register in etcd) -> router -> gateway. Ctrl-C, SIGTERM or
`tokenfleet down` stops everything in reverse order; workers drain their streams first. While it runs,
a service that dies is started again on its address, with backoff (tokenfleet.cli.supervise).

The internal plane is mutual TLS by default: the certificates in ``envs.certs_dir()`` (created on
first use, ``tokenfleet certs``), etcd with client-certificate auth, every administrative call
appended to ``audit.log`` beside the state file. ``insecure=True`` runs it all in plaintext (every
service warns at start).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tokenfleet import envs
from tokenfleet.cli.context import state_file
from tokenfleet.cli.supervise import Supervisor
from tokenfleet.cluster.etcd_server import EtcdServer
from tokenfleet.security import certs as certs_lib
from tokenfleet.security.identity import Identity
from tokenfleet.security.plane import INSECURE_WARNING, Plane


@dataclass
class Cluster:
    etcd: EtcdServer
    processes: list[tuple[str, subprocess.Popen]] = field(default_factory=list)
    gateway_url: str = ""  # the first gateway's
    gateway_metrics: str = ""  # host:port of the gateway's /metrics (not on the public API port)
    gateway_urls: list[str] = field(default_factory=list)  # every gateway's (up --gateways N), the first first
    announced: dict[str, list[str]] = field(default_factory=dict)  # lines each service printed before LISTENING
    owns_state: bool = True  # `tokenfleet up`'s cluster: its state file goes with it
    addresses: dict[str, str] = field(default_factory=dict)  # service name -> the address it listens on
    # how each service was started (module and flags, torch threads): a restart repeats it on the same addresses
    specs: dict[str, tuple[tuple[str, ...], int]] = field(default_factory=dict)

    def spawn(self, name: str, *args: str, threads: int = 1) -> str:
        self.specs[name] = (tuple(args), threads)
        proc = self._start(name)
        self.processes.append((name, proc))
        address = self._listening(name, proc)
        # a restart binds the same ports: everyone else knows this service by them
        host, _, port = address.rpartition(":")
        pinned = ["--host", host, "--port", port]
        metrics = next((line.split()[1] for line in self.announced[name] if line.startswith("METRICS ")), "")
        if metrics:
            pinned += ["--metrics-port", metrics.rpartition(":")[2]]
        self.specs[name] = (tuple(args) + tuple(pinned), threads)
        return address

    def metrics(self) -> dict[str, dict[str, str]]:
        """Each service's Prometheus endpoint and what it is: {name: {"address": host:port, "job": ..., "role": ...}}
        (what `tokenfleet scrape-config` turns into a Prometheus scrape configuration)."""
        out = {}
        for name, lines in self.announced.items():
            address = next((line.split()[1] for line in lines if line.startswith("METRICS ")), "")
            if not address:
                continue
            args = self.specs.get(name, ((), 1))[0]
            job = "worker" if name.startswith(("worker", "prefill")) else name
            role = args[args.index("--role") + 1] if "--role" in args else ""
            out[name] = {"address": address, "job": job, **({"role": role} if role else {})}
        return out

    def restart(self, name: str) -> str:
        """Start ``name`` again as it was started, on its address (Supervisor; RuntimeError if it fails to start)."""
        proc = self._start(name)
        self.processes = [(n, proc if n == name else p) for n, p in self.processes]
        try:
            return self._listening(name, proc)
        except RuntimeError:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            raise

    def retire(self, name: str) -> subprocess.Popen | None:
        """Take ``name`` out of the cluster (and of supervision) without stopping it: the caller drains and stops it
        (the autoscaler's scale-down). Its process, or None if there is no such service."""
        proc = next((p for n, p in self.processes if n == name), None)
        self.processes = [(n, p) for n, p in self.processes if n != name]
        self.specs.pop(name, None)
        self.addresses.pop(name, None)
        return proc

    def _start(self, name: str) -> subprocess.Popen:
        args, threads = self.specs[name]
        return subprocess.Popen([sys.executable, "-m", *args], stdout=subprocess.PIPE, text=True,
                                env={**os.environ, "TOKENFLEET_NUM_THREADS": str(threads), "PYTHONUNBUFFERED": "1"})

    def _listening(self, name: str, proc: subprocess.Popen) -> str:
        lines = self.announced[name] = []
        self.addresses[name] = wait_listening(name, proc, lines)
        return self.addresses[name]

    def stop(self) -> None:
        for _name, proc in reversed(self.processes):
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    proc.kill()
        self.etcd.cleanup()
        if self.owns_state:
            state_file().unlink(missing_ok=True)


METRICS = ("--metrics-port", "0")  # every service serves Prometheus /metrics on a free port (the state file lists them)


def wait_listening(name: str, proc: subprocess.Popen, before: list[str] | None = None, timeout: float = 300) -> str:
    """The address a service prints (``LISTENING host:port``) once it serves; the lines it printed
    before (``METRICS host:port``, ...) go to ``before``."""
    assert proc.stdout is not None
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if line.startswith("LISTENING "):
            threading.Thread(target=proc.stdout.read, daemon=True).start()  # keep the pipe drained
            return line.split()[1]
        if before is not None and line:
            before.append(line.strip())
        if not line and proc.poll() is not None:
            break
    raise RuntimeError(f"{name} failed to start (exit {proc.poll()})")


def register_model(registry: str, name: str, model_dir: str, plane: Plane, dtype: str = "auto",
                   version: str = "v1", speculative_config: str = "", kv_cache_dtype: str = "",
                   quantization: str | None = None) -> None:
    """Register ``name@version`` (a no-op when the identical record exists), as an operator. ``quantization``:
    the record's (None: the folder's own, models.gguf_import.folder_quantization)."""
    from tokenfleet.cluster.registry import ModelRecord
    from tokenfleet.models.gguf_import import folder_quantization
    from tokenfleet.services.registry.client import register_model as register

    # tool_format: the default model's ChatML template prints any role; a folder imported with --keep-quantized is
    # served quantized (its record says gguf)
    register(registry, ModelRecord(name=name, version=version, path=str(Path(model_dir).resolve()), dtype=dtype,
                                   tool_format="hermes", speculative_config=speculative_config,
                                   kv_cache_dtype=kv_cache_dtype,
                                   quantization=folder_quantization(model_dir) if quantization is None else quantization),
             plane)


def audit_file() -> Path:
    return envs.cache_dir() / "audit.log"


def resolve_model(spec: str) -> tuple[str, str]:
    """(served name, HF folder) of an `up --model` value: NAME=DIR, the name of a model tokenfleet imports
    (``gguf_import.importable``: imported on first use; NAME-gguf keeps the GGUF quantized), or a folder (named after
    it)."""
    from tokenfleet.models.gguf_import import ensure_model, importable

    name, sep, folder = spec.partition("=")
    if sep:
        return name, folder
    if importable(spec):
        return spec, str(ensure_model(spec))
    return Path(spec).resolve().name, spec


def check_auth(host: str, auth: bool, no_auth: bool) -> None:
    """The gateway may serve without API keys only on loopback, or when told so explicitly."""
    if auth or no_auth or is_loopback(host):
        return
    raise ValueError(f"the gateway would listen on {host} without API keys: add --auth on (then `tokenfleet tenants "
                     "add NAME` prints a key), or --insecure-no-auth to serve that network without keys")


def is_loopback(host: str) -> bool:
    import ipaddress

    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def tier_args(kv_tier: str, kv_tier_bytes: int, replica: str) -> list[str]:
    """A worker's second-tier flags: disk tiers get a folder each (a tier belongs to one worker)."""
    if not kv_tier:
        return []
    spec = f"disk:{Path(kv_tier[5:]) / replica}" if kv_tier.startswith("disk:") else kv_tier
    return ["--kv-tier", spec] + (["--kv-tier-bytes", str(kv_tier_bytes)] if kv_tier_bytes else [])


def pool_args(kv_pool_bytes: int) -> list[str]:
    """A worker's KV pool flag: its size in bytes (the worker converts it to blocks of its model); 0: its default."""
    return ["--kv-pool-bytes", str(kv_pool_bytes)] if kv_pool_bytes else []


def up(num_workers: int, model_dir: str, model_name: str, threads: int, gateway_port: int,
       role: str = "both", dtype: str = "auto", prefill_workers: int = 0, record: bool = True,
       insecure: bool = False, certs: Path | None = None, host: str = "127.0.0.1", auth: bool = False,
       no_auth: bool = False, more_models: Sequence[tuple[str, str]] = (), kv_tier: str = "",
       kv_tier_bytes: int = 0, speculative_config: str = "", lora: Sequence[str] = (), batch_slots: int = 8,
       batch_concurrency: int = 8, kv_cache_dtype: str = "", async_scheduling: bool = False,
       gateways: int = 1, kv_pool_bytes: int = 0, quantization: str | None = None) -> Cluster:
    """``prefill_workers`` > 0 disaggregates: that many prefill workers, and the ``num_workers``
    others decode only (unless ``role`` says otherwise); the router sends long prompts' prefill there.
    ``record``: write the state file `tokenfleet down` reads (off for private clusters, e.g. calibration).
    ``certs``: the internal plane's certificates (default ``envs.certs_dir()``; missing ones are created);
    ``insecure``: plaintext instead. ``host``: where the gateway listens; ``auth``: API keys required
    (tenants in this cluster's etcd); without keys only on loopback unless ``no_auth`` (check_auth).
    ``more_models``: further (name, folder) pairs, registered too and served by one worker each; the
    gateway serves every registered model. ``kv_tier``: each worker's second KV tier, ``memory`` or
    ``disk:DIR`` (a folder per worker under DIR), of ``kv_tier_bytes`` bytes. ``kv_pool_bytes``: each worker's KV
    pool in bytes (0: the worker's default). ``speculative_config``: the first
    model's record's (JSON, engine.spec_decode.SpecConfig.parse): its workers speculate. ``lora``: NAME=PATH PEFT
    adapters every worker of the first model loads (clients ask for MODEL:NAME). ``kv_cache_dtype``: the first
    model's record's ("fp8": models.kv_fp8). ``quantization``: the first model's record's ("int8", "gguf"; None: the
    folder's own). ``async_scheduling``: every worker overlaps scheduling with its device
    (CoreParts.overlap). ``batch_slots``: the router gives a
    worker batch lines only while it runs fewer requests (and none waits); ``batch_concurrency``: batch lines the
    gateway runs at once. ``gateways``: that many gateways (the first on ``gateway_port``, the others on free ports),
    one database (ledger, batch tier) and one router between them."""
    if gateways < 1:
        raise ValueError(f"gateways must be at least 1, got {gateways}")
    check_auth(host, auth, no_auth)
    threads = threads or worker_threads(num_workers + prefill_workers + len(more_models))
    folder = None if insecure else Path(certs or envs.certs_dir())
    if folder is None:
        print(f"WARNING: {INSECURE_WARNING}", file=sys.stderr, flush=True)
    elif created := certs_lib.ensure(folder):
        print(f"certificates created in {folder}: {', '.join(created)}", file=sys.stderr, flush=True)
    plane = Plane.plaintext() if folder is None else Plane(Identity(folder, "operator"))
    tls = ["--insecure"] if folder is None else ["--certs", str(folder)]
    audit = [*tls, "--audit-log", str(audit_file())]
    cluster = Cluster(EtcdServer.create(certs=folder).start(), owns_state=record)
    try:
        etcd = cluster.etcd.endpoint
        registry = cluster.spawn("registry", "tokenfleet.services.registry", "--etcd", etcd, *audit, *METRICS)
        register_model(registry, model_name, model_dir, plane, dtype, speculative_config=speculative_config,
                       kv_cache_dtype=kv_cache_dtype, quantization=quantization)
        decode_role = "decode" if prefill_workers and role == "both" else role
        roles = [(f"worker-{i}", decode_role) for i in range(num_workers)]
        roles += [(f"prefill-{i}", "prefill") for i in range(prefill_workers)]
        for name, worker_role in roles:
            cluster.spawn(name, "tokenfleet.services.decode", "--registry", registry, "--model-name",
                          model_name, "--etcd", etcd, "--replica-id", name, "--role", worker_role, *audit, *METRICS,
                          *tier_args(kv_tier, kv_tier_bytes, name), *pool_args(kv_pool_bytes),
                          *[w for spec in lora for w in ("--lora", spec)],
                          *(["--async-scheduling"] if async_scheduling else []), threads=threads)
        for extra, folder_of_extra in more_models:
            register_model(registry, extra, folder_of_extra, plane, dtype)
            cluster.spawn(f"worker-{extra}", "tokenfleet.services.decode", "--registry", registry, "--model-name",
                          extra, "--etcd", etcd, "--replica-id", f"{extra}-0", "--role", "both", *audit, *METRICS,
                          *tier_args(kv_tier, kv_tier_bytes, f"{extra}-0"), *pool_args(kv_pool_bytes),
                          *(["--async-scheduling"] if async_scheduling else []), threads=threads)
        router = cluster.spawn("router", "tokenfleet.services.router", "--etcd", etcd, "--registry", registry, *audit,
                               *METRICS, "--batch-slots", str(batch_slots))
        # several gateways learn their share of each tenant's budget from each other in etcd
        keys = ["--auth", "on"] if auth else []
        peers = ["--etcd", etcd] if auth or gateways > 1 else []
        for i in range(gateways):
            gateway = cluster.spawn(f"gateway-{i}" if i else "gateway", "tokenfleet.services.gateway", "--router",
                                    router, "--registry", registry, "--host", host,
                                    "--port", str(gateway_port if i == 0 else 0), "--metrics-port", "0", *keys, *peers,
                                    *tls, "--batch-concurrency", str(batch_concurrency))
            cluster.gateway_urls.append(f"http://{gateway}")
        cluster.gateway_url = cluster.gateway_urls[0]
        cluster.gateway_metrics = next((line.split()[1] for line in cluster.announced["gateway"]
                                        if line.startswith("METRICS ")), "")
        gateway_plane = Plane.plaintext() if folder is None else Plane(Identity(folder, "gateway"))
        for served in [model_name, *(name for name, _ in more_models)]:
            if not auth:
                _wait_serving(cluster.gateway_url, served)
            else:  # no tenant yet to ask with: the router places the model (the gateway's /health after)
                _wait_routable(router, served, gateway_plane)
        if auth:
            _wait_healthy(cluster.gateway_url)
    except BaseException:
        cluster.stop()
        raise
    if record:
        state = {"pid": os.getpid(), "gateway": cluster.gateway_url, "gateways": cluster.gateway_urls, "etcd": etcd,
                 "registry": registry,
                 "certs": str(folder or ""), "insecure": folder is None, "auth": auth,
                 "gateway_metrics": cluster.gateway_metrics, "metrics": cluster.metrics(),
                 "started": _process_start(os.getpid())}
        state_file().parent.mkdir(parents=True, exist_ok=True)
        state_file().write_text(json.dumps(state))
    return cluster


def scrape_config(state: dict, interval: str = "5s") -> dict:
    """A Prometheus configuration scraping every service of a `tokenfleet up` cluster (its state file), with the jobs
    and role labels compose/prometheus/prometheus.yml uses: the Grafana dashboard works on either."""
    jobs: dict[str, list[dict]] = {}
    for name, m in sorted(state.get("metrics", {}).items()):
        labels = {"service": name, **({"role": m["role"]} if m.get("role") else {})}
        jobs.setdefault(m["job"], []).append({"targets": [m["address"]], "labels": labels})
    return {"global": {"scrape_interval": interval, "evaluation_interval": interval},
            "scrape_configs": [{"job_name": job, "metrics_path": "/metrics", "static_configs": targets}
                               for job, targets in jobs.items()]}


def worker_threads(num_workers: int) -> int:
    """Torch threads per engine worker when none are asked for: the cores, shared out. The gateway,
    router, registry and etcd get no core of their own: together they take a few % of one while
    serving (benchmarks/serve_peer.py reports each process's share), and a worker that computes
    on every core serves faster than one that leaves a core mostly idle for them."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    return max(1, cores // max(1, num_workers))


def _wait_serving(url: str, model: str, timeout: float = 120) -> None:
    """Until a one-token completion succeeds: the router has seen a worker."""
    body = json.dumps({"model": model, "prompt": "hi", "max_tokens": 1}).encode()
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        request = urllib.request.Request(f"{url}/v1/completions", data=body, headers={"content-type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=30):
                return
        except OSError:
            time.sleep(0.2)
    raise TimeoutError(f"gateway {url} not serving after {timeout}s")


def _wait_routable(router: str, model: str, plane: Plane, timeout: float = 120) -> None:
    """Until the router places ``model`` (it has seen a worker), asked as a gateway would."""
    import grpc

    from tokenfleet.v1 import router_pb2, router_pb2_grpc

    deadline = time.monotonic() + timeout
    with plane.sync_channel(router, "router") as channel:
        stub = router_pb2_grpc.RouterServiceStub(channel)
        while time.monotonic() < deadline:
            try:
                stub.Pick(router_pb2.PickRequest(model=model, num_prompt_tokens=1), timeout=10)
                return
            except grpc.RpcError:
                time.sleep(0.2)
    raise TimeoutError(f"router {router} places no {model} replica after {timeout}s")


def _wait_healthy(url: str, timeout: float = 120) -> None:
    """Until the gateway's /health answers 200 (its models are loaded)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=10):
                return
        except OSError:
            time.sleep(0.2)
    raise TimeoutError(f"gateway {url} not healthy after {timeout}s")


def ask(url: str, model: str, message: str, api_key: str | None = None) -> str:
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": message}], "max_tokens": 128,
                       "temperature": 0}).encode()
    headers = {"content-type": "application/json", **({"authorization": f"Bearer {api_key}"} if api_key else {})}
    request = urllib.request.Request(f"{url}/v1/chat/completions", data=body, headers=headers)
    with urllib.request.urlopen(request, timeout=120) as response:
        return json.loads(response.read())["choices"][0]["message"]["content"]


def wait_for_signal(cluster: Cluster, supervisor: Supervisor | None = None) -> None:
    """Until SIGINT or SIGTERM, supervising: a service that exits is started again with backoff (supervise.py);
    the cluster stays up."""
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    supervisor = supervisor or Supervisor(cluster)
    while not stop.is_set():
        supervisor.poll()
        stop.wait(0.5)


def _process_start(pid: int) -> str | None:
    """When ``pid`` started (clock ticks since boot, from /proc; None where there is no /proc): with
    the pid it names one process, never a later one that got the same pid."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[19]
    except (OSError, IndexError):
        return None


def _is_ours(state: dict) -> bool:
    """The state file's process is still the `tokenfleet up` that wrote it."""
    pid, started = state["pid"], state.get("started")
    if started is not None and _process_start(pid) != started:
        return False
    try:
        return b"tokenfleet" in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return started is None  # no /proc: trust the pid as before


def down() -> bool:
    """Stop the cluster started by `tokenfleet up` (it stops its services on SIGTERM). A state file
    whose process is gone or is another program now (pid reuse) is removed, and nothing is signalled."""
    path = state_file()
    if not path.exists():
        return False
    state = json.loads(path.read_text())
    pid = state["pid"]
    if not _is_ours(state):
        path.unlink(missing_ok=True)
        return False
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        path.unlink(missing_ok=True)
        return False
    for _ in range(600):
        if not path.exists():
            return True
        time.sleep(0.1)
    return True


class LocalAutoscaler:
    """`tokenfleet up --autoscale`: the autoscaler service (cluster.autoscale_service) on this process's own workers,
    in a thread with its own event loop, until ``stop``."""

    def __init__(self, cluster: Cluster, model_name: str, policy: Any, plane: Plane, interval: float = 2.0,
                 metrics_port: int | None = None, warm_pool: int = 0):
        self.cluster, self.model_name, self.policy, self.plane, self.interval = cluster, model_name, policy, plane, interval
        self.metrics_port = metrics_port
        self.warm_pool = warm_pool
        self.service: Any = None
        self._loop: Any = None
        self._stop: Any = None
        self._thread = threading.Thread(target=self._run, name="tokenfleet-autoscaler", daemon=True)
        self._ready = threading.Event()

    def start(self) -> None:
        self._thread.start()
        self._ready.wait(30)

    def stop(self) -> None:
        if self._loop is not None and self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(timeout=30)

    def _run(self) -> None:
        import asyncio

        asyncio.run(self._main())

    async def _main(self) -> None:
        import asyncio

        from prometheus_client import CollectorRegistry, start_http_server

        from tokenfleet.cluster.autoscale import Autoscaler
        from tokenfleet.cluster.autoscale_service import AutoscaleMetrics, AutoscaleService, LocalDriver
        from tokenfleet.cluster.etcd import EtcdClient
        from tokenfleet.services.router.fleet import FleetView
        from tokenfleet.v1 import engine_pb2, engine_pb2_grpc

        self._loop, self._stop = asyncio.get_running_loop(), asyncio.Event()
        etcd = EtcdClient(self.cluster.etcd.endpoint, identity=self.plane.identity)
        fleet = FleetView(etcd, self.plane, self.cluster.addresses.get("registry"))
        await fleet.start()

        async def drain(address: str) -> None:
            async with self.plane.channel(address, "worker") as channel:
                await engine_pb2_grpc.EngineServiceStub(channel).Drain(engine_pb2.DrainRequest(), timeout=600)

        registry = CollectorRegistry()
        metrics = AutoscaleMetrics(registry)
        if self.metrics_port is not None:
            server, _ = start_http_server(self.metrics_port, "127.0.0.1", registry=registry)
            print(f"autoscaler metrics: http://127.0.0.1:{server.server_port}/metrics", flush=True)
        workers = sorted(n for n, _ in self.cluster.processes if n.startswith("worker-"))

        def visible(replica_id: str) -> bool:
            return any(r.load.replica_id == replica_id and r.load.state == "serving" for r in fleet.replicas.values())

        driver = LocalDriver(self.cluster, workers[0], drain, warm_pool=self.warm_pool,
                             max_replicas=self.policy.max_replicas, visible=visible)
        filling = asyncio.ensure_future(driver.fill())
        self.service = AutoscaleService(etcd, fleet, Autoscaler(default=self.policy), driver, self.interval,
                                        pools=(f"{self.model_name}/both",), name="tokenfleet-up", metrics=metrics)
        self._ready.set()
        try:
            await self.service.run(self._stop)
        finally:
            filling.cancel()
            await fleet.stop()
            await etcd.close()
