"""The edge's bounds: what one request may carry (each a 400 naming the limit), the preparation pool's
queue, and the cheap budget check made before any preparation."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
from tokenfleet.services.gateway.preparer import Preparer

from tokenfleet.api.openai_schema import (
    MAX_LOGIT_BIAS,
    MAX_MESSAGES,
    MAX_TOOLS,
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
)
from tokenfleet.engine.grammar import MAX_SPEC_CHARS, GrammarError, Guided
from tokenfleet.tenancy.admission import Admission, Caller
from tokenfleet.tenancy.ratelimit import Limits, TenantBudget
from tokenfleet.tenancy.tenants import Tenant


def _chat(**fields) -> ChatCompletionRequest:  # type: ignore[no-untyped-def]
    return ChatCompletionRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": "hi"}],
                                                 **fields})


def test_request_sizes_are_capped_with_a_400_that_names_the_limit():
    with pytest.raises(APIError) as bias:
        _chat(logit_bias={str(i): 1.0 for i in range(MAX_LOGIT_BIAS + 1)}).sampling_params()
    assert bias.value.status == 400 and str(MAX_LOGIT_BIAS) in bias.value.message and bias.value.param == "logit_bias"
    _chat(logit_bias={str(i): 1.0 for i in range(MAX_LOGIT_BIAS)}).sampling_params()  # at the limit: fine
    with pytest.raises(APIError) as messages:
        _chat(messages=[{"role": "user", "content": "hi"}] * (MAX_MESSAGES + 1)).sampling_params()
    assert messages.value.status == 400 and str(MAX_MESSAGES) in messages.value.message
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    with pytest.raises(APIError) as tools:
        _chat(tools=[tool] * (MAX_TOOLS + 1)).sampling_params()
    assert tools.value.status == 400 and str(MAX_TOOLS) in tools.value.message and tools.value.param == "tools"
    completion = CompletionRequest.model_validate({"model": "m", "prompt": "x", "logit_bias": {
        str(i): 0.5 for i in range(MAX_LOGIT_BIAS + 1)}})
    with pytest.raises(APIError):
        completion.sampling_params()
    with pytest.raises(GrammarError, match=str(MAX_SPEC_CHARS)):
        Guided("regex", "a" * (MAX_SPEC_CHARS + 1))


def test_the_preparer_runs_off_the_loop_queues_a_burst_and_refuses_past_its_queue_or_deadline():
    async def scenario() -> tuple[int, int, list[int], APIError, APIError]:
        preparer = Preparer(threads=1, max_queued=3)
        release = threading.Event()
        loop_thread = threading.get_ident()
        blocked = asyncio.ensure_future(preparer.run(release.wait, 30))
        await asyncio.sleep(0.05)
        # a burst behind a busy thread waits its turn (not refused) ...
        queued = [asyncio.ensure_future(preparer.run(lambda i=i: i)) for i in range(2)]
        await asyncio.sleep(0.05)
        assert not any(q.done() for q in queued)
        with pytest.raises(APIError) as full:  # ... up to max_queued
            await preparer.run(threading.get_ident)
        release.set()
        await blocked
        done = list(await asyncio.gather(*queued))
        release.clear()
        blocked = asyncio.ensure_future(preparer.run(release.wait, 30))
        await asyncio.sleep(0.05)
        with pytest.raises(APIError) as late:  # one still waiting at its deadline is refused
            await preparer.run(threading.get_ident, deadline=time.monotonic() + 0.1)
        release.set()
        await blocked
        ran_on = await preparer.run(threading.get_ident)
        assert preparer.pending == 0
        preparer.shutdown()
        return loop_thread, ran_on, done, full.value, late.value

    loop_thread, ran_on, done, full, late = asyncio.run(scenario())
    assert ran_on != loop_thread and done == [0, 1]
    for refused in (full, late):
        assert refused.status == 503 and refused.headers == {"retry-after": "1"} and refused.code == "overloaded"
    assert "deadline" in late.message and "waiting" in full.message


def test_the_precheck_refuses_before_preparation_and_takes_nothing():
    now = [0.0]
    tenant = Tenant("t", requests_per_minute=2, max_concurrent=1)
    admission = Admission(clock=lambda: now[0])
    caller = Caller(tenant, "k")
    admission.precheck(caller, "r0", "/v1/completions")  # a full bucket: passes, takes nothing
    budget = admission.budget(tenant)
    assert budget.requests.tokens == 2 and budget.open == 0
    ticket = admission.admit(caller, "m", "/v1/completions", "r1", 5, 10)
    headers: dict[str, str] = {}
    with pytest.raises(APIError) as full:  # one stream open: the concurrency limit
        admission.precheck(caller, "r2", "/v1/completions", headers)
    assert full.value.status == 429 and "streams open" in full.value.message and "retry-after" in full.value.headers
    asyncio.run(ticket.finish("ok", 5, 0, 1, None, durable=False))
    asyncio.run(admission.admit(caller, "m", "/v1/completions", "r3", 5, 10).finish("ok", 5, 0, 1, None,
                                                                                      durable=False))
    with pytest.raises(APIError) as empty:  # two requests this minute: the request bucket is empty
        admission.precheck(caller, "r4", "/v1/completions")
    assert "requests per minute" in empty.value.message
    now[0] = 31.0  # half a minute: one request back
    admission.precheck(caller, "r5", "/v1/completions")


def test_budget_precheck_ignores_request_size():
    budget = TenantBudget(Limits(100, 0, 0), 1.0, 0.0)
    assert budget.precheck(0.0) is None  # a 1000-token request is admit()'s to refuse, not the precheck's
    assert budget.admit(1000, 0.0) is not None


def test_worker_failures_reach_clients_without_internal_details():
    import grpc
    from tokenfleet.services.gateway.dispatch import status_error

    def failure(code: grpc.StatusCode, details: str) -> APIError:
        return status_error(grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details))

    internal = failure(grpc.StatusCode.INTERNAL, "engine failure: RuntimeError at /srv/worker.py:12 (10.0.0.7:50061)")
    assert internal.status == 500 and "10.0.0.7" not in internal.message and "RuntimeError" not in internal.message
    gone = failure(grpc.StatusCode.UNAVAILABLE, "failed to connect to all addresses; ipv4:10.0.0.7:50061")
    assert gone.status == 503 and "10.0.0.7" not in gone.message
    bad = failure(grpc.StatusCode.INVALID_ARGUMENT, "logit_bias token ids out of range")
    assert bad.status == 400 and "logit_bias" in bad.message  # the caller's own mistake: said as it is
