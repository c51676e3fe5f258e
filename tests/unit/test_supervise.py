"""The restart policy of `tokenfleet up`'s supervisor, and the supervisor over stand-in processes."""

from __future__ import annotations

import io

from tokenfleet.cli.supervise import RestartPolicy, Supervisor


def test_backoff_doubles_to_a_cap_and_resets_after_a_stable_run():
    p = RestartPolicy(first_backoff=1, max_backoff=8, stable_after=60, loop_restarts=100)
    p.started("w", 0)
    assert [p.died("w", t) for t in (1, 2, 3, 4, 5)] == [1, 2, 4, 8, 8]
    p.started("w", 10)
    assert p.died("w", 100) == 1  # up for 90 s: a fresh failure


def test_a_crash_loop_is_detected_and_slowed_to_the_longest_backoff():
    p = RestartPolicy(first_backoff=1, max_backoff=30, loop_restarts=3, loop_window=60)
    assert not p.crash_looping("r", 0)
    p.died("r", 0)
    p.died("r", 5)
    assert not p.crash_looping("r", 5)
    assert p.died("r", 10) == 30 and p.crash_looping("r", 10)
    assert not p.crash_looping("r", 200)  # the window has passed


class FakeProc:  # a process stand-in: returncode set means it has exited
    def __init__(self, code=None):
        self.returncode = code

    def poll(self):
        return self.returncode


class FakeCluster:
    def __init__(self):
        self.processes = [("worker-0", FakeProc()), ("router", FakeProc())]
        self.fail = 0

    def restart(self, name):
        if self.fail:
            self.fail -= 1
            self.processes = [(n, FakeProc(1) if n == name else p) for n, p in self.processes]
            raise RuntimeError(f"{name} failed to start (exit 1)")
        self.processes = [(n, FakeProc() if n == name else p) for n, p in self.processes]
        return "127.0.0.1:5000"


def test_the_supervisor_restarts_dead_services_after_their_backoff_and_retries_failed_starts():
    now = [0.0]
    cluster = FakeCluster()
    out = io.StringIO()
    sup = Supervisor(cluster, RestartPolicy(first_backoff=1, max_backoff=4), out=out, clock=lambda: now[0])
    cluster.processes[0] = ("worker-0", FakeProc(-9))
    sup.poll()
    assert [e.what for e in sup.events] == ["exited"]  # not restarted before its backoff
    now[0] = 1.0
    cluster.fail = 1
    sup.poll()
    assert [e.what for e in sup.events] == ["exited", "restart-failed"]
    now[0] = 1.5
    sup.poll()  # the failed start is a new crash: 2 s of backoff
    now[0] = 3.6
    sup.poll()
    assert [e.what for e in sup.events] == ["exited", "restart-failed", "exited", "restarted"]
    assert cluster.processes[0][1].poll() is None and cluster.processes[1][1].poll() is None
    assert "[supervisor] worker-0 restarted: 127.0.0.1:5000" in out.getvalue()
