"""Prefix-cache isolation: requests hit only blocks cached in their own scope (tokenfleet.kvcache.salt)."""

from __future__ import annotations

from tests.conftest import make_request, make_scheduler
from tests.unit.engine.test_scheduler import run_step
from tokenfleet.kvcache.block_hash import hash_blocks
from tokenfleet.kvcache.salt import chain_salt, request_scope


def test_scopes_are_digests_that_differ_by_group_salt_and_adapter():
    assert request_scope("") == ""  # nothing to separate: one shared cache (a single-tenant cluster)
    scopes = {request_scope("acme"), request_scope("acme", "user-1"), request_scope("acme", adapter="sql-lora"),
              request_scope("other"), request_scope("", "user-1")}
    assert len(scopes) == 5 and all(len(s) == 32 and s.isalnum() for s in scopes)
    assert request_scope("acme", "user-1") == request_scope("acme", "user-1")  # gateways, routers and workers agree
    assert request_scope("a\x00b") != request_scope("a", "b")
    assert chain_salt("m", "") == "m" and chain_salt("m", "s") != chain_salt("m", "t")
    prompt = list(range(32))
    assert hash_blocks(prompt, 16, chain_salt("m", "s")) != hash_blocks(prompt, 16, chain_salt("m", "t"))


def _hits(scheduler, request_id: str, prompt: list[int], scope: str) -> int:
    """Run a one-token request in ``scope``; the prompt tokens it found cached."""
    request = make_request(prompt_token_ids=prompt, max_tokens=1, request_id=request_id)
    request.cache_scope = scope
    scheduler.add_request(request)
    run_step(scheduler)
    return request.num_cached_tokens


def test_a_request_hits_only_its_own_scope():
    scheduler = make_scheduler(num_blocks=64, block_size=4)
    prompt = list(range(100, 124))
    alpha, beta = request_scope("alpha"), request_scope("beta")
    assert _hits(scheduler, "a1", prompt, alpha) == 0
    assert _hits(scheduler, "b1", prompt, beta) == 0  # alpha's blocks are cached, but not for beta
    assert _hits(scheduler, "a2", prompt, alpha) == 20  # its own: 5 of 6 blocks (the last token is computed)
    assert _hits(scheduler, "b2", prompt, beta) == 20
    assert _hits(scheduler, "n1", prompt, "") == 0  # unscoped requests share only among themselves
