"""Autoscaling policy: desired replicas per pool from the fleet's load, predictively, with guard rails.

Pure (no etcd, no processes): ``Autoscaler.decide(pool, samples, now)`` takes the pool's recent load samples and
returns a ``Decision`` with its reasons; the service (``autoscale_service``) feeds it the workers' load reports
and applies decisions through a driver (local processes, docker compose, Kubernetes).

The model: a replica serves ``target_concurrency`` requests (running + waiting) within its TTFT objective;
that is the capacity `tokenfleet plan` and the simulator compute for a replica (``capacity_from_plan``), or a
measured figure. Demand is the pool's running + waiting requests. The policy scales on the trend, not only on
breaches: a least-squares slope over ``window`` seconds projects demand ``lead_seconds`` ahead (how long a new
replica takes to serve), and the desired count covers max(now, projected). A queue (requests waiting in every
sample for ``queue_seconds``: one waiting for the next step is normal), a TTFT over ``ttft_objective`` (predicted:
the queued prompt tokens over the replica's prefill rate; or measured, while requests wait) or KV usage over
``kv_high`` adds a replica even when the count says otherwise. A busy chunked-prefill engine nearly always has a
request waiting for its next chunk, so a pool with a TTFT objective can drop the queue trigger (``scale_on_queue``)
and let the predicted wait decide whether a queue matters.

Guard rails: bounds (``min_replicas``..``max_replicas``), at most ``max_step`` replicas added or removed per
decision, cooldowns after a scale-up and a scale-down, hysteresis (scale down only when demand fits in one replica
fewer with ``down_margin`` to spare, continuously for ``down_stable`` seconds), and an operator's pause or fixed
override. Every decision carries its reasons.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Sample:
    """One moment of a pool's load (all its serving replicas together)."""

    when: float
    replicas: int  # serving replicas
    running: int
    waiting: int
    kv_usage: float = 0.0  # the fullest replica's share of KV blocks in use
    starting: int = 0  # replicas started but not serving yet
    ttft_recent: float = 0.0  # seconds: the slowest replica's recent TTFT (over its last completed requests)
    prefill_wait: float = 0.0  # seconds: the longest predicted wait before a newcomer's prefill starts

    @property
    def demand(self) -> int:
        return self.running + self.waiting


@dataclass(frozen=True)
class ScalePolicy:
    target_concurrency: float = 4.0  # requests one replica serves within its objectives
    min_replicas: int = 1
    max_replicas: int = 4
    max_step: int = 1
    window: float = 30.0  # seconds of samples the trend is fitted on
    lead_seconds: float = 20.0  # how far ahead the trend is projected (a new replica's time to serve)
    up_cooldown: float = 10.0
    down_cooldown: float = 30.0
    down_stable: float = 20.0  # demand must fit one replica fewer this long before a scale-down
    down_margin: float = 0.75  # ... using at most this share of the smaller pool's capacity
    kv_high: float = 0.9
    queue_seconds: float = 5.0  # requests waiting in every sample this long: a queue (one waiting a step is normal)
    scale_on_queue: bool = True  # False: only the TTFT objective (predicted or recent) judges a queue
    ttft_objective: float = 0.0  # seconds; > 0: a replica whose requests wait for it (predicted or recent) adds one

    def __post_init__(self) -> None:
        if not 1 <= self.min_replicas <= self.max_replicas:
            raise ValueError(f"need 1 <= min_replicas <= max_replicas, got {self.min_replicas}..{self.max_replicas}")
        if self.target_concurrency <= 0 or self.max_step < 1:
            raise ValueError("target_concurrency must be > 0 and max_step >= 1")
        if not all(math.isfinite(v) and v >= 0 for v in (self.up_cooldown, self.down_cooldown, self.down_stable)):
            raise ValueError("cooldowns and down_stable are seconds >= 0")


@dataclass(frozen=True)
class Decision:
    pool: str
    current: int
    desired: int
    reasons: tuple[str, ...]

    @property
    def delta(self) -> int:
        return self.desired - self.current


@dataclass
class _PoolState:
    last_up: float = -math.inf
    last_down: float = -math.inf
    fits_smaller_since: float | None = None
    paused: bool = False
    override: int | None = None


@dataclass
class Autoscaler:
    policies: dict[str, ScalePolicy] = field(default_factory=dict)  # pool -> its policy (else ``default``)
    default: ScalePolicy = field(default_factory=ScalePolicy)
    _state: dict[str, _PoolState] = field(default_factory=dict)

    def policy(self, pool: str) -> ScalePolicy:
        return self.policies.get(pool, self.default)

    def pause(self, pool: str, paused: bool = True) -> None:
        self._pool(pool).paused = paused

    def override(self, pool: str, replicas: int | None) -> None:
        """Hold ``pool`` at ``replicas`` (within its bounds); None returns it to the policy."""
        self._pool(pool).override = replicas

    def decide(self, pool: str, samples: Sequence[Sample], now: float) -> Decision:
        """The pool's desired replica count now. ``samples``: oldest first, the last one current."""
        p, state = self.policy(pool), self._pool(pool)
        last = samples[-1]
        current = last.replicas + last.starting
        if state.override is not None:
            target = min(max(state.override, p.min_replicas), p.max_replicas)
            return self._step(pool, p, state, current, target, [f"operator override: {state.override}"], now, True)
        if state.paused:
            return Decision(pool, current, current, ("paused by an operator",))
        recent = [s for s in samples if now - s.when <= p.window]
        slope = _slope([(s.when, s.demand) for s in recent])
        projected = last.demand + max(slope, 0.0) * p.lead_seconds
        need = math.ceil(max(last.demand, projected) / p.target_concurrency)
        reasons = [f"demand {last.demand} (running {last.running}, waiting {last.waiting}), trend {slope:+.2f}/s, "
                   f"projected {projected:.1f} in {p.lead_seconds:.0f} s: {need} replica(s) at "
                   f"{p.target_concurrency:g} each"]
        queued = [s for s in samples if now - s.when <= p.queue_seconds]
        persistent = bool(queued) and now - queued[0].when >= p.queue_seconds * 0.8 and all(s.waiting > 0 for s in queued)
        persistent = p.scale_on_queue and last.waiting > 0 and (persistent or p.queue_seconds == 0)
        if persistent and need <= current and current == last.replicas:
            need = current + 1
            reasons.append(f"requests queued for {p.queue_seconds:.0f} s ({last.waiting} now)")
        late = max(last.prefill_wait, last.ttft_recent if last.waiting else 0.0)
        if p.ttft_objective > 0 and late > p.ttft_objective and need <= current and current == last.replicas:
            need = current + 1
            reasons.append(f"TTFT {late:.2f} s (predicted from queued prompt tokens, or recent while requests wait) "
                           f"> objective {p.ttft_objective:g} s")
        if last.kv_usage >= p.kv_high and need <= current:
            need = current + 1
            reasons.append(f"KV usage {last.kv_usage:.0%} >= {p.kv_high:.0%}")
        target = min(max(need, p.min_replicas), p.max_replicas)
        if target < current:  # hysteresis: only when one fewer has kept enough room for a while
            smaller = max(current - 1, p.min_replicas)
            fits = max(last.demand, projected) <= smaller * p.target_concurrency * p.down_margin
            if not fits:
                state.fits_smaller_since = None
                return Decision(pool, current, current, (*reasons, "demand would not fit one replica fewer "
                                                          f"with {1 - p.down_margin:.0%} to spare"))
            if state.fits_smaller_since is None:
                state.fits_smaller_since = now
            if now - state.fits_smaller_since < p.down_stable:
                return Decision(pool, current, current, (*reasons, f"low for {now - state.fits_smaller_since:.0f} s "
                                                          f"of {p.down_stable:.0f} s before scaling down"))
        else:
            state.fits_smaller_since = None
        return self._step(pool, p, state, current, target, reasons, now, False)

    def _step(self, pool: str, p: ScalePolicy, state: _PoolState, current: int, target: int, reasons: list[str],
              now: float, forced: bool) -> Decision:
        if target > current:
            if not forced and now - state.last_up < p.up_cooldown:
                return Decision(pool, current, current, (*reasons, f"scale-up cooldown ({p.up_cooldown:.0f} s)"))
            desired = min(target, current + p.max_step)
            state.last_up = now
        elif target < current:
            if not forced and (now - state.last_down < p.down_cooldown or now - state.last_up < p.down_cooldown):
                return Decision(pool, current, current, (*reasons, f"scale-down cooldown ({p.down_cooldown:.0f} s)"))
            desired = max(target, current - p.max_step)
            state.last_down = now
            state.fits_smaller_since = None
        else:
            desired = current
        if desired != target:
            reasons = [*reasons, f"at most {p.max_step} replica(s) per step toward {target}"]
        return Decision(pool, current, desired, tuple(reasons))

    def _pool(self, pool: str) -> _PoolState:
        return self._state.setdefault(pool, _PoolState())


def _slope(points: Sequence[tuple[float, float]]) -> float:
    """Least-squares slope of (t, y) points; 0 with fewer than 2 distinct times."""
    if len(points) < 2:
        return 0.0
    n = len(points)
    mt = sum(t for t, _ in points) / n
    my = sum(y for _, y in points) / n
    var = sum((t - mt) ** 2 for t, _ in points)
    if var == 0:
        return 0.0
    return sum((t - mt) * (y - my) for t, y in points) / var


def capacity_from_plan(ttft_objective_s: float, prefill_seconds: float, max_running: int) -> float:
    """Requests one replica holds within a TTFT objective, by `tokenfleet plan`'s arithmetic: a newcomer waits for
    the prefills queued before it, so about objective / (one request's prefill time) of them fit; capped by the
    engine's ``max_running``."""
    return max(1.0, min(float(max_running), ttft_objective_s / max(prefill_seconds, 1e-9)))
