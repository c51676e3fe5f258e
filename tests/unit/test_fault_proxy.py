"""The fault benchmark's TCP proxy: forwards, delays without reordering, and partitions silently (no byte crosses,
nothing is closed)."""

from __future__ import annotations

import socket
import sys
import threading
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from benchmarks.serving.fault_proxy import FaultProxy  # noqa: E402


@pytest.fixture
def echo():
    server = socket.create_server(("127.0.0.1", 0))

    def serve() -> None:
        while True:
            try:
                conn, _ = server.accept()
            except OSError:
                return
            threading.Thread(target=lambda c=conn: [c.sendall(d) for d in iter(lambda: c.recv(4096), b"")],
                             daemon=True).start()

    threading.Thread(target=serve, daemon=True).start()
    yield f"127.0.0.1:{server.getsockname()[1]}"
    server.close()


def _exchange(address: str, payloads: list[bytes], timeout: float = 10) -> bytes:
    host, _, port = address.rpartition(":")
    with socket.create_connection((host, int(port)), timeout=timeout) as s:
        for p in payloads:
            s.sendall(p)
        want, got = sum(map(len, payloads)), b""
        while len(got) < want:
            got += s.recv(4096)
        return got


def test_the_proxy_forwards_delays_in_order_and_partitions_silently(echo):
    proxy = FaultProxy(echo)
    try:
        assert _exchange(proxy.address, [b"hello"]) == b"hello"
        proxy.set("delay", 0.05)
        parts = [bytes([65 + i]) * 100 for i in range(20)]
        assert _exchange(proxy.address, parts) == b"".join(parts)  # every byte, in order
        proxy.set("partition")
        with pytest.raises(TimeoutError):  # nothing comes back, and the connection stays open
            _exchange(proxy.address, [b"lost"], timeout=0.5)
        assert proxy.dropped >= 4
        proxy.set("pass")
        assert _exchange(proxy.address, [b"again"]) == b"again"
        with pytest.raises(ValueError):
            proxy.set("drop")
    finally:
        proxy.close()
