"""Gateway process: OpenAI-compatible HTTP/SSE on uvicorn + uvloop, placements from the router."""

from __future__ import annotations

import argparse
import asyncio
import socket
from collections.abc import Sequence

import structlog
import uvicorn
from tokenfleet.services.gateway.app import Gateway, ModelCatalog, ServedModel, create_app, load_served
from tokenfleet.services.registry.client import watch_registry

from tokenfleet.cluster.registry import RegistryView
from tokenfleet.telemetry.logging import configure_logging

log = structlog.get_logger()


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="tokenfleet gateway", description="tokenfleet OpenAI-compatible gateway")
    p.add_argument("--router", required=True, help="router address host:port")
    p.add_argument("--registry", help="registry address host:port: serve every registered model and alias")
    p.add_argument("--model", action="append", default=[], metavar="NAME=DIR",
                   help="a model served without the registry: name and HF folder (tokenizer, chat template, "
                        "context); repeatable. Without --registry and --model: the default model")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0)
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
        view.revision = max(1, (catalog.view.revision if catalog.view else 0) + 1)
        catalog.view = view


async def serve(args: argparse.Namespace) -> None:
    catalog = ModelCatalog(static_models(args.model, use_default=not args.registry),
                           RegistryView() if args.registry else None)
    watcher = asyncio.create_task(follow(catalog, args.registry)) if args.registry else None
    app = create_app(Gateway(args.router, catalog))
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((args.host, args.port))
    host, port = sock.getsockname()[:2]
    config = uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=30)
    server = uvicorn.Server(config)
    log.info("gateway serving", url=f"http://{host}:{port}")
    print(f"LISTENING {host}:{port}", flush=True)
    try:
        await server.serve(sockets=[sock])
    finally:
        if watcher is not None:
            watcher.cancel()


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    configure_logging("gateway")
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    asyncio.run(serve(args))
    return 0
