"""The waiting queue: strict priority classes, and token-weighted fair queuing between tenants
within a class (virtual token counters, after VTC: Sheng et al., "Fairness in Serving Large
Language Models", OSDI 2024). Pure Python, no clock.

Each tenant has a counter of the service it received: ``prompt_weight`` per prompt token
computed and ``output_weight`` per generated token (charged by the scheduler as it serves).
Within a priority class the next request is the oldest of the tenant with the smallest
counter, so a tenant flooding requests advances its own counter and everyone else's
occasional requests go ahead of its backlog; it is still served whenever its counter is the
smallest. A tenant that becomes active again is lifted to the smallest counter of the active
tenants (idle time earns no credit). Preempted requests (already admitted once) go first in
their class, oldest first. With ``enabled`` False the order is plain (priority, arrival).
"""

from __future__ import annotations

import bisect
from collections.abc import Iterator
from dataclasses import dataclass, field

from tokenfleet.engine.request import Request


@dataclass
class FairQueue:
    enabled: bool = True
    prompt_weight: float = 1.0
    output_weight: float = 2.0
    counters: dict[str, float] = field(default_factory=dict)
    _queues: dict[tuple[int, str], list[tuple[tuple, Request]]] = field(default_factory=dict)
    _resumed: list[tuple[tuple, Request]] = field(default_factory=list)  # preempted, by key
    _size: int = 0

    # ---- queue ---------------------------------------------------------------------------------
    def push(self, request: Request, key: tuple, resumed: bool = False) -> None:
        """Queue a request; ``key`` = (priority, arrival, seq). ``resumed``: it was admitted before."""
        tenant = self._tenant(request)
        if resumed:
            bisect.insort(self._resumed, (key, request), key=lambda item: item[0])
        else:
            bisect.insort(self._queues.setdefault((key[0], tenant), []), (key, request), key=lambda item: item[0])
        self._size += 1

    def peek(self) -> Request | None:
        """The request to admit next (not removed)."""
        heads = [queue[0] for queue in self._queues.values() if queue]
        if self._resumed:
            heads.append(self._resumed[0])
        if not heads:
            return None
        best_class = min(key[0] for key, _ in heads)
        resumed = [r for k, r in self._resumed[:1] if k[0] == best_class]
        if resumed:
            return resumed[0]
        candidates = [(key, r) for key, r in heads if key[0] == best_class]
        if not self.enabled:
            return min(candidates, key=lambda item: item[0])[1]
        return min(candidates, key=lambda item: (self.counters.get(self._tenant(item[1]), 0.0), item[0]))[1]

    def remove(self, request: Request) -> bool:
        for queue in [self._resumed, *self._queues.values()]:
            for i, (_, r) in enumerate(queue):
                if r is request:
                    del queue[i]
                    self._size -= 1
                    return True
        return False

    def __len__(self) -> int:
        return self._size

    def __bool__(self) -> bool:
        return self._size > 0

    def __iter__(self) -> Iterator[tuple[tuple, Request]]:
        """Every waiting (key, request), by key (not the service order)."""
        items = list(self._resumed) + [item for queue in self._queues.values() for item in queue]
        return iter(sorted(items, key=lambda item: item[0]))

    # ---- counters -------------------------------------------------------------------------------
    def activate(self, tenant: str, active: set[str]) -> None:
        """``tenant`` gets a request while it had none: lift it to the smallest active counter."""
        others = [self.counters.get(t, 0.0) for t in active if t != tenant]
        if others:
            self.counters[tenant] = max(self.counters.get(tenant, 0.0), min(others))

    def charge(self, tenant: str, prompt_tokens: int = 0, output_tokens: int = 0) -> None:
        self.counters[tenant] = (self.counters.get(tenant, 0.0) + self.prompt_weight * prompt_tokens
                                 + self.output_weight * output_tokens)

    def forget_idle(self, active: set[str]) -> None:
        """Drop counters of tenants with nothing queued or running (they are lifted on return anyway)."""
        if len(self.counters) > 4 * max(1, len(active)) + 64:
            self.counters = {t: c for t, c in self.counters.items() if t in active}

    @staticmethod
    def _tenant(request: Request) -> str:
        return request.tenant
