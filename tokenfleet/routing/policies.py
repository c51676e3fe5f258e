"""Placement policies: pure functions over a snapshot of the fleet (services, tests and the
fleet simulator run the same code).

A router serves ``Pick`` from a ``FleetSnapshot`` built from etcd membership and the workers'
load streams. Load reports arrive every few hundred ms, so a burst of picks between two
reports would all see the same "least loaded" replica; ``pending_assignments`` (picks made
since that replica's last report) is added to its reported load to spread a burst.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

SERVING = "serving"


class NoReplicaError(LookupError):
    """No serving replica can take the request (maps to 503 at the gateway)."""


@dataclass(frozen=True)
class ReplicaLoad:
    replica_id: str
    address: str
    roles: tuple[str, ...] = ("decode",)
    state: str = SERVING
    num_waiting: int = 0
    num_running: int = 0
    num_blocks_used: int = 0
    num_blocks_free: int = 0
    pending_assignments: int = 0  # picks since this replica's last load report
    adapters: frozenset[str] = frozenset()  # LoRA adapters loaded on it (its load reports)
    ttft_ms_recent: float = 0.0  # over its last completed requests (stale when idle)
    prefill_wait_s: float = 0.0  # prompt tokens queued / its recent prefill rate: a newcomer's wait to start

    @property
    def kv_utilization(self) -> float:
        total = self.num_blocks_used + self.num_blocks_free
        return self.num_blocks_used / total if total else 0.0

    @property
    def effective_load(self) -> int:
        return self.num_waiting + self.num_running + self.pending_assignments


@dataclass(frozen=True)
class FleetSnapshot:
    replicas: tuple[ReplicaLoad, ...]

    def without(self, replica_ids: Iterable[str]) -> FleetSnapshot:
        """The snapshot minus replicas a caller already failed on (retry elsewhere)."""
        excluded = set(replica_ids)
        return FleetSnapshot(tuple(r for r in self.replicas if r.replica_id not in excluded)) if excluded else self

    def preferring_adapter(self, adapter: str) -> FleetSnapshot:
        """The replicas that have ``adapter`` loaded, when any serving one has; else every replica (one loads it)."""
        if not adapter:
            return self
        warm = tuple(r for r in self.replicas if adapter in r.adapters and r.state == SERVING)
        return FleetSnapshot(warm) if warm else self

    def with_spare(self, slots: int) -> FleetSnapshot:
        """The replicas with room for batch work: serving, nothing waiting, fewer than ``slots`` requests running
        or on their way (interactive requests always come first: batch lines only fill what they leave)."""
        return FleetSnapshot(tuple(r for r in self.replicas if r.state == SERVING and r.num_waiting == 0
                                   and r.num_running + r.pending_assignments < slots))

    def candidates(self, role: str = "decode") -> list[ReplicaLoad]:
        """Serving replicas with ``role``, in a stable order (by id)."""
        live = [r for r in self.replicas if r.state == SERVING and role in r.roles]
        return sorted(live, key=lambda r: r.replica_id)


def least_loaded(snapshot: FleetSnapshot, role: str = "decode") -> ReplicaLoad:
    """Fewest queued + running + pending requests; KV utilization, then id, break ties."""
    candidates = snapshot.candidates(role)
    if not candidates:
        raise NoReplicaError(f"no serving replica with role {role!r}")
    return min(candidates, key=lambda r: (r.effective_load, r.kv_utilization, r.replica_id))


@dataclass
class RoundRobin:
    """Cycles over the serving replicas; the only state is a counter (baseline policy)."""

    _counter: Iterator[int] = field(default_factory=itertools.count)

    def pick(self, snapshot: FleetSnapshot, role: str = "decode") -> ReplicaLoad:
        candidates = snapshot.candidates(role)
        if not candidates:
            raise NoReplicaError(f"no serving replica with role {role!r}")
        return candidates[next(self._counter) % len(candidates)]
