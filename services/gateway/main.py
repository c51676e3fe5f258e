"""Gateway process: OpenAI-compatible HTTP/SSE on uvicorn + uvloop, placements from the router."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import socket
from collections.abc import Iterator, Sequence
from pathlib import Path

import structlog
import uvicorn
from tokenfleet.services.common.server import GrpcServer, run_service, serve_metrics
from tokenfleet.services.gateway.app import MAX_BODY_BYTES, create_app
from tokenfleet.services.gateway.batch_runner import BatchRunner
from tokenfleet.services.gateway.catalog import ModelCatalog, ServedModel, load_served
from tokenfleet.services.gateway.dispatch import DEFAULT_STALL_TIMEOUT_S
from tokenfleet.services.gateway.grpc_api import InferenceAPI
from tokenfleet.services.gateway.http_protocol import HeadTimeoutH11Protocol
from tokenfleet.services.gateway.pipeline import Gateway
from tokenfleet.services.gateway.preparer import DEFAULT_MAX_QUEUED, Preparer
from tokenfleet.services.gateway.responses_api import Responses
from tokenfleet.services.registry.client import watch_registry

from tokenfleet.api.openai_schema import DEFAULT_RETENTION_WINDOW_S
from tokenfleet.batch.formats import Limits as BatchLimits
from tokenfleet.batch.store import BatchStore
from tokenfleet.cluster.etcd import EtcdClient
from tokenfleet.cluster.gateways import GatewayPeers, GatewayRecord
from tokenfleet.cluster.registry import RegistryView
from tokenfleet.responses.store import ResponseStore
from tokenfleet.security import plane as plane_args
from tokenfleet.security.plane import Plane
from tokenfleet.telemetry.metrics import GatewayMetrics
from tokenfleet.tenancy.admission import Admission
from tokenfleet.tenancy.ledger import Ledger
from tokenfleet.tenancy.pricing import Pricing
from tokenfleet.tenancy.store import follow_directory, load_file
from tokenfleet.tenancy.tenants import TIERS, Directory
from tokenfleet.v1 import inference_pb2, inference_pb2_grpc

log = structlog.get_logger()


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="tokenfleet gateway", description="tokenfleet OpenAI-compatible gateway")
    p.add_argument("--router", required=True, action="append",
                   help="router address host:port; repeat (or separate with commas) for several: a Pick that one "
                   "cannot answer goes to the next")
    p.add_argument("--registry", help="registry address host:port: serve every registered model and alias")
    p.add_argument("--model", action="append", default=[], metavar="NAME=DIR",
                   help="a model served without the registry: name and HF folder (tokenizer, chat template, "
                        "context); repeatable. Without --registry and --model: the default model")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0, help="HTTP port (0 = any free port)")
    p.add_argument("--grpc-port", type=int, help="also serve the public gRPC API (inference.proto) on this port "
                   "(0 = any free port)")
    p.add_argument("--max-resumes", type=int, default=2,
                   help="a stream whose replica dies mid-way continues on another replica (prompt + tokens so "
                   "far re-prefilled there) at most this many times, then ends with an error event")
    p.add_argument("--stall-timeout", type=float, default=DEFAULT_STALL_TIMEOUT_S, metavar="SECONDS",
                   help="a stream whose worker has sent nothing, not even a heartbeat (workers send one every quarter "
                   "of this), for this long is given up on there: placed again, or resumed elsewhere like a lost "
                   "replica's (a stopped, hung or unreachable worker; HTTP/2 keepalive does not catch those). 0: off")
    p.add_argument("--auth", choices=["off", "on"], default="off",
                   help="require API keys (Authorization: Bearer tfk_...): tenants and keys from --tenants-file, "
                   "else from etcd (--etcd). off: every caller is the anonymous, unlimited tenant")
    p.add_argument("--pricing", help="what tokens cost (tokenfleet.tenancy.pricing: price per GPU-hour, each model's "
                   "throughput; YAML or JSON); default $TOKENFLEET_PRICING, else $2/GPU-hour at placeholder throughputs")
    p.add_argument("--tenants-file", help="YAML file of tenants and hashed keys (`tokenfleet tenants add --file`)")
    p.add_argument("--etcd", help="etcd host:port: tenants and keys (with --auth on), and the gateway membership "
                   "that splits each tenant's budget between gateways")
    p.add_argument("--etcd-root", default="/tokenfleet/v1/")
    p.add_argument("--gateway-id", help="this gateway's id in etcd (default: <hostname>-<port>)")
    p.add_argument("--ledger", default=str(default_ledger()),
                   help="SQLite usage ledger (one record per request; 'none' turns it off)")
    p.add_argument("--retention-window-s", type=float, default=DEFAULT_RETENTION_WINDOW_S,
                   help="how long a conversation's transcript stays cached above plain LRU after a stored response or "
                   "a request with prompt_cache_retention=in_memory (the client is expected back; workers clamp it "
                   "to their --kv-retention-max-s)")
    p.add_argument("--batch-tier", choices=["on", "off"], default="on", help="serve and run the batch tier "
                   "(/v1/files, /v1/batches; its state is in the --ledger database, so every gateway that serves it "
                   "must open the same file). off: those endpoints answer 404 naming --batch-url")
    p.add_argument("--batch-url", default="", help="with --batch-tier off: where this fleet's batch tier is served "
                   "(told to clients in the 404)")
    p.add_argument("--batch-concurrency", type=int, default=8, help="batch tier: lines this gateway runs at once "
                   "(each only where the router finds spare capacity)")
    p.add_argument("--batch-max-file-bytes", type=int, default=100 << 20, help="batch tier: an upload's size limit")
    p.add_argument("--batch-max-lines", type=int, default=50_000, help="batch tier: requests in one batch")
    p.add_argument("--batch-max-queued-lines", type=int, default=100_000, help="batch tier: a tenant's unfinished "
                   "requests over all its batches (a batch past it is refused with 429)")
    p.add_argument("--batch-lease-seconds", type=float, default=30.0, help="batch tier: a dead gateway's batches "
                   "pass to another gateway this long after its last renewal (a restarted one takes its own at once)")
    p.add_argument("--response-lease-seconds", type=float, default=30.0, help="stored responses: one being generated "
                   "when its gateway died is marked failed by any gateway sharing the database this long after its "
                   "last renewal (a restarted gateway of the same --gateway-id does it at once)")
    p.add_argument("--ttft-objective", action="append", default=[], metavar="TIER=SECONDS",
                   help="early rejection: a request whose predicted wait for its first token exceeds its tier's "
                   "objective gets 503 (Retry-After) at once; without one, only a request predicted to wait past its "
                   "client's deadline (x-request-timeout, the openai client's x-stainless-read-timeout, a gRPC "
                   "deadline; default 600 s) is refused")
    p.add_argument("--max-queued-requests", type=int, default=DEFAULT_MAX_QUEUED,
                   help="requests waiting to be prepared (template, tokens) past which a new one gets 503 (Retry-After) "
                   "at once; below it a burst waits its turn until each client's deadline")
    p.add_argument("--grace-seconds", type=float, default=30.0,
                   help="on SIGTERM: stop accepting, let open streams finish for this long")
    p.add_argument("--metrics-port", type=int, help="serve Prometheus /metrics on this port (0 = any free port; "
                   "not on the API port, which is public)")
    p.add_argument("--api-docs", action="store_true", help="serve /openapi.json, /docs and /redoc on the API port")
    p.add_argument("--tls-cert", help="serve HTTPS and the public gRPC API over TLS with this certificate chain (PEM)")
    p.add_argument("--tls-key", help="the private key (PEM) of --tls-cert")
    plane_args.add_arguments(p, audit=False)
    return p.parse_args(argv)


def public_tls(args: argparse.Namespace) -> tuple[bytes, bytes] | None:
    """(key, certificate chain) for the public APIs, or None (plaintext)."""
    if bool(args.tls_cert) != bool(args.tls_key):
        raise SystemExit("--tls-cert and --tls-key go together")
    if not args.tls_cert:
        return None
    return Path(args.tls_key).read_bytes(), Path(args.tls_cert).read_bytes()


def static_models(specs: list[str], use_default: bool) -> dict[str, ServedModel]:
    if not specs and use_default:
        from tokenfleet.models.gguf_import import DEFAULT_MODEL_NAME, ensure_default_model

        specs = [f"{DEFAULT_MODEL_NAME}={ensure_default_model()}"]
    models = {}
    for spec in specs:
        name, sep, folder = spec.partition("=")
        if not sep:
            raise ValueError(f"--model expects NAME=DIR, got {spec!r}")
        models[name] = load_served(name, name, folder)
    return models


async def follow(catalog: ModelCatalog, registry: str, plane: Plane) -> None:
    async for view in watch_registry(registry, plane):
        catalog.view, catalog.synced = view, True


class _Server(uvicorn.Server):
    """uvicorn without its own signal handlers: the gateway drains HTTP and gRPC together."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


async def serve(args: argparse.Namespace) -> None:
    metrics = GatewayMetrics(pricing=Pricing.load(args.pricing))
    plane = Plane.from_args(args, "gateway", metrics.registry)
    plane_watch = plane.watch()
    catalog = ModelCatalog(static_models(args.model, use_default=not args.registry),
                           RegistryView() if args.registry else None)
    watcher = asyncio.create_task(follow(catalog, args.registry, plane)) if args.registry else None
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((args.host, args.port))
    host, port = sock.getsockname()[:2]
    etcd = EtcdClient(args.etcd, args.etcd_root, identity=plane.identity) if args.etcd else None
    directory, background = await tenant_directory(args, etcd)
    peers = None
    if args.response_lease_seconds <= 0:
        raise SystemExit("--response-lease-seconds must be positive")
    gateway_id = args.gateway_id or f"{socket.gethostname()}-{port}"
    if etcd is not None:
        peers = GatewayPeers(etcd, GatewayRecord(gateway_id, f"{host}:{port}"))
        await peers.start()
    ledger = Ledger(args.ledger) if args.ledger != "none" else None
    admission = Admission(directory, ledger, share=peers.share if peers is not None else lambda: 1.0)
    routers = [a.strip() for given in args.router for a in given.split(",") if a.strip()]
    gateway = Gateway(routers, catalog, metrics=metrics, plane=plane, max_resumes=args.max_resumes,
                      stall_timeout=args.stall_timeout,
                      admission=admission, preparer=Preparer(max_queued=args.max_queued_requests),
                      ttft_objectives=ttft_objectives(args.ttft_objective),
                      retention_window_s=args.retention_window_s)
    log.info("gateway admission", auth=args.auth, ledger=args.ledger)
    store = runner = None
    if ledger is not None and args.batch_tier == "on":  # in the ledger's database: a line and its charge, one commit
        store = BatchStore(args.ledger, BatchLimits(max_file_bytes=args.batch_max_file_bytes,
                                                    max_lines=args.batch_max_lines,
                                                    max_queued_lines=args.batch_max_queued_lines))
        runner = BatchRunner(gateway, store, ledger, gateway_id, args.batch_concurrency, args.batch_lease_seconds)
        background.append(runner.start())
    # stored responses live in the ledger's database too; without one nothing is stored
    response_store = ResponseStore(args.ledger) if ledger is not None else None
    gateway.retention = response_store  # the tenants' retention quotas are counted there
    responses = Responses(gateway, response_store, owner=gateway_id, lease_s=args.response_lease_seconds)
    if response_store is not None:
        recovered = await asyncio.to_thread(response_store.recover, gateway_id)
        if recovered:
            log.warning("background responses this gateway ran when it stopped are failed", count=recovered)
        background.append(asyncio.create_task(responses.sweep_forever()))
    serve_metrics(metrics.registry, args.host, args.metrics_port)
    http = _Server(uvicorn.Config(create_app(gateway, api_docs=args.api_docs, batches=store,
                                             batch_url=args.batch_url, responses=responses), log_level="warning",
                                  http=HeadTimeoutH11Protocol,  # slow-loris connections are closed
                                  ssl_certfile=args.tls_cert, ssl_keyfile=args.tls_key,
                                  timeout_graceful_shutdown=int(args.grace_seconds)))
    grpc_server = None
    if args.grpc_port is not None:
        grpc_server = GrpcServer([inference_pb2.DESCRIPTOR.services_by_name["InferenceService"].full_name],
                                 args.host, args.grpc_port, max_message_bytes=MAX_BODY_BYTES,  # as HTTP's
                                 public_tls=public_tls(args))
        inference_pb2_grpc.add_InferenceServiceServicer_to_server(InferenceAPI(gateway), grpc_server.server)
        await grpc_server.start()
        log.info("gateway gRPC API serving", address=grpc_server.address)
        print(f"GRPC {grpc_server.address}", flush=True)

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    http_task = asyncio.create_task(http.serve(sockets=[sock]))
    while not http.started and not http_task.done():
        await asyncio.sleep(0.02)
    log.info("gateway serving", url=f"{'https' if args.tls_cert else 'http'}://{host}:{port}")
    print(f"LISTENING {host}:{port}", flush=True)
    try:
        await asyncio.wait([http_task, asyncio.create_task(stop.wait())], return_when=asyncio.FIRST_COMPLETED)
        log.info("gateway draining", grace_seconds=args.grace_seconds)
        gateway.draining = True
        http.should_exit = True  # stop accepting; open HTTP streams finish (up to the grace period)
        drains = [http_task] + ([asyncio.create_task(grpc_server.stop(args.grace_seconds))] if grpc_server else [])
        if runner is not None:  # running lines finish, then the leases go back for another gateway to take
            drains.append(asyncio.create_task(runner.stop(args.grace_seconds)))
        await asyncio.gather(*drains)
    finally:
        if watcher is not None:
            watcher.cancel()
        if plane_watch is not None:
            plane_watch.cancel()
        for task in background:
            task.cancel()
        if peers is not None:
            await peers.stop()
        if etcd is not None:
            await etcd.close()
        if ledger is not None:
            ledger.close()
        if store is not None:
            store.close()
        if response_store is not None:
            for task in list(responses.running.values()):  # background responses cut by the stop are failed now,
                task.cancel()                                # not left in progress for a restart to find
            await asyncio.gather(*responses.running.values(), *responses.finishing, return_exceptions=True)
            await asyncio.to_thread(response_store.recover, gateway_id)
            response_store.close()
    log.info("gateway stopped")


async def tenant_directory(args: argparse.Namespace, etcd: EtcdClient | None) -> tuple[Directory | None, list]:
    """The tenants and keys to authenticate against (None: auth off), and the task keeping them current."""
    if args.auth == "off":
        return None, []
    if args.tenants_file:
        directory = load_file(args.tenants_file)
        return directory, [asyncio.create_task(reload_on_change(args.tenants_file, directory))]
    if etcd is None:
        raise SystemExit("--auth on needs --tenants-file or --etcd")
    directory, synced = Directory(), asyncio.Event()
    task = asyncio.create_task(follow_directory(etcd, directory, synced))
    with contextlib.suppress(TimeoutError):  # etcd away: start with no keys (401s) and fill in when it returns
        await asyncio.wait_for(synced.wait(), timeout=10)
    return directory, [task]


async def reload_on_change(path: str, directory: Directory, interval: float = 1.0) -> None:
    """Follow edits of the tenants file (revocations take effect within ``interval``); a broken
    edit keeps the last good contents."""
    seen = os.stat(path).st_mtime_ns
    while True:
        await asyncio.sleep(interval)
        try:
            mtime = os.stat(path).st_mtime_ns
            if mtime != seen:
                fresh = load_file(path)
                directory.tenants, directory.keys, seen = fresh.tenants, fresh.keys, mtime
                log.info("tenants file reloaded", tenants=len(fresh.tenants), keys=len(fresh.keys))
        except (OSError, ValueError, TypeError) as e:
            log.warning("tenants file unreadable; keeping the last good one", error=str(e))


def ttft_objectives(specs: list[str]) -> dict[str, float]:
    objectives: dict[str, float] = {}
    for spec in specs:
        tier, sep, seconds = spec.partition("=")
        if not sep or tier not in TIERS:
            raise SystemExit(f"--ttft-objective expects TIER=SECONDS with TIER in {TIERS}, got {spec!r}")
        objectives[tier] = float(seconds)
    return objectives


def default_ledger():  # type: ignore[no-untyped-def]
    from tokenfleet import envs

    return envs.cache_dir() / "ledger.sqlite3"


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    return run_service("gateway", serve, args)
