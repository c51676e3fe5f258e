"""Budgets split between gateways fail closed while the split is unknown, and open streams are split too."""

from __future__ import annotations

import pytest

from tokenfleet.api.openai_schema import APIError
from tokenfleet.tenancy.admission import ANONYMOUS, Admission, Caller
from tokenfleet.tenancy.ratelimit import Limits, TenantBudget, concurrent_share
from tokenfleet.tenancy.tenants import DEFAULT_MAX_CONCURRENT, Tenant


def test_unknown_membership_refuses_limited_tenants_and_serves_unlimited_ones():
    share: list[float | None] = [None]
    admission = Admission(share=lambda: share[0])
    limited = Caller(Tenant("acme", tokens_per_minute=1000))
    with pytest.raises(APIError) as closed:
        admission.admit(limited, "m", "/v1/completions", "r1", 5, 10)
    assert closed.value.status == 503 and closed.value.code == "budget_unavailable" and closed.value.headers
    with pytest.raises(APIError):
        admission.precheck(limited, "r1", "/v1/completions")
    unlimited = Caller(Tenant("free", max_concurrent=0))
    admission.admit(unlimited, "m", "/v1/completions", "r2", 5, 10)  # nothing to split: served
    admission.admit(Caller(ANONYMOUS), "m", "/v1/completions", "r3", 5, 10)
    share[0] = 0.5  # membership known: two gateways
    admission.admit(limited, "m", "/v1/completions", "r4", 5, 10)
    assert admission.budget(limited.tenant).tokens.capacity == 500


def test_open_streams_are_split_between_gateways():
    assert concurrent_share(0, 0.25) == 0  # unlimited stays unlimited
    assert concurrent_share(8, 0.5) == 4 and concurrent_share(8, 1 / 3) == 2 and concurrent_share(2, 1 / 3) == 1
    budget = TenantBudget(Limits(0, 0, 4), share=0.5, now=0.0)
    assert budget.admit(1, 0.0) is None and budget.admit(1, 0.0) is None
    refused = budget.admit(1, 0.0)
    assert refused is not None and "limit is 4 (2 on this gateway)" in refused.reason
    budget.rescale(1.0, 0.0)  # the other gateway left: all of it here
    assert budget.admit(1, 0.0) is None


def test_new_tenants_have_a_concurrency_limit_unless_they_say_unlimited():
    assert Tenant("new").max_concurrent == DEFAULT_MAX_CONCURRENT > 0
    assert Tenant.from_dict({"name": "old", "max_concurrent": 0}).max_concurrent == 0
    assert ANONYMOUS.max_concurrent == 0
