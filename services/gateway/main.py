"""Gateway process: OpenAI-compatible HTTP/SSE on uvicorn + uvloop, placements from the router."""

from __future__ import annotations

import argparse
import asyncio
import socket
from collections.abc import Sequence
from pathlib import Path

import structlog
import uvicorn
from tokenfleet.services.gateway.app import Gateway, ServedModel, create_app

from tokenfleet.models.config import ModelConfig
from tokenfleet.models.tokenizer import Tokenizer
from tokenfleet.telemetry.logging import configure_logging

log = structlog.get_logger()


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="tokenfleet gateway", description="tokenfleet OpenAI-compatible gateway")
    p.add_argument("--router", required=True, help="router address host:port")
    p.add_argument("--model", action="append", default=[], metavar="NAME=DIR",
                   help="served model: name and HF folder (tokenizer, chat template, context); repeatable")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0)
    return p.parse_args(argv)


def served_models(specs: list[str]) -> dict[str, ServedModel]:
    if not specs:
        from tokenfleet.models.gguf_import import DEFAULT_MODEL_NAME, ensure_default_model

        specs = [f"{DEFAULT_MODEL_NAME}={ensure_default_model()}"]
    models = {}
    for spec in specs:
        name, sep, folder = spec.partition("=")
        if not sep:
            raise ValueError(f"--model expects NAME=DIR, got {spec!r}")
        config = ModelConfig.from_dir(folder)
        models[name] = ServedModel(name, Tokenizer(Path(folder)), config.max_position_embeddings)
    return models


async def serve(args: argparse.Namespace) -> None:
    app = create_app(Gateway(args.router, served_models(args.model)))
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((args.host, args.port))
    host, port = sock.getsockname()[:2]
    config = uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=30)
    server = uvicorn.Server(config)
    log.info("gateway serving", url=f"http://{host}:{port}")
    print(f"LISTENING {host}:{port}", flush=True)
    await server.serve(sockets=[sock])


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
