"""A userspace TCP fault proxy for the fault benchmark: put between a service and whoever calls it (the service
advertises the proxy's address), with no change to the machine's network settings. Modes, switched at any time:

- ``pass``: bytes forwarded as they come;
- ``partition``: a silent partition: connections stay open and new ones are accepted, but no byte crosses in either
  direction (no RST, no FIN), as when a network path drops packets;
- ``delay``: every chunk is forwarded ``delay_s`` after it arrived (added latency, without limiting throughput).
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections import deque


class FaultProxy:
    def __init__(self, target: str, host: str = "127.0.0.1"):
        self.target = target
        self.name = target  # for reports
        self.mode, self.delay_s = "pass", 0.0
        self.forwarded = self.dropped = 0  # bytes
        self._server = socket.create_server((host, 0))
        self.address = f"{host}:{self._server.getsockname()[1]}"
        self._closing = False
        self._sockets: list[socket.socket] = []
        self._lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True, name="fault-proxy").start()

    def set(self, mode: str, delay_s: float = 0.0) -> None:
        if mode not in ("pass", "partition", "delay"):
            raise ValueError(f"mode must be pass, partition or delay, got {mode!r}")
        self.mode, self.delay_s = mode, delay_s

    def close(self) -> None:
        self._closing = True
        with contextlib.suppress(OSError):
            self._server.close()
        with self._lock:
            for sock in self._sockets:
                with contextlib.suppress(OSError):
                    sock.close()

    def _accept(self) -> None:
        host, _, port = self.target.rpartition(":")
        while not self._closing:
            try:
                client, _ = self._server.accept()
            except OSError:
                return
            try:
                upstream = socket.create_connection((host, int(port)), timeout=10)
                upstream.settimeout(None)
            except OSError:
                client.close()
                continue
            for sock in (client, upstream):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            with self._lock:
                self._sockets += [client, upstream]
            for src, dst in ((client, upstream), (upstream, client)):
                pending: deque[tuple[float, bytes]] = deque()
                ready = threading.Condition()
                threading.Thread(target=self._read, args=(src, dst, pending, ready), daemon=True).start()
                threading.Thread(target=self._write, args=(dst, pending, ready), daemon=True).start()

    def _read(self, src: socket.socket, dst: socket.socket, pending: deque, ready: threading.Condition) -> None:
        try:
            while data := src.recv(65536):
                if self.mode == "partition":
                    self.dropped += len(data)
                    continue
                with ready:
                    pending.append((time.monotonic() + (self.delay_s if self.mode == "delay" else 0.0), data))
                    ready.notify()
        except OSError:
            pass
        with ready:
            pending.append((0.0, b""))  # end: close the other side once what came before is sent
            ready.notify()

    def _write(self, dst: socket.socket, pending: deque, ready: threading.Condition) -> None:
        while True:
            with ready:
                while not pending:
                    ready.wait()
                due, data = pending.popleft()
            if not data:
                with contextlib.suppress(OSError):
                    dst.shutdown(socket.SHUT_WR)
                return
            time.sleep(max(0.0, due - time.monotonic()))
            try:
                dst.sendall(data)
                self.forwarded += len(data)
            except OSError:
                return
