"""Who is calling and what they may spend: API-key authentication, per-tenant budgets with
reserve/settle, and the usage ledger, as one ``Admission`` the gateway consults per request.

Auth off (no directory): every caller is the anonymous tenant, unlimited. Budgets are this
gateway's share of each tenant's per-minute budget (``share()``: 1 / live gateways).
"""

from __future__ import annotations

import math
import sqlite3
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import structlog

from tokenfleet.api.openai_schema import APIError
from tokenfleet.tenancy.ledger import Ledger, UsageRecord
from tokenfleet.tenancy.ratelimit import Denied, Limits, TenantBudget
from tokenfleet.tenancy.tenants import AuthError, Directory, Tenant

log = structlog.get_logger()
ANONYMOUS = Tenant("anonymous", max_concurrent=0)  # auth off: one trust domain, no limits


@dataclass(frozen=True)
class Caller:
    tenant: Tenant
    key_id: str = ""

    @property
    def sees_placement(self) -> bool:
        """May learn which replica served it: an internal tenant, or everyone when auth is off
        (one trust domain). Other tenants could use it to probe each other's traffic."""
        return self.tenant.internal or self.tenant == ANONYMOUS


ANONYMOUS_CALLER = Caller(ANONYMOUS)


@dataclass
class Ticket:
    """An admitted request: what it reserved, to be settled exactly once."""

    admission: Admission
    caller: Caller
    model: str
    endpoint: str
    request_id: str
    prompt_tokens: int
    reserved: int
    started: float = field(default_factory=time.time)
    settled: bool = False
    requested_model: str = ""  # what the client asked for, when a routing alias chose ``model`` (ledger column)
    # a batch line: ``finish`` keeps the record here instead of writing it; the batch runner writes it together
    # with the line's result (one transaction, exactly once)
    defer: bool = False
    record: UsageRecord | None = None

    def release(self) -> None:
        """The request never ran (a batch line placed nowhere): no record, and its reservation all back."""
        if self.settled:
            return
        self.settled = True
        self.admission.cancel(self.caller, self.reserved)

    async def finish(self, status: str, prompt: int, cached: int, completion: int, ttft_ms: float | None,
                     durable: bool = True, detail: str = "") -> None:
        """Settle the budget to what was used and write the ledger record (awaited when ``durable``)."""
        if self.settled:
            return
        self.settled = True
        now = time.time()
        self.admission.settle(self.caller, self.reserved, prompt + completion)
        record = UsageRecord(self.request_id, self.caller.tenant.name, self.model, self.endpoint, status,
                             self.caller.key_id, prompt, cached, completion, ttft_ms, 1000 * (now - self.started),
                             self.started, now, detail, self.requested_model)
        if self.defer:
            self.record = record
            return
        if self.admission.ledger is None:
            return
        if durable:
            try:
                await self.admission.ledger.write(record)
            except sqlite3.Error as e:  # a full disk: the result is withheld (it could not be billed), clearly
                raise ledger_unavailable(str(e)) from e
        else:
            self.admission.ledger.submit(record)


LEDGER_RETRY_S = 2.0  # after a failed ledger commit, new requests are refused this long before one is tried again


def ledger_unavailable(reason: str) -> APIError:
    return APIError(503, f"usage cannot be recorded now ({reason}); the request was not billed, and a result not "
                    "billed is not returned", "server_error", code="ledger_unavailable",
                    headers={"retry-after": str(math.ceil(LEDGER_RETRY_S))})


class Admission:
    def __init__(self, directory: Directory | None = None, ledger: Ledger | None = None,
                 share: Callable[[], float | None] = lambda: 1.0, clock: Callable[[], float] = time.monotonic):
        self.directory = directory
        self.ledger = ledger
        self.share = share
        self.clock = clock
        self.budgets: dict[str, TenantBudget] = {}

    def authenticate(self, authorization: str | None, peer: str = "") -> Caller:
        """The caller of a request; 401 for a missing, unknown or revoked key, logged with the client's
        address (``peer``) and the key id it claimed, never the key."""
        if self.directory is None:
            return Caller(ANONYMOUS)
        key = authorization.removeprefix("Bearer ").strip() if authorization else None
        try:
            tenant, record = self.directory.authenticate(key)
        except AuthError as e:
            log.warning("authentication failed", peer=peer, reason=str(e))
            raise APIError(401, str(e), code="invalid_api_key") from e
        return Caller(tenant, record.key_id)

    def budget(self, tenant: Tenant) -> TenantBudget:
        """The tenant's budget on this gateway; 503 for a tenant with limits while this gateway does not
        know how many gateways share them (fails closed: never N gateways each granting the whole)."""
        limits = Limits(tenant.tokens_per_minute, tenant.requests_per_minute, tenant.max_concurrent)
        budget = self.budgets.get(tenant.name)
        now, share = self.clock(), self.share()
        if share is None:
            if limits == Limits(0, 0, 0):
                share = 1.0  # nothing to split
            else:
                raise APIError(503, "budgets are unavailable: this gateway cannot reach the cluster's gateway "
                               "membership to know its share", "server_error", code="budget_unavailable",
                               headers={"retry-after": "2"})
        if budget is None or budget.limits != limits:  # new tenant, or its limits were edited
            budget = self.budgets[tenant.name] = TenantBudget(limits, share, now)
        elif budget.share != share:  # gateways joined or left
            budget.rescale(share, now)
        return budget

    def precheck(self, caller: Caller, request_id: str, endpoint: str, headers: dict[str, str] | None = None) -> None:
        """The cheap refusal before a request is prepared: 429 when the tenant could not be admitted
        now whatever the request (streams at its limit, request or token bucket empty); 503 while the ledger
        cannot be written (its last commit failed less than LEDGER_RETRY_S ago): a result that could not be
        billed would be withheld, so the request is not run."""
        if self.ledger is not None and self.ledger.failing(LEDGER_RETRY_S):
            raise ledger_unavailable(self.ledger.last_error)
        budget = self.budget(caller.tenant)
        now = self.clock()
        denied = budget.precheck(now)
        if denied is not None:  # the transport records the refusal (``refused``), as for any other before admission
            self._deny(caller, budget, denied, now, request_id, "", endpoint, 0, headers, record=False)

    def _deny(self, caller: Caller, budget: TenantBudget, denied: Denied, now: float, request_id: str, model: str,
              endpoint: str, prompt_tokens: int, headers: dict[str, str] | None, record: bool = True) -> None:
        """Refuse with 429: the rate-limit headers, a `rejected` ledger record, a log line."""
        tenant = caller.tenant
        state = budget.headers(now)
        if headers is not None:
            headers.update(state)
        if denied.retry_after is not None:
            state["retry-after"] = str(max(1, math.ceil(denied.retry_after)))
        if self.ledger is not None and record:
            wall = time.time()
            self.ledger.submit(UsageRecord(request_id, tenant.name, model, endpoint, "rejected", caller.key_id,
                                           prompt_tokens, started_at=wall, finished_at=wall, detail=denied.reason))
        log.info("rate limited", tenant=tenant.name, key_id=caller.key_id, reason=denied.reason)
        raise APIError(429, f"Rate limit reached for tenant {tenant.name!r}: {denied.reason}.", "requests",
                       code="rate_limit_exceeded", headers=state)

    def admit(self, caller: Caller, model: str, endpoint: str, request_id: str, prompt_tokens: int,
              reserve: int, headers: dict[str, str] | None = None, defer: bool = False) -> Ticket:
        """Reserve the request's tokens; APIError 403 (model not allowed) or 429 (over budget).
        ``headers`` receives the tenant's rate-limit state for the response. ``defer`` (a batch line): no
        ledger record here, neither for a refusal nor at the end (the ticket keeps it: ``Ticket.defer``)."""
        tenant = caller.tenant
        if not tenant.allows(model):
            if not defer:
                self.refused(caller, request_id, endpoint, 403, model)
            raise APIError(403, f"Tenant {tenant.name!r} may not use the model `{model}`.", param="model",
                           code="model_not_allowed")
        budget = self.budget(tenant)
        now = self.clock()
        denied = budget.admit(reserve, now)
        if denied is not None:
            self._deny(caller, budget, denied, now, request_id, model, endpoint, prompt_tokens, headers, not defer)
        if headers is not None:
            headers.update(budget.headers(now))
        return Ticket(self, caller, model, endpoint, request_id, prompt_tokens, reserve, defer=defer)

    def refused(self, caller: Caller, request_id: str, endpoint: str, status: int, model: str = "") -> None:
        """A request refused before admission (bad body, unknown model): a `rejected` ledger record."""
        if self.ledger is not None:
            now = time.time()
            self.ledger.submit(UsageRecord(request_id, caller.tenant.name, model, endpoint, "rejected", caller.key_id,
                                           started_at=now, finished_at=now, detail=f"HTTP {status}"))

    def cancel(self, caller: Caller, reserved: int) -> None:
        budget = self.budgets.get(caller.tenant.name)
        if budget is not None:
            budget.cancel(reserved, self.clock())

    def settle(self, caller: Caller, reserved: int, used: int) -> None:
        budget = self.budgets.get(caller.tenant.name)
        if budget is not None:
            budget.settle(reserved, used, self.clock())
