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
    # (priority, tenant) -> its never-admitted requests by key; only non-empty lists are kept
    _queues: dict[tuple[int, str], list[tuple[tuple, Request]]] = field(default_factory=dict)
    _resumed: list[tuple[tuple, Request]] = field(default_factory=list)  # preempted, by key
    _where: dict[str, list[tuple[tuple, Request]]] = field(default_factory=dict)  # request id -> its list

    # ---- queue ---------------------------------------------------------------------------------
    def push(self, request: Request, key: tuple, resumed: bool = False) -> None:
        """Queue a request; ``key`` = (priority, arrival, seq). ``resumed``: it was admitted before."""
        if request.request_id in self._where:
            raise ValueError(f"{request.request_id!r} is already waiting")
        queue = self._resumed if resumed else self._queues.setdefault((key[0], self._tenant(request)), [])
        if not queue or queue[-1][0] <= key:
            queue.append((key, request))  # the usual case: keys grow with arrival
        else:
            bisect.insort(queue, (key, request), key=lambda item: item[0])
        self._where[request.request_id] = queue

    def peek(self, skip: frozenset[str] | set[str] = frozenset()) -> Request | None:
        """The request to admit next (not removed), passing over those in ``skip`` (request ids: held back this
        step). O(tenants with waiting requests) when nothing is skipped."""
        best: tuple | None = None
        best_request: Request | None = None
        for (_, tenant), queue in self._queues.items():
            item = next((item for item in queue if item[1].request_id not in skip), None) if skip else queue[0]
            if item is None:
                continue
            key, request = item
            rank = (key[0], self.counters.get(tenant, 0.0) if self.enabled else 0.0, key)
            if best is None or rank < best:
                best, best_request = rank, request
        resumed = next((item for item in self._resumed if item[1].request_id not in skip), None) if skip \
            else (self._resumed[0] if self._resumed else None)
        if resumed is not None and (best is None or resumed[0][0] <= best[0]):
            return resumed[1]  # admitted before: first in its class
        return best_request

    def requests(self) -> Iterator[Request]:
        """Every waiting request, in no particular order."""
        yield from (request for _, request in self._resumed)
        for queue in self._queues.values():
            yield from (request for _, request in queue)

    def remove(self, request: Request) -> bool:
        queue = self._where.pop(request.request_id, None)
        if queue is None:
            return False
        for i, (key, r) in enumerate(queue):  # usually the head
            if r is request:
                del queue[i]
                if not queue and queue is not self._resumed:
                    del self._queues[(key[0], self._tenant(request))]
                return True
        raise AssertionError(f"{request.request_id!r} is not in its queue")

    def __len__(self) -> int:
        return len(self._where)

    def __bool__(self) -> bool:
        return bool(self._where)

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
