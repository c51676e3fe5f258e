"""Supervision for `tokenfleet up`: a service that dies is started again, like compose's `restart: unless-stopped`.

``RestartPolicy`` is the pure part (tested on its own): exponential backoff per service, reset after a service
has stayed up a while, and crash-loop detection (too many restarts in a window), which is reported and slows the
restarts to the longest backoff; it never gives up, as compose does not. ``Supervisor`` applies it to a
``launcher.Cluster``: it polls the processes, restarts a dead one on the address it had (workers re-register in
etcd themselves; clients' channels reconnect), and writes each event to stderr and to the cluster's event list.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TextIO


@dataclass
class RestartPolicy:
    first_backoff: float = 1.0
    max_backoff: float = 30.0
    stable_after: float = 60.0  # up this long: the next crash starts from the first backoff again
    loop_restarts: int = 5  # this many restarts within loop_window seconds: a crash loop
    loop_window: float = 120.0
    _restarts: dict[str, list[float]] = field(default_factory=dict)  # service -> restart times
    _backoff: dict[str, float] = field(default_factory=dict)
    _started: dict[str, float] = field(default_factory=dict)

    def started(self, name: str, now: float) -> None:
        self._started[name] = now

    def died(self, name: str, now: float) -> float:
        """The service died at ``now``: seconds to wait before starting it again."""
        if now - self._started.get(name, now) >= self.stable_after:
            self._backoff.pop(name, None)  # it had been healthy: a fresh failure
        backoff = self._backoff.get(name, 0.0)
        backoff = self.first_backoff if not backoff else min(2 * backoff, self.max_backoff)
        self._backoff[name] = backoff
        times = [t for t in self._restarts.get(name, []) if now - t < self.loop_window] + [now]
        self._restarts[name] = times
        if self.crash_looping(name, now):
            backoff = self._backoff[name] = self.max_backoff
        return backoff

    def crash_looping(self, name: str, now: float) -> bool:
        return len([t for t in self._restarts.get(name, []) if now - t < self.loop_window]) >= self.loop_restarts

    def restarts(self, name: str) -> int:
        return len(self._restarts.get(name, []))


@dataclass
class Event:
    when: float
    service: str
    what: str  # "exited", "restarted", "restart-failed", "crash-loop"
    detail: str = ""


class Supervisor:
    """Polls ``cluster``'s processes (``poll``, from the launcher's wait loop) and restarts the dead ones."""

    def __init__(self, cluster: Any, policy: RestartPolicy | None = None, out: TextIO | None = None,
                 clock: Callable[[], float] = time.monotonic):
        self.cluster = cluster
        self.policy = policy or RestartPolicy()
        self.out = out or sys.stderr
        self.clock = clock
        self.events: list[Event] = []
        self._due: dict[str, float] = {}  # service -> when to restart it
        now = clock()
        for name, _ in cluster.processes:
            self.policy.started(name, now)

    def poll(self) -> None:
        now = self.clock()
        for name, proc in list(self.cluster.processes):
            if name in self._due or proc.poll() is None:
                continue
            wait = self.policy.died(name, now)
            self._note(Event(now, name, "exited", f"code {proc.returncode}; restarting in {wait:.0f} s "
                                                  f"(restart {self.policy.restarts(name)})"))
            if self.policy.crash_looping(name, now):
                self._note(Event(now, name, "crash-loop", f"{self.policy.restarts(name)} restarts in "
                                                          f"{self.policy.loop_window:.0f} s; retrying every "
                                                          f"{self.policy.max_backoff:.0f} s"))
            self._due[name] = now + wait
        for name, due in sorted(self._due.items(), key=lambda item: item[1]):
            if due > self.clock():
                continue
            del self._due[name]
            try:
                address = self.cluster.restart(name)
            except Exception as e:  # noqa: BLE001 - a failed start is one more crash: retried with backoff
                self._note(Event(self.clock(), name, "restart-failed", str(e)))
                continue  # its process has exited: the next poll schedules the next try
            self.policy.started(name, self.clock())
            self._note(Event(self.clock(), name, "restarted", address))

    def _note(self, event: Event) -> None:
        self.events.append(event)
        print(f"[supervisor] {event.service} {event.what}: {event.detail}", file=self.out, flush=True)
