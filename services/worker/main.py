"""Engine worker process: load the model, serve EngineService over gRPC until SIGTERM, then drain."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import gc
import signal
import socket
import time
from collections.abc import Sequence
from pathlib import Path

import structlog
from prometheus_client import CollectorRegistry
from tokenfleet.services.common.server import GrpcServer, run_service, serve_metrics
from tokenfleet.services.registry.client import fetch_record
from tokenfleet.services.worker.identity import expand_kv_tier, worker_identity
from tokenfleet.services.worker.numerics import settle_dtype
from tokenfleet.services.worker.servicer import MAX_MESSAGE_BYTES, EngineWorker
from tokenfleet.services.worker.sources import PrefillSources

from tokenfleet.backends.torch.builder import build_engine_core
from tokenfleet.cluster.etcd import EtcdClient
from tokenfleet.cluster.membership import DRAINING, ReplicaRecord, ReplicaRegistration
from tokenfleet.cluster.registry import ModelRecord
from tokenfleet.engine.async_engine import AsyncEngine
from tokenfleet.engine.config import EngineConfig
from tokenfleet.engine.interface import Engine
from tokenfleet.engine.runner import KernelCheck
from tokenfleet.security import plane as plane_args
from tokenfleet.security.authz import AuditLog
from tokenfleet.security.plane import Plane
from tokenfleet.telemetry.metrics import WorkerCollector
from tokenfleet.v1 import engine_pb2, engine_pb2_grpc

ROLES = ("decode", "prefill", "both")
log = structlog.get_logger()


def parse_args(argv: Sequence[str] | None, default_role: str) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog=f"tokenfleet {default_role}", description="tokenfleet engine worker")
    p.add_argument("--role", choices=ROLES, default=default_role)
    p.add_argument("--model", help="HF model folder (default: the imported SmolLM2-135M-Instruct); "
                   "with --registry, the folder comes from the registry record instead")
    p.add_argument("--registry", help="registry address host:port: load --model-name (name, alias or name@version) "
                   "as its record says")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0, help="0 picks a free port (printed on start)")
    p.add_argument("--dtype", choices=["auto", "bfloat16", "float32", "float16"],
                   help="default: the registry record's dtype (auto: the record's pinned choice, else this machine's "
                   "fastest, then pinned), else auto")
    p.add_argument("--kv-cache-dtype", choices=["", "fp8"],
                   help="fp8: an FP8 KV cache (e4m3, a scale per token and KV head); default: the registry record's, "
                   "else the weights' dtype")
    p.add_argument("--async-scheduling", action="store_true",
                   help="overlapped scheduling: queue the next decode step on the device before reading this one's "
                   "tokens (GPU; off by default)")
    p.add_argument("--device", default="auto")
    p.add_argument("--threads", type=int, help="torch CPU threads (leave cores for other processes)")
    p.add_argument("--small-step-threads", type=int,
                   help="torch CPU threads of steps of up to 4 tokens (one stream's decode); default: --threads")
    p.add_argument("--num-blocks", type=int, help="KV pool size in blocks (wins over --kv-pool-bytes)")
    p.add_argument("--kv-pool-bytes", type=int, help="KV pool size in bytes: as many blocks as it holds at the "
                   "model's KV bytes per block (default 1 GiB)")
    p.add_argument("--kv-retention-max-s", type=float, default=300.0, help="a request's KV retention (a "
                   "conversation expected back, retention_ms) is clamped to this many seconds")
    p.add_argument("--kv-retention-tier-max-s", type=float, default=86400.0, help="with --kv-tier: how long a "
                   "request's KV retention (prompt_cache_retention 24h) keeps the second tier's priority, past the "
                   "pool's --kv-retention-max-s (a day)")
    p.add_argument("--kv-retention-tenant-blocks", type=int, default=0, help="KV blocks one tenant's conversations "
                   "may retain above plain LRU; over it its oldest retention ends first (0: no quota)")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--max-num-waiting", type=int, default=1024)
    p.add_argument("--max-num-running", type=int, default=128, help="requests decoding at once (the batch cap)")
    p.add_argument("--max-model-len", type=int, help="context length (default: the registry record's, else the "
                   "model's)")
    p.add_argument("--no-fair-queuing", action="store_true",
                   help="queue by (priority, arrival) only, not fairly between tenants")
    p.add_argument("--transfer-timeout", type=float, default=30.0,
                   help="seconds a KV transfer may take: prefill-side held blocks are freed after it, and a "
                   "decode worker prefills locally instead")
    p.add_argument("--max-prefill-chunk", type=int, default=0, help="cap each request's prefill chunk (0 = budget)")
    p.add_argument("--itl-guard", type=float, default=1.5, help="a step beside decoding streams takes at most this "
                   "times a decode-only step (a long prompt's chunks get the rest, at least a token a step); 0 = off")
    p.add_argument("--ttft-slo-ms", type=float, default=500.0, help="the TTFT objective's base: a prompt is "
                   "promised its first token within this plus --ttft-slo-per-token-ms per prompt token")
    p.add_argument("--ttft-slo-per-token-ms", type=float, default=1.0, help="the TTFT objective's share per prompt "
                   "token")
    p.add_argument("--tpot-slo-ms", type=float, default=100.0, help="the TPOT objective of this replica's streams: "
                   "a long prompt whose TTFT objective is at risk at --itl-guard's pace may take steps of up to 0.8 "
                   "of it beside them (their slack); 0 = --itl-guard alone")
    p.add_argument("--grace-seconds", type=float, default=30.0, help="drain deadline on SIGTERM")
    p.add_argument("--handoff-idle-seconds", type=float, default=2.0,
                   help="after a drain, keep sending cached blocks to peers until none has fetched for this long "
                   "(within the grace period; 0: exit once drained)")
    p.add_argument("--kv-tier", default="", help="second KV tier for blocks the pool evicts: memory or disk:DIR "
                   "(restored on prefix hits instead of recomputed); {replica} in DIR: the replica id")
    p.add_argument("--kv-tier-bytes", type=int, default=4 << 30, help="the second tier's byte budget")
    p.add_argument("--kv-tier-tenant-bytes", type=int, default=0, help="per-tenant bytes in the second tier (0: none)")
    p.add_argument("--kv-tier-key-file", default="", help="AES key (16/24/32 bytes or hex; chmod 600) sealing the "
                   "second tier's records")
    p.add_argument("--lora", action="append", default=[], metavar="NAME=PATH",
                   help="load a PEFT LoRA adapter (repeat); clients ask for it as model BASE:NAME")
    p.add_argument("--fail-fraction", type=float, default=0.0, help="chaos testing: fail this share of requests "
                   "(INTERNAL) to exercise retries and canary rollbacks; never in production")
    p.add_argument("--etcd", help="etcd endpoint host:port; register in replicas/<model>/<id> (omit: standalone)")
    p.add_argument("--etcd-root", default="/tokenfleet/v1/")
    p.add_argument("--standby", action="store_true", help="load and warm up, then wait for SIGUSR1 before joining "
                   "the fleet (registering in etcd): a warm-pool replica the autoscaler activates")
    p.add_argument("--lease-ttl", type=int, default=10, help="seconds a dead worker stays registered")
    p.add_argument("--model-name", help="registered model name (default: the model folder's name)")
    p.add_argument("--replica-id", help="default: <hostname>-<port>; `hostname`: this host's name (a container's)")
    p.add_argument("--advertise-address", help="host:port others use to reach this worker (default: the bound "
                   "address; set it when binding 0.0.0.0, e.g. in containers); host `hostname`: this host's name, "
                   "`auto`: the IP address it resolves to (a container's on its network; refused if loopback)")
    p.add_argument("--metrics-port", type=int, help="serve Prometheus /metrics on this port (0 = any free port)")
    p.add_argument("--backend", choices=["torch", "trtllm"],
                   help="engine implementation (default: the registry record's, else torch); trtllm needs the "
                   "tokenfleet[trtllm] extra on a GPU node")
    _add_trtllm_arguments(p)
    plane_args.add_arguments(p)
    args = p.parse_args(argv)
    try:  # before the engine opens the tier: its folder must not wait for the bound port
        args.kv_tier = expand_kv_tier(args.kv_tier, args.replica_id, socket.gethostname())
    except ValueError as e:
        p.error(str(e))
    return args


def _add_trtllm_arguments(p: argparse.ArgumentParser) -> None:
    """The TensorRT-LLM flags; their module imports no tensorrt_llm."""
    from tokenfleet.backends.trtllm.worker import add_arguments

    add_arguments(p)


def engine_config(args: argparse.Namespace, record: ModelRecord | None = None) -> EngineConfig:
    from tokenfleet.models.gguf_import import ensure_default_model

    if record is not None and record.backend != "torch":
        raise ValueError(f"{record.ref} needs the {record.backend!r} backend; start the worker with --backend "
                         f"{record.backend}")
    model = record.path if record is not None else args.model or str(ensure_default_model())
    return EngineConfig(
        model=model,
        dtype=args.dtype or (record.dtype if record is not None else "auto"),
        max_model_len=args.max_model_len or (record.max_model_len or None if record is not None else None),
        device=args.device,
        num_threads=args.threads,
        small_step_threads=args.small_step_threads,
        num_blocks=args.num_blocks,
        **({"kv_cache_bytes": args.kv_pool_bytes} if args.kv_pool_bytes else {}),  # type: ignore[arg-type]
        kv_retention_max_s=args.kv_retention_max_s,
        kv_retention_tier_max_s=args.kv_retention_tier_max_s,
        kv_retention_tenant_blocks=args.kv_retention_tenant_blocks,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_num_waiting=args.max_num_waiting,
        max_prefill_chunk=args.max_prefill_chunk,
        itl_guard=args.itl_guard,
        ttft_slo_ms=args.ttft_slo_ms,
        ttft_slo_per_token_ms=args.ttft_slo_per_token_ms,
        tpot_slo_ms=args.tpot_slo_ms,
        max_num_running=args.max_num_running,
        fair_queuing=not args.no_fair_queuing,
        kv_tier=args.kv_tier,
        kv_tier_bytes=args.kv_tier_bytes,
        kv_tier_tenant_bytes=args.kv_tier_tenant_bytes,
        kv_tier_key_file=args.kv_tier_key_file,
        speculative_config=args.speculative_config or (record.speculative_config if record is not None else ""),
        lora_adapters=tuple(_lora(spec) for spec in args.lora),
        quantization=record.quantization if record is not None else "",
        kv_cache_dtype=args.kv_cache_dtype if args.kv_cache_dtype is not None else
        (record.kv_cache_dtype if record is not None else ""),
        async_scheduling=args.async_scheduling,
    )


async def warm_up(engine: AsyncEngine) -> None:
    """One one-token generation before the worker says it serves: kernels built, caches touched, the first real
    request's latency not a cold start's."""
    from tokenfleet.engine.request_spec import RequestSpec
    from tokenfleet.engine.sampling_params import SamplingParams

    start = time.monotonic()
    async for _ in engine.generate(RequestSpec([1, 2, 3, 4], SamplingParams(max_tokens=1, temperature=0.0), "warm-up")):
        pass
    await engine.forget_prefill_rate()  # the cold start's rate, not the engine's
    log.info("warmed up", seconds=round(time.monotonic() - start, 3))


def log_kernel_checks(checks: Sequence[KernelCheck]) -> None:
    """One line per kernel: what was checked against the reference at load, what serves, and the checks' cost (the
    lines `tokenfleet doctor` prints)."""
    for c in checks:
        (log.info if c.passed else log.error)(
            "kernel", kernel=c.kernel, implementation=c.implementation, serving=c.serving,
            check="passed" if c.passed else f"FAILED: {c.detail}", max_error=round(c.max_error, 6),
            tolerance=c.tolerance)
    if checks:
        log.info("kernel checks", seconds=round(sum(c.seconds for c in checks), 3),
                 failed=[c.kernel for c in checks if not c.passed])


async def registered_adapter_path(registry: str, plane: Plane, served: ModelRecord, ref: str) -> str:
    """The PEFT folder of the registered adapter ``ref``, when it adapts the model this worker serves."""
    adapter = await fetch_record(registry, ref, plane, wait_s=10)
    if not adapter.base:
        raise ValueError(f"{ref} is a model, not a LoRA adapter")
    base = await fetch_record(registry, adapter.base, plane, wait_s=10)
    if (base.name, base.version) != (served.name, served.version):
        raise ValueError(f"{adapter.ref} adapts {base.ref}; this worker serves {served.ref}")
    return adapter.path


def _lora(spec: str) -> tuple[str, str]:
    name, sep, path = spec.partition("=")
    if not sep or not name or not path:
        raise ValueError(f"--lora takes NAME=PATH, got {spec!r}")
    return name, path


async def serve(args: argparse.Namespace) -> None:
    """Start one worker: model (from the registry or a folder), engine, gRPC server, membership and
    metrics, then wait for the stop signal and drain. One sequence of setup steps, each a few lines,
    kept in start order rather than split (that is why it runs past the ~60-line guideline)."""
    metrics = CollectorRegistry()
    plane = Plane.from_args(args, "worker", metrics)
    record = None
    numerics_note = ""  # set when this worker serves a record's pinned dtype that is not its own fastest
    if args.registry:
        if not args.model_name:
            raise SystemExit("--registry needs --model-name (the registered name, alias or name@version)")
        record = await fetch_record(args.registry, args.model_name, plane)
        log.info("model from the registry", ref=record.ref, path=record.path)
    backend = args.backend or (record.backend if record is not None else "torch")
    if backend == "trtllm":
        from tokenfleet.backends.trtllm.worker import build_engine  # imports tensorrt_llm only at start()

        trtllm = build_engine(args, record)
        engine: Engine = trtllm
        config = EngineConfig(model=trtllm.spec.model, max_num_running=args.max_num_running)  # for registration
    else:
        config = engine_config(args, record)
        if record is not None:
            config, numerics_note = await settle_dtype(args.registry, record, config, plane)
        engine = AsyncEngine(lambda: build_engine_core(config), transfer_timeout=args.transfer_timeout)
    await engine.start()
    log_kernel_checks(engine.kernel_checks())
    if isinstance(engine, AsyncEngine):
        await warm_up(engine)  # ready (health, etcd) only once a real generation has run
    gc.collect()
    gc.freeze()  # the loaded model and runtime leave the cyclic collector's scans (~4 % of a one-stream CPU step)
    server = GrpcServer([engine_pb2.DESCRIPTOR.services_by_name["EngineService"].full_name], args.host, args.port,
                        plane=plane, audit=AuditLog(args.audit_log, f"worker-{args.role}"),
                        max_message_bytes=MAX_MESSAGE_BYTES)
    replica_id, address = worker_identity(args.replica_id, args.advertise_address, server.address)
    etcd = EtcdClient(args.etcd, args.etcd_root, identity=plane.identity) if args.etcd else None
    layout = engine.kv_layout()
    layout_key = layout.key() if layout is not None else ""
    model_name, model_version = _model_name(args, config, record)
    registration = (await register(args, etcd, config, replica_id, address, record, layout_key, numerics_note)
                    if etcd is not None else None)
    sources = PrefillSources(etcd, model_name, model_version, layout_key)
    await sources.start()

    async def mark_draining() -> None:
        if registration is not None:
            await registration.set_state(DRAINING)  # routers stop placing here

    async def request_exit() -> None:
        server.stop_requested.set()

    worker = EngineWorker(engine, args.role, plane, sources, on_draining=mark_draining, on_drained=request_exit)
    if args.registry and record is not None:
        worker.adapter_source = functools.partial(registered_adapter_path, args.registry, plane, record)
    if args.fail_fraction:
        log.warning("chaos testing: failing a share of requests", fail_fraction=args.fail_fraction)
        worker.fail_fraction = args.fail_fraction
    peaks = await engine.device_peaks()  # MFU/MBU's denominators: a known card's, else measured now (~0.1 s)
    if peaks is not None:
        flops, read, source = peaks
        worker.peaks = (flops, read)
        log.info("device peaks", peak_tflops=round(flops / 1e12, 3), peak_gbytes_per_s=round(read / 1e9, 1),
                 source=source)
    engine_pb2_grpc.add_EngineServiceServicer_to_server(worker, server.server)
    await server.start()
    log.info("worker serving", address=server.address, role=args.role, model=config.model)
    metrics.register(WorkerCollector(worker.report))
    serve_metrics(metrics, args.host, args.metrics_port)  # its METRICS line before LISTENING: launchers read both
    print(f"LISTENING {server.address}", flush=True)  # machine-readable line for launchers and tests

    async def on_drain() -> None:
        if engine.error is not None:
            return  # a failed engine finishes nothing: leave now
        deadline = time.monotonic() + args.grace_seconds
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(worker.drain(), timeout=args.grace_seconds)
        me = registration.record.replica_id if registration is not None else None
        peers = [r for r in sources.records.values()  # replicas that could fetch from this one (check_peer's terms)
                 if r.replica_id != me and r.model_version == model_version and r.kv_layout == layout_key]
        if args.handoff_idle_seconds > 0 and peers and engine.peer_blocks is not None:
            await worker.hand_off(args.handoff_idle_seconds, deadline)  # only a replica with peers has takers
        if registration is not None:
            await registration.stop()  # routers stop naming it as a prefix source before it stops answering
        worker.reports_closed = True  # Load streams end: nothing left to wait for

    async def watch_health() -> None:
        """An engine whose library failed (``error`` set) takes no more work: leave the fleet and exit."""
        while engine.error is None:
            await asyncio.sleep(1.0)
        log.error("engine failed; deregistering and exiting", error=repr(engine.error))
        if registration is not None:
            await registration.stop()
        server.stop_requested.set()

    watcher = asyncio.create_task(watch_health())

    try:
        await server.run_until_signal(on_drain, args.grace_seconds)
    finally:
        watcher.cancel()
        await sources.stop()
        if registration is not None:
            await registration.stop()
        if etcd is not None:
            await etcd.close()
        await worker.close()
        await engine.shutdown()
    if engine.error is not None:
        raise SystemExit(3)  # a failed engine: the supervisor restarts the worker


def _model_name(args: argparse.Namespace, config: EngineConfig, model: ModelRecord | None) -> tuple[str, str]:
    """(name, version) this worker registers under."""
    if model is not None:
        return model.name, model.version
    return args.model_name or Path(config.model).name, ""


async def register(args: argparse.Namespace, etcd: EtcdClient, config: EngineConfig, replica_id: str, address: str,
                   model: ModelRecord | None, layout_key: str, numerics_note: str = "") -> ReplicaRegistration:
    roles = ("decode", "prefill") if args.role == "both" else (args.role,)
    name, version = _model_name(args, config, model)
    record = ReplicaRecord(
        replica_id=replica_id,
        model=name,
        model_version=version,
        address=address,
        roles=roles,
        num_blocks=config.num_blocks or 0,
        max_running=config.max_num_running,
        kv_layout=layout_key,
        numerics=numerics_note,
    )
    registration = ReplicaRegistration(etcd, record, ttl=args.lease_ttl)
    if args.standby:  # a warm-pool replica: loaded and warmed up, joins the fleet on SIGUSR1
        loop = asyncio.get_running_loop()

        def activate() -> None:
            loop.remove_signal_handler(signal.SIGUSR1)
            log.info("standby worker activated", replica=record.replica_id)
            loop.create_task(registration.start())

        loop.add_signal_handler(signal.SIGUSR1, activate)
        log.info("standby: serving no fleet traffic until SIGUSR1", replica=record.replica_id)
    else:
        await registration.start()
    return registration


def main(argv: Sequence[str] | None = None, default_role: str = "decode") -> int:
    args = parse_args(argv, default_role)
    return run_service(f"worker-{args.role}", serve, args)
