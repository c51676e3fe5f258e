"""Token buckets with reserve/settle: the arithmetic of per-tenant budgets (time passed in).

At admission a request reserves what it may use (prompt + max_tokens); when it ends it settles
to what it used and the rest goes back. A budget shared by several gateways is split into
shares (``scale``): each gateway enforces budget / live gateways, so the fleet admits at most
the budget plus one refill interval.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass
class TokenBucket:
    capacity: float  # tokens per minute (this gateway's share)
    tokens: float
    updated: float  # time of the last refill (seconds)

    @classmethod
    def full(cls, per_minute: float, now: float) -> TokenBucket:
        return cls(per_minute, per_minute, now)

    @property
    def rate(self) -> float:
        """Refill, tokens per second."""
        return self.capacity / 60.0

    def refill(self, now: float) -> None:
        if now > self.updated:
            self.tokens = min(self.capacity, self.tokens + (now - self.updated) * self.rate)
            self.updated = now

    def try_take(self, n: float, now: float) -> bool:
        self.refill(now)
        if n <= self.tokens:
            self.tokens -= n
            return True
        return False

    def give_back(self, n: float, now: float) -> None:
        self.refill(now)
        self.tokens = min(self.capacity, self.tokens + n)

    def wait_for(self, n: float, now: float) -> float:
        """Seconds until ``n`` tokens are there (inf if the bucket can never hold them)."""
        self.refill(now)
        if n > self.capacity:
            return math.inf
        return max(0.0, (n - self.tokens) / self.rate) if self.rate > 0 else math.inf

    def until_full(self, now: float) -> float:
        self.refill(now)
        return (self.capacity - self.tokens) / self.rate if self.rate > 0 else 0.0

    def rescale(self, capacity: float, now: float) -> None:
        """A new share (gateways joined or left): keep the same fill fraction."""
        self.refill(now)
        fraction = self.tokens / self.capacity if self.capacity else 1.0
        self.capacity, self.tokens = capacity, capacity * fraction


def concurrent_share(max_concurrent: int, share: float) -> int:
    """This gateway's part of a tenant's open-stream limit (0 = unlimited): split like the per-minute
    budgets, rounded down, at least one (so with more gateways than the limit, each still serves one)."""
    return max(1, int(max_concurrent * share + 1e-9)) if max_concurrent else 0


@dataclass(frozen=True)
class Limits:
    tokens_per_minute: int  # 0 = unlimited
    requests_per_minute: int
    max_concurrent: int


@dataclass
class Denied:
    reason: str
    retry_after: float | None  # seconds; None = never (the request is larger than the budget)


class TenantBudget:
    """One tenant's buckets and open-stream count on this gateway."""

    def __init__(self, limits: Limits, share: float, now: float):
        self.limits = limits
        self.share = share
        self.tokens = TokenBucket.full(limits.tokens_per_minute * share, now)
        self.requests = TokenBucket.full(limits.requests_per_minute * share, now)
        self.max_open = concurrent_share(limits.max_concurrent, share)
        self.open = 0

    def rescale(self, share: float, now: float) -> None:
        self.share = share
        self.tokens.rescale(self.limits.tokens_per_minute * share, now)
        self.requests.rescale(self.limits.requests_per_minute * share, now)
        self.max_open = concurrent_share(self.limits.max_concurrent, share)

    def precheck(self, now: float) -> Denied | None:
        """Would any request be refused now, whatever its size? Takes nothing: the gateway asks before
        it spends time preparing a request (templating, tokenizing), then ``admit`` decides."""
        lim = self.limits
        if self.max_open and self.open >= self.max_open:
            return Denied(self._open_reason(), 1.0)
        if lim.requests_per_minute and self.requests.wait_for(1, now) > 0:
            return Denied(f"over {lim.requests_per_minute} requests per minute", self.requests.wait_for(1, now))
        if lim.tokens_per_minute and self.tokens.wait_for(1, now) > 0:
            return Denied(f"over {lim.tokens_per_minute} tokens per minute", self.tokens.wait_for(1, now))
        return None

    def admit(self, reserve_tokens: int, now: float) -> Denied | None:
        """Reserve a request and its tokens, or say why not (nothing is taken then)."""
        lim = self.limits
        if self.max_open and self.open >= self.max_open:
            return Denied(self._open_reason(), 1.0)
        if lim.tokens_per_minute and reserve_tokens > self.tokens.capacity:
            return Denied(f"the request may use {reserve_tokens} tokens; this gateway's share of the tenant's "
                          f"budget is {self.tokens.capacity:.0f} per minute", None)
        if lim.requests_per_minute and not self.requests.try_take(1, now):
            return Denied(f"over {lim.requests_per_minute} requests per minute", self.requests.wait_for(1, now))
        if lim.tokens_per_minute and not self.tokens.try_take(reserve_tokens, now):
            if lim.requests_per_minute:
                self.requests.give_back(1, now)
            return Denied(f"over {lim.tokens_per_minute} tokens per minute (the request reserves {reserve_tokens})",
                          self.tokens.wait_for(reserve_tokens, now))
        self.open += 1
        return None

    def _open_reason(self) -> str:
        split = "" if self.max_open == self.limits.max_concurrent else f" ({self.max_open} on this gateway)"
        return f"{self.open} streams open; the tenant's limit is {self.limits.max_concurrent}{split}"

    def settle(self, reserved: int, used: int, now: float) -> None:
        """The request ended having used ``used`` tokens: the rest of its reservation goes back."""
        self.open = max(0, self.open - 1)
        if self.limits.tokens_per_minute and reserved > used:
            self.tokens.give_back(reserved - used, now)

    def cancel(self, reserved: int, now: float) -> None:
        """The request never ran (a batch line that found no spare capacity): its request and every token back."""
        self.open = max(0, self.open - 1)
        if self.limits.requests_per_minute:
            self.requests.give_back(1, now)
        if self.limits.tokens_per_minute:
            self.tokens.give_back(reserved, now)

    def headers(self, now: float) -> dict[str, str]:
        lim, out = self.limits, {}
        for name, limit, bucket in (("tokens", lim.tokens_per_minute, self.tokens),
                                    ("requests", lim.requests_per_minute, self.requests)):
            if limit:
                bucket.refill(now)
                out[f"x-ratelimit-limit-{name}"] = str(limit)
                out[f"x-ratelimit-remaining-{name}"] = str(int(bucket.tokens))
                out[f"x-ratelimit-reset-{name}"] = duration(bucket.until_full(now))
        return out


def duration(seconds: float) -> str:
    """OpenAI's reset format: '1m2.5s', '350ms', '0s'."""
    if seconds < 1:
        return f"{int(seconds * 1000)}ms"
    minutes, rest = divmod(seconds, 60)
    return f"{int(minutes)}m{rest:.1f}s" if minutes else f"{rest:.1f}s"
