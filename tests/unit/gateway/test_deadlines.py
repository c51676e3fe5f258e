"""The client's deadline (its timeout header) bounds how long a request waits, and every 503 says when to retry."""

from __future__ import annotations

import pytest
from tokenfleet.services.gateway.dispatch import Dispatcher, Job
from tokenfleet.services.gateway.pipeline import DEFAULT_DEADLINE_S, MAX_DEADLINE_S, client_deadline

from tokenfleet.api.openai_schema import APIError
from tokenfleet.engine.request_spec import RequestSpec
from tokenfleet.engine.sampling_params import SamplingParams
from tokenfleet.security.plane import Channels, Plane
from tokenfleet.telemetry.metrics import GatewayMetrics
from tokenfleet.tenancy.tenants import Tenant


@pytest.mark.parametrize(("headers", "seconds"), [
    ({}, DEFAULT_DEADLINE_S),
    ({"x-stainless-read-timeout": "120.0"}, 120.0),  # what the official openai client sends
    ({"x-request-timeout": "30", "x-stainless-read-timeout": "120"}, 30.0),  # ours first
    ({"x-request-timeout": "soon"}, DEFAULT_DEADLINE_S),  # not a number: ignored
    ({"x-request-timeout": "-5"}, DEFAULT_DEADLINE_S),
    ({"x-request-timeout": "inf"}, DEFAULT_DEADLINE_S),
    ({"x-request-timeout": "1e9"}, MAX_DEADLINE_S),
])
def test_the_deadline_comes_from_the_clients_timeout_header(headers, seconds):
    assert client_deadline(headers, now=100.0) == pytest.approx(100.0 + seconds)


def _job(tier: str = "interactive", deadline: float | None = None) -> Job:
    return Job("m@v1", RequestSpec([1, 2], SamplingParams(max_tokens=4), "r", limit=4), Tenant("t", tier=tier),
               deadline=deadline)


def test_the_first_token_budget_is_the_least_of_the_operators_objective_and_the_clients_deadline(monkeypatch):
    monkeypatch.setattr("tokenfleet.services.gateway.dispatch.time.monotonic", lambda: 1000.0)
    dispatcher = Dispatcher(["router:1"], GatewayMetrics(), Channels(Plane.plaintext()))
    assert dispatcher.first_token_budget(_job()) is None  # no objective set, no deadline: the worker never refuses
    assert dispatcher.first_token_budget(_job(deadline=1600.0)) == pytest.approx(600.0)
    assert dispatcher.first_token_budget(_job(deadline=990.0)) == pytest.approx(0.001)  # already past: refuse
    dispatcher.ttft_objectives = {"interactive": 2.0}
    assert dispatcher.first_token_budget(_job(deadline=1600.0)) == 2.0
    assert dispatcher.first_token_budget(_job(deadline=1001.0)) == pytest.approx(1.0)
    assert dispatcher.first_token_budget(_job("batch", deadline=1600.0)) == pytest.approx(600.0)


def test_every_503_carries_retry_after_and_header_names_are_lowercase():
    assert APIError(503, "no replica available", "server_error").headers == {"retry-after": "1"}
    assert APIError(503, "x", headers={"Retry-After": "7"}).headers == {"retry-after": "7"}
    assert "retry-after" not in APIError(400, "bad").headers
    # a 429 for a request larger than the budget could ever admit has none on purpose: it never will be
    assert APIError(429, "too large", headers={"x-ratelimit-limit-tokens": "10"}).headers == {
        "x-ratelimit-limit-tokens": "10"}
