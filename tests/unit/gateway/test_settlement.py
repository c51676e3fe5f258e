"""A stream left at any point settles its budget reservation exactly once: after the first event (the
role chunk), before it was read at all, and after a complete run (a no-op then)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from tokenfleet.services.gateway.pipeline import Gateway, Prepared, Run

from tokenfleet.engine.request_spec import RequestSpec
from tokenfleet.engine.sampling_params import SamplingParams
from tokenfleet.telemetry.metrics import RequestTimer
from tokenfleet.tenancy.admission import Admission, Caller
from tokenfleet.tenancy.tenants import Tenant
from tokenfleet.v1 import engine_pb2


def _run(admission: Admission, closed: list[bool]) -> Run:
    caller = Caller(Tenant("t", max_concurrent=1))
    ticket = admission.admit(caller, "m", "/v1/chat/completions", "r", 3, 13)
    model = SimpleNamespace(name="m", ref="m@v1", tokenizer=SimpleNamespace(decode=lambda ids, **_: "x"), tool_format="")
    prepared = Prepared(model, RequestSpec([1, 2, 3], SamplingParams(max_tokens=10), "chatcmpl-1"), False)  # type: ignore[arg-type]

    async def stream():  # the worker's stream (its first response taken by open()): never ends by itself
        try:
            yield engine_pb2.GenerateResponse(chunk=engine_pb2.TokenChunk(token_ids=[5], text="x"))
            while True:
                await asyncio.sleep(0.01)
                yield engine_pb2.GenerateResponse(chunk=engine_pb2.TokenChunk(token_ids=[7], text="x"))
        finally:
            closed.append(True)

    return Run(prepared, engine_pb2.GenerateResponse(), stream(), ticket)  # first: set once started


def test_leaving_after_the_role_chunk_settles_the_reservation():
    async def scenario() -> tuple[int, bool, list[bool]]:
        admission, closed = Admission(), []
        run = _run(admission, closed)
        gateway = Gateway(["unused:1"], models=None)  # type: ignore[arg-type]
        run.first = await anext(run.stream)  # as Gateway.open does
        events = gateway.events(run, RequestTimer(gateway.metrics))
        await anext(events)  # Opened: the role chunk, before any token
        await events.aclose()  # the client went away
        # counted once per model version, as what it was (rollouts compare versions on these)
        assert gateway.metrics.version_requests.labels("m@v1", "cancelled")._value.get() == 1
        return admission.budgets["t"].open, run.ticket.settled, closed

    still_open, settled, closed = asyncio.run(scenario())
    assert settled and still_open == 0 and closed == [True]


def test_a_stream_never_read_is_settled_by_abandon():
    async def scenario() -> tuple[int, bool, list[bool]]:
        admission, closed = Admission(), []
        run = _run(admission, closed)
        run.first = await anext(run.stream)  # placed and answered; the HTTP layer never iterated the events
        await run.abandon()
        await run.abandon()  # twice: still one settlement
        return admission.budgets["t"].open, run.ticket.settled, closed

    still_open, settled, closed = asyncio.run(scenario())
    assert settled and still_open == 0 and closed == [True]


def test_abandon_after_a_complete_run_changes_nothing():
    async def scenario() -> str:
        admission = Admission()
        run = _run(admission, [])
        await run.ticket.finish("ok", 3, 0, 10, 5.0, durable=False)
        await run.abandon()
        return "ok" if admission.budgets["t"].open == 0 else "double"

    assert asyncio.run(scenario()) == "ok"

