"""Token buckets with reserve/settle and shares (time passed in)."""

from __future__ import annotations

import math

import pytest

from tokenfleet.tenancy.ratelimit import Limits, TenantBudget, TokenBucket, duration


def test_bucket_refills_at_its_rate_up_to_capacity():
    b = TokenBucket.full(600, now=0.0)  # 10 tokens/s
    assert b.try_take(600, 0.0) and not b.try_take(1, 0.0)
    assert b.wait_for(50, 0.0) == pytest.approx(5.0)
    assert not b.try_take(50, 4.9) and b.try_take(50, 5.0)
    b.refill(1000.0)
    assert b.tokens == 600
    assert b.wait_for(601, 1000.0) == math.inf


def test_reserve_then_settle_refunds_what_was_not_used():
    budget = TenantBudget(Limits(tokens_per_minute=1000, requests_per_minute=0, max_concurrent=0), 1.0, 0.0)
    assert budget.admit(600, 0.0) is None
    denied = budget.admit(600, 0.0)
    assert denied is not None and "1000 tokens per minute" in denied.reason
    assert denied.retry_after == pytest.approx((600 - 400) / (1000 / 60))
    budget.settle(600, 150, 0.0)  # used 150 of 600: 450 back
    assert budget.tokens.tokens == pytest.approx(850) and budget.open == 0
    assert budget.admit(800, 0.0) is None


def test_request_larger_than_the_share_is_never_admitted():
    budget = TenantBudget(Limits(1000, 0, 0), share=0.5, now=0.0)
    denied = budget.admit(600, 0.0)
    assert denied is not None and denied.retry_after is None and "500 per minute" in denied.reason


def test_requests_per_minute_and_concurrency_limits():
    budget = TenantBudget(Limits(0, 2, 0), 1.0, 0.0)
    assert budget.admit(10, 0.0) is None and budget.admit(10, 0.0) is None
    denied = budget.admit(10, 0.0)
    assert denied is not None and denied.retry_after == pytest.approx(30.0)
    streams = TenantBudget(Limits(0, 0, 1), 1.0, 0.0)
    assert streams.admit(1, 0.0) is None and streams.admit(1, 0.0) is not None
    streams.settle(1, 1, 0.0)
    assert streams.admit(1, 0.0) is None


def test_a_token_denial_does_not_consume_a_request():
    budget = TenantBudget(Limits(100, 10, 0), 1.0, 0.0)
    assert budget.admit(100, 0.0) is None
    assert budget.admit(50, 0.0) is not None
    assert budget.requests.tokens == pytest.approx(9)


def test_shares_rescale_keeping_the_fill_fraction_and_headers():
    budget = TenantBudget(Limits(1200, 60, 0), share=1.0, now=0.0)
    assert budget.admit(600, 0.0) is None
    budget.rescale(0.5, 0.0)
    assert budget.tokens.capacity == 600 and budget.tokens.tokens == pytest.approx(300)
    headers = budget.headers(0.0)
    assert headers["x-ratelimit-limit-tokens"] == "1200" and headers["x-ratelimit-remaining-tokens"] == "300"
    assert headers["x-ratelimit-reset-tokens"] == "30.0s" and headers["x-ratelimit-limit-requests"] == "60"
    assert duration(0.25) == "250ms" and duration(75) == "1m15.0s"


def test_a_request_that_never_ran_gives_its_whole_reservation_back():
    budget = TenantBudget(Limits(tokens_per_minute=1000, requests_per_minute=2, max_concurrent=0), 1.0, 0.0)
    for _ in range(5):  # a batch line refused for want of spare capacity, again and again: nothing spent
        assert budget.admit(600, 0.0) is None
        budget.cancel(600, 0.0)
    assert budget.admit(600, 0.0) is None and budget.open == 1
    budget.settle(600, 600, 0.0)  # one that ran: its tokens are spent
    assert budget.admit(600, 0.0) is not None
