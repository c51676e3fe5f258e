"""Canary rollouts: move an alias's traffic from its version to a new one in steps, comparing the two versions'
live metrics, and roll back on a regression that can be named.

The alias keeps its current version as ``target`` and gets the new one as its ``canary`` (registry canary split,
sticky per conversation); each step raises the canary's weight, then holds it for ``step_seconds`` while the
controller reads the gateways' per-version counters (``tokenfleet_gateway_version_*``) every ``poll_seconds``.
It judges continuously, not only at a step's end: a canary whose error rate exceeds the baseline's by
``max_error_increase`` (once it has ``min_requests`` requests this step), or whose mean TTFT/TPOT is
``max_latency_ratio`` times the baseline's, is rolled back at once (weight 0, canary removed). An optional eval
command (run once per step, on the canary) must print a score >= ``min_eval_score``. After the last step (weight
1) holds, the alias points at the new version alone.

Every step, decision and reason is recorded in etcd (``rollouts/<alias>``) and logged. Operators steer a running
rollout through ``rollouts/<alias>/control``: ``pause`` (hold the weight), ``resume``, ``abort`` (roll back now),
``weight=W`` (a manual override: set W and hold it, paused).

The decision (``judge``) and the loop (``Rollout.run``) are pure over injected I/O (``RolloutIO``), so tests drive
them with a clock of their own; ``tokenfleet models rollout`` wires the registry, the gateways' /metrics and etcd.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import structlog

log = structlog.get_logger()


@dataclass(frozen=True)
class RolloutConfig:
    steps: tuple[float, ...] = (0.05, 0.25, 0.5, 1.0)
    step_seconds: float = 60.0
    poll_seconds: float = 1.0
    min_requests: int = 5  # canary requests in a step before its error rate is judged
    max_error_increase: float = 0.05  # canary error rate - baseline error rate
    max_latency_ratio: float = 2.0  # canary mean TTFT (or TPOT) / the baseline's
    min_latency_samples: int = 5
    min_eval_score: float | None = None

    def __post_init__(self) -> None:
        if not self.steps or any(not 0.0 < w <= 1.0 for w in self.steps) or list(self.steps) != sorted(self.steps):
            raise ValueError(f"steps must be increasing weights in (0, 1], got {self.steps}")
        if self.step_seconds <= 0 or self.poll_seconds <= 0:
            raise ValueError("step_seconds and poll_seconds must be positive")


@dataclass
class VersionStats:
    """One version's counters (cumulative, or a difference of two readings)."""

    requests: float = 0.0
    errors: float = 0.0  # failed or rejected
    ttft_sum: float = 0.0
    ttft_count: float = 0.0
    tpot_sum: float = 0.0
    tpot_count: float = 0.0

    def __sub__(self, other: VersionStats) -> VersionStats:
        return VersionStats(*(a - b for a, b in zip(dataclasses.astuple(self), dataclasses.astuple(other))))

    @property
    def error_rate(self) -> float:
        return self.errors / self.requests if self.requests else 0.0

    @property
    def ttft(self) -> float | None:
        return self.ttft_sum / self.ttft_count if self.ttft_count else None

    @property
    def tpot(self) -> float | None:
        return self.tpot_sum / self.tpot_count if self.tpot_count else None


def judge(base: VersionStats, canary: VersionStats, config: RolloutConfig) -> str | None:
    """The regression the canary shows against the baseline over the same window, named; None: none seen."""
    if canary.requests >= config.min_requests and canary.error_rate - base.error_rate > config.max_error_increase:
        return (f"error rate {canary.error_rate:.1%} over {canary.requests:.0f} requests vs {base.error_rate:.1%} "
                f"over {base.requests:.0f} on the current version")
    for name, count in (("ttft", "ttft_count"), ("tpot", "tpot_count")):
        mine, theirs = getattr(canary, name), getattr(base, name)
        if (mine is not None and theirs and getattr(canary, count) >= config.min_latency_samples
                and getattr(base, count) >= config.min_latency_samples and mine / theirs > config.max_latency_ratio):
            return f"mean {name.upper()} {mine * 1000:.0f} ms vs {theirs * 1000:.0f} ms on the current version"
    return None


class RolloutIO(Protocol):
    def set_weight(self, weight: float) -> None: ...

    def promote(self) -> None: ...  # the alias points at the new version alone

    def roll_back(self) -> None: ...  # the alias points at the current version alone

    def stats(self) -> dict[str, VersionStats]: ...  # by version ref, cumulative

    def control(self) -> str: ...  # "", "pause", "resume", "abort" or "weight=W"; consumed when read

    def record(self, state: dict[str, Any]) -> None: ...

    def evaluate(self) -> float | None: ...  # the eval command's score on the canary (None: no command)


@dataclass
class Rollout:
    alias: str
    current: str  # name@version the alias serves now
    new: str  # name@version rolled out
    config: RolloutConfig
    io: RolloutIO
    clock: Callable[[], float] = time.monotonic
    sleep: Callable[[float], None] = time.sleep
    history: list[dict[str, Any]] = field(default_factory=list)
    state: str = "running"  # running | paused | done | rolled_back
    weight: float = 0.0
    max_read_failures: int = 5  # consecutive polls whose metrics could not be read before a rollback

    def run(self) -> str:
        """Drive the rollout to ``done`` or ``rolled_back``; returns that state. Whatever goes wrong on the way
        (metrics, etcd, the registry, the eval command, Ctrl-C), the alias is put back on the current version."""
        try:
            return self._run()
        except BaseException as e:
            if self.state not in ("done", "rolled_back"):
                self._roll_back(f"the rollout failed: {type(e).__name__}: {e}")
            raise

    def _run(self) -> str:
        for step in self.config.steps:
            self._set(step, "step")
            reason = self._hold(step)
            if reason is not None:
                return self._roll_back(reason)
        self.io.promote()
        self.state = "done"
        self._event("promoted", f"{self.alias} -> {self.new}")
        return self.state

    def _hold(self, step: float) -> str | None:
        """Hold the step's weight for step_seconds (paused time does not count), judging every poll; the reason
        to roll back, or None."""
        start: dict[str, VersionStats] | None = None  # the step's first reading (retried in the loop if it fails)
        try:
            start = self.io.stats()
        except Exception:  # noqa: BLE001 - counted below, on the next polls
            start = None
        failures = 0
        held = 0.0
        last = self.clock()
        if self.config.min_eval_score is not None:
            score = self.io.evaluate()
            if score is None or score < self.config.min_eval_score:
                return f"eval score {score} below {self.config.min_eval_score}"
        while held < self.config.step_seconds:
            self.sleep(self.config.poll_seconds)
            now = self.clock()
            if self.state == "running":
                held += now - last
            last = now
            command = self.io.control()
            if command == "abort":
                return "aborted by the operator"
            if command == "pause":
                self._set_state("paused", "paused by the operator")
            elif command == "resume":
                self._set_state("running", "resumed by the operator")
            elif command.startswith("weight="):
                try:
                    weight = float(command.split("=", 1)[1])
                except ValueError:
                    weight = float("nan")
                if not 0.0 <= weight <= 1.0:  # also NaN
                    self._event("ignored", f"control {command!r}: a weight is in [0, 1]")
                else:
                    self._set(weight, "manual override (paused)")
                    self._set_state("paused", "manual override")
            try:
                reading = self.io.stats()
                failures = 0
            except Exception as e:  # a gateway restarting: skip this poll, but not for long
                failures += 1
                if failures >= self.max_read_failures:
                    return f"no metrics for {failures} polls in a row ({type(e).__name__}: {e})"
                continue
            if start is None:
                start = reading
                continue
            base = reading.get(self.current, VersionStats()) - start.get(self.current, VersionStats())
            canary = reading.get(self.new, VersionStats()) - start.get(self.new, VersionStats())
            reason = judge(base, canary, self.config)
            if reason is not None:
                return reason
        return None

    def _set(self, weight: float, why: str) -> None:
        self.weight = weight
        self.io.set_weight(weight)
        self._event("weight", why)

    def _set_state(self, state: str, why: str) -> None:
        if state != self.state:
            self.state = state
            self._event(state, why)

    def _roll_back(self, reason: str) -> str:
        self.io.roll_back()
        self.weight = 0.0
        self.state = "rolled_back"
        self._event("rolled_back", reason)
        return self.state

    def _event(self, kind: str, detail: str) -> None:
        entry = {"time": time.time(), "event": kind, "weight": self.weight, "detail": detail}
        self.history.append(entry)
        log.info("rollout", alias=self.alias, new=self.new, step=kind, weight=self.weight, detail=detail)
        self.io.record({"alias": self.alias, "current": self.current, "new": self.new, "state": self.state,
                        "weight": self.weight, "steps": list(self.config.steps), "history": self.history})


def parse_version_stats(text: str) -> dict[str, VersionStats]:
    """Per-version counters from a gateway's /metrics text (``tokenfleet_gateway_version_*``)."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, VersionStats] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            ref = sample.labels.get("ref")
            if ref is None:
                continue
            s = out.setdefault(ref, VersionStats())
            if sample.name == "tokenfleet_gateway_version_requests_total":
                s.requests += sample.value
                if sample.labels.get("status") in ("failed", "rejected"):
                    s.errors += sample.value
            elif sample.name == "tokenfleet_gateway_version_ttft_seconds_sum":
                s.ttft_sum += sample.value
            elif sample.name == "tokenfleet_gateway_version_ttft_seconds_count":
                s.ttft_count += sample.value
            elif sample.name == "tokenfleet_gateway_version_tpot_seconds_sum":
                s.tpot_sum += sample.value
            elif sample.name == "tokenfleet_gateway_version_tpot_seconds_count":
                s.tpot_count += sample.value
    return out


def merge_stats(readings: Sequence[dict[str, VersionStats]]) -> dict[str, VersionStats]:
    """Several gateways' counters summed per version."""
    out: dict[str, VersionStats] = {}
    for reading in readings:
        for ref, s in reading.items():
            total = out.setdefault(ref, VersionStats())
            for f in dataclasses.fields(VersionStats):
                setattr(total, f.name, getattr(total, f.name) + getattr(s, f.name))
    return out
