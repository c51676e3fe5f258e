"""Gateway process: OpenAI-compatible HTTP/SSE on uvicorn + uvloop, placements from the router."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import signal
import socket
from collections.abc import Iterator, Sequence

import structlog
import uvicorn
from tokenfleet.services.common.server import GrpcServer, run_service
from tokenfleet.services.gateway.app import Gateway, ModelCatalog, ServedModel, create_app, load_served
from tokenfleet.services.gateway.grpc_api import InferenceAPI
from tokenfleet.services.registry.client import watch_registry

from tokenfleet.cluster.registry import RegistryView
from tokenfleet.v1 import inference_pb2, inference_pb2_grpc

log = structlog.get_logger()


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="tokenfleet gateway", description="tokenfleet OpenAI-compatible gateway")
    p.add_argument("--router", required=True, help="router address host:port")
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
    p.add_argument("--grace-seconds", type=float, default=30.0,
                   help="on SIGTERM: stop accepting, let open streams finish for this long")
    return p.parse_args(argv)


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


async def follow(catalog: ModelCatalog, registry: str) -> None:
    async for view in watch_registry(registry):
        catalog.view, catalog.synced = view, True


class _Server(uvicorn.Server):
    """uvicorn without its own signal handlers: the gateway drains HTTP and gRPC together."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


async def serve(args: argparse.Namespace) -> None:
    catalog = ModelCatalog(static_models(args.model, use_default=not args.registry),
                           RegistryView() if args.registry else None)
    watcher = asyncio.create_task(follow(catalog, args.registry)) if args.registry else None
    gateway = Gateway(args.router, catalog, max_resumes=args.max_resumes)
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((args.host, args.port))
    host, port = sock.getsockname()[:2]
    http = _Server(uvicorn.Config(create_app(gateway), log_level="warning",
                                  timeout_graceful_shutdown=int(args.grace_seconds)))
    grpc_server = None
    if args.grpc_port is not None:
        grpc_server = GrpcServer([inference_pb2.DESCRIPTOR.services_by_name["InferenceService"].full_name],
                                 args.host, args.grpc_port)
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
    log.info("gateway serving", url=f"http://{host}:{port}")
    print(f"LISTENING {host}:{port}", flush=True)
    try:
        await asyncio.wait([http_task, asyncio.create_task(stop.wait())], return_when=asyncio.FIRST_COMPLETED)
        log.info("gateway draining", grace_seconds=args.grace_seconds)
        gateway.draining = True
        http.should_exit = True  # stop accepting; open HTTP streams finish (up to the grace period)
        drains = [http_task] + ([asyncio.create_task(grpc_server.stop(args.grace_seconds))] if grpc_server else [])
        await asyncio.gather(*drains)
    finally:
        if watcher is not None:
            watcher.cancel()
    log.info("gateway stopped")


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    return run_service("gateway", serve, args)
