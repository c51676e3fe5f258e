"""The dispatcher with a conversation, against a router and a worker on loopback: the Pick carries the conversation,
the placement names the replica's address and the prefix the router expected, the request's span records what was
expected and what the worker found, Release is best effort, and the expected prefix reaches callers who see placement
as a header."""

from __future__ import annotations

import asyncio
from typing import Any

import grpc
from tokenfleet.services.gateway.app import PREFIX_EXPECTED_HEADER, REPLICA_HEADER, _headers
from tokenfleet.services.gateway.dispatch import Dispatcher, Job, Placement
from tokenfleet.services.gateway.pipeline import Call

from tokenfleet.engine.request_spec import RequestSpec
from tokenfleet.engine.sampling_params import SamplingParams
from tokenfleet.security.plane import Channels, Plane
from tokenfleet.telemetry.metrics import GatewayMetrics
from tokenfleet.telemetry.tracing import Trace
from tokenfleet.tenancy.admission import Caller
from tokenfleet.tenancy.tenants import Tenant
from tokenfleet.v1 import common_pb2, engine_pb2, engine_pb2_grpc, router_pb2, router_pb2_grpc

EXPECTED, FOUND = 48, 64  # the router's estimate and the engine's count differ, as they may


class FakeRouter(router_pb2_grpc.RouterServiceServicer):
    def __init__(self) -> None:
        self.address = ""
        self.picks: list[router_pb2.PickRequest] = []

    async def Pick(self, request: router_pb2.PickRequest, context: Any) -> router_pb2.PickResponse:
        self.picks.append(request)
        return router_pb2.PickResponse(replica_id="r7", address=self.address, model="m", model_version="v1",
                                       cached_prompt_tokens=EXPECTED)


class FakeWorker(engine_pb2_grpc.EngineServiceServicer):
    def __init__(self) -> None:
        self.released: list[str] = []

    async def Generate(self, request: engine_pb2.GenerateRequest, context: Any):  # type: ignore[no-untyped-def]
        yield engine_pb2.GenerateResponse(chunk=engine_pb2.TokenChunk(token_ids=[5], text="hi"))
        usage = common_pb2.Usage(prompt_tokens=len(request.prompt_token_ids), completion_tokens=1,
                                 cached_prompt_tokens=FOUND)
        yield engine_pb2.GenerateResponse(final=engine_pb2.GenerateFinal(usage=usage))

    async def Release(self, request: engine_pb2.ReleaseRequest, context: Any) -> engine_pb2.ReleaseResponse:
        self.released.append(request.conversation)
        return engine_pb2.ReleaseResponse(blocks=12)


class LegacyWorker(engine_pb2_grpc.EngineServiceServicer):
    """A worker that predates Release: the generated base answers UNIMPLEMENTED."""


class RecordingSpan:
    """A recording span that keeps its attributes (what an exporter would receive)."""

    def __init__(self) -> None:
        self.attributes: dict[str, Any] = {}

    def is_recording(self) -> bool:
        return True

    def set_attributes(self, attributes: dict[str, Any]) -> None:
        self.attributes.update(attributes)

    def add_event(self, name: str, attributes: Any = None) -> None:
        pass

    def end(self) -> None:
        pass


async def serve(*servicers: Any) -> tuple[grpc.aio.Server, str]:
    server = grpc.aio.server()
    for servicer in servicers:
        if isinstance(servicer, router_pb2_grpc.RouterServiceServicer):
            router_pb2_grpc.add_RouterServiceServicer_to_server(servicer, server)
        else:
            engine_pb2_grpc.add_EngineServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, f"127.0.0.1:{port}"


def job(conversation: str, span: RecordingSpan) -> Job:
    spec = RequestSpec(list(range(80)), SamplingParams(max_tokens=1), "req-1", limit=1, conversation=conversation,
                       retention_s=60.0)
    return Job("m@v1", spec, Tenant("t"), trace=Trace(span))


def test_a_conversations_request_is_picked_with_it_and_its_expected_and_found_prefix_are_recorded():
    async def run() -> tuple[FakeRouter, Job, RecordingSpan, list[engine_pb2.GenerateResponse]]:
        router, worker = FakeRouter(), FakeWorker()
        server, address = await serve(router, worker)
        router.address = address
        channels = Channels(Plane.plaintext())
        span = RecordingSpan()
        request = job("conv-9f2", span)
        try:
            responses = [r async for r in Dispatcher([address], GatewayMetrics(), channels).generate(request)]
        finally:
            await channels.close()
            await server.stop(None)
        return router, request, span, responses

    router, request, span, responses = asyncio.run(run())
    assert [p.conversation for p in router.picks] == ["conv-9f2"]
    assert request.placement.replica == "r7" and request.placement.address == router.address
    assert request.placement.expected_cached_tokens == EXPECTED
    assert span.attributes["tokenfleet.prefix.expected_tokens"] == EXPECTED
    assert span.attributes["tokenfleet.prefix.found_tokens"] == FOUND
    assert responses[-1].final.usage.cached_prompt_tokens == FOUND


def test_every_turn_of_a_conversation_asks_the_same_router_first():
    dispatcher = Dispatcher(["a:1", "b:1", "c:1"], GatewayMetrics(), Channels(Plane.plaintext()))
    firsts = {dispatcher._first_router("conv-9f2") for _ in range(5)}
    assert len(firsts) == 1
    assert len({dispatcher._first_router(f"conv-{i}") for i in range(30)}) == 3  # conversations spread over them
    assert [dispatcher._first_router("") for _ in range(4)] == [0, 1, 2, 0]  # others take turns


def test_release_returns_the_workers_count_and_is_best_effort_when_it_cannot():
    async def run() -> tuple[list[int], list[str]]:
        worker = FakeWorker()
        server, address = await serve(worker)
        legacy, legacy_address = await serve(LegacyWorker())
        gone, gone_address = await serve(LegacyWorker())
        await gone.stop(None)  # nothing listens there any more
        channels = Channels(Plane.plaintext())
        dispatcher = Dispatcher(["router:1"], GatewayMetrics(), channels)
        try:
            counts = [await dispatcher.release(address, "conv-9f2"), await dispatcher.release(legacy_address, "conv-9f2"),
                      await dispatcher.release(gone_address, "conv-9f2"), await dispatcher.release(address, "")]
        finally:
            await channels.close()
            await server.stop(None)
            await legacy.stop(None)
        return counts, worker.released

    counts, released = asyncio.run(run())
    assert counts == [12, 0, 0, 0]
    assert released == ["conv-9f2"]  # no conversation: nothing asked


def test_a_request_without_a_conversation_picks_without_one():
    async def run() -> FakeRouter:
        router, worker = FakeRouter(), FakeWorker()
        server, address = await serve(router, worker)
        router.address = address
        channels = Channels(Plane.plaintext())
        try:
            [_ async for _ in Dispatcher([address], GatewayMetrics(), channels).generate(job("", RecordingSpan()))]
        finally:
            await channels.close()
            await server.stop(None)
        return router

    assert asyncio.run(run()).picks[0].conversation == ""


def test_the_expected_prefix_header_goes_with_the_replica_header_to_callers_who_see_placement():
    placement = Placement("r7", "h:7", expected_cached_tokens=EXPECTED)
    internal = _headers(Call("req-1", "/v1/chat/completions", Caller(Tenant("ops", internal=True)), placement))
    assert internal[REPLICA_HEADER] == "r7" and internal[PREFIX_EXPECTED_HEADER] == str(EXPECTED)
    customer = _headers(Call("req-1", "/v1/chat/completions", Caller(Tenant("acme")), placement))
    assert REPLICA_HEADER not in customer and PREFIX_EXPECTED_HEADER not in customer
    unplaced = _headers(Call("req-1", "/v1/chat/completions", Caller(Tenant("ops", internal=True))))
    assert PREFIX_EXPECTED_HEADER not in unplaced
