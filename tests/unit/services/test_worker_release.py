"""The worker's Release RPC: it hands the conversation to the engine and returns the blocks it retained; an
empty conversation is INVALID_ARGUMENT and never reaches the engine."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from services.worker.servicer import EngineWorker
from services.worker.sources import PrefillSources
from tokenfleet.security.plane import Plane
from tokenfleet.v1 import engine_pb2


class Aborted(Exception):
    pass


class Context:
    """The part of a grpc.aio.ServicerContext the error mapping uses."""

    code: grpc.StatusCode | None = None

    def invocation_metadata(self) -> tuple:
        return ()

    async def abort(self, code: grpc.StatusCode, details: str) -> None:
        self.code = code
        raise Aborted(details)


class RetainingEngine:
    """The one Engine member Release uses: conversations and the blocks each retains."""

    def __init__(self, retained: dict[str, int]):
        self.retained = retained
        self.released: list[str] = []

    async def release(self, conversation: str) -> int:
        self.released.append(conversation)
        return self.retained.pop(conversation, 0)


def release(worker: EngineWorker, conversation: str, context: Context) -> engine_pb2.ReleaseResponse:
    return asyncio.run(worker.Release(engine_pb2.ReleaseRequest(conversation=conversation), context))


def make_worker(engine: RetainingEngine) -> EngineWorker:
    return EngineWorker(engine, "both", Plane.plaintext(), PrefillSources(None, "m", "v", "layout"))  # type: ignore[arg-type]


def test_release_returns_the_blocks_the_conversation_retained():
    engine = RetainingEngine({"c1": 7})
    worker = make_worker(engine)
    assert release(worker, "c1", Context()).blocks == 7
    assert release(worker, "c1", Context()).blocks == 0  # already released
    assert engine.released == ["c1", "c1"]


def test_an_empty_conversation_is_invalid_argument():
    engine = RetainingEngine({"": 3})
    context = Context()
    with pytest.raises(Aborted):
        release(make_worker(engine), "", context)
    assert context.code is grpc.StatusCode.INVALID_ARGUMENT and engine.released == []
