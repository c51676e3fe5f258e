"""How the processes use the cores during a run: per-process and per-thread CPU from /proc."""

from __future__ import annotations

import os
import threading
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import psutil

CLK_TCK = os.sysconf("SC_CLK_TCK")


def _thread_stat(pid: int, tid: int) -> tuple[str, float, int] | None:
    """(name, cpu seconds, last core) of one thread, from /proc/PID/task/TID/stat."""
    try:
        raw = Path(f"/proc/{pid}/task/{tid}/stat").read_text()
    except OSError:
        return None
    name = raw[raw.index("(") + 1:raw.rindex(")")]
    fields = raw[raw.rindex(")") + 2:].split()  # fields[0] is field 3 (state)
    return name, (int(fields[11]) + int(fields[12])) / CLK_TCK, int(fields[36])


def _short_name(proc: psutil.Process) -> str:
    """A child's name for reports: the tokenfleet service it runs (``-m tokenfleet.services.X``), else its name."""
    try:
        cmdline = proc.cmdline()
    except psutil.Error:
        return "?"
    for arg in cmdline:
        if arg.startswith("tokenfleet.services."):
            return arg.removeprefix("tokenfleet.services.").replace("decode", "worker")
    return proc.name()


@dataclass
class _Seen:
    label: str
    name: str
    cpu_start: dict[int, float] = field(default_factory=dict)  # tid -> cpu s at first sight
    cpu_last: dict[int, float] = field(default_factory=dict)
    names: dict[int, str] = field(default_factory=dict)
    cores: dict[int, Counter] = field(default_factory=dict)  # tid -> core -> samples while busy


class CoreMonitor:
    """Samples the benchmark's processes (and their children) every `interval` seconds in a thread.

    CPU % of a process = CPU seconds over the run / wall seconds * 100 (200 = both cores). A thread
    counts as busy when it used more than 5 % of a core; its cores are those it was last seen on in
    samples where it had run since the previous one.
    """

    def __init__(self, roots: dict[str, int], interval: float = 0.25):
        self.roots, self.interval = roots, interval
        self.seen: dict[int, _Seen] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def __enter__(self) -> CoreMonitor:
        self._t0 = time.perf_counter()
        self._machine0 = psutil.cpu_times(percpu=True)
        self._sample()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self._sample()
        self.wall = time.perf_counter() - self._t0
        self._machine1 = psutil.cpu_times(percpu=True)

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            self._sample()

    def _processes(self) -> Iterator[tuple[str, psutil.Process]]:
        for label, pid in self.roots.items():
            try:
                root = psutil.Process(pid)
                yield label, root
                for child in root.children(recursive=True):
                    yield f"{label}/{_short_name(child)}", child
            except psutil.Error:
                continue

    def _sample(self) -> None:
        for label, proc in self._processes():
            seen = self.seen.get(proc.pid)
            if seen is None:
                seen = self.seen[proc.pid] = _Seen(label, proc.name())
            try:
                tids = [int(t) for t in os.listdir(f"/proc/{proc.pid}/task")]
            except OSError:
                continue
            for tid in tids:
                stat = _thread_stat(proc.pid, tid)
                if stat is None:
                    continue
                name, cpu, core = stat
                seen.names[tid] = name
                previous = seen.cpu_last.get(tid)
                seen.cpu_start.setdefault(tid, cpu)
                seen.cpu_last[tid] = cpu
                if previous is not None and cpu - previous > 0.05 * self.interval:
                    seen.cores.setdefault(tid, Counter())[core] += 1

    def report(self) -> dict:
        processes = []
        for pid, seen in self.seen.items():
            per_thread = {tid: seen.cpu_last[tid] - seen.cpu_start[tid] for tid in seen.cpu_last}
            busy = sorted(((s, tid) for tid, s in per_thread.items() if s > 0.05 * self.wall), reverse=True)
            threads = [{"name": seen.names[tid], "cpu_pct": 100 * s / self.wall,
                        "cores": dict(sorted(seen.cores.get(tid, Counter()).items()))} for s, tid in busy[:6]]
            try:
                affinity = sorted(psutil.Process(pid).cpu_affinity())
            except psutil.Error:
                affinity = []
            processes.append({"label": seen.label, "pid": pid, "name": seen.name,
                              "cpu_pct": 100 * sum(per_thread.values()) / self.wall, "threads": len(per_thread),
                              "busy_threads": threads, "affinity": affinity})
        processes.sort(key=lambda p: -p["cpu_pct"])
        cores = []
        for before, after in zip(self._machine0, self._machine1):
            total = sum(after) - sum(before)
            idle = (after.idle + after.iowait) - (before.idle + before.iowait)
            cores.append(100 * (total - idle) / total if total > 0 else 0.0)
        machine_busy = sum(cores) * self.wall / 100  # core-seconds
        ours = sum(p["cpu_pct"] for p in processes) * self.wall / 100
        return {"wall_s": self.wall, "processes": processes, "core_busy_pct": cores,
                "outside_cpu_pct": max(0.0, 100 * (machine_busy - ours) / self.wall)}


