"""The whole path under failures: etcd, registry, two workers, router, gateway as real processes.

Asserts states and outcomes (which replica served, which requests failed), never speeds.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import signal
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import pytest

from tests.integration.conftest import ServiceProcess, plane, start_service, wait_for
from tests.integration.test_membership import replicas
from tokenfleet.cli.launcher import register_model
from tokenfleet.cluster.etcd_server import EtcdServer

MODEL = "smol"
REPLICA_HEADER = "x-tokenfleet-replica"


@dataclass
class Fleet:
    etcd: EtcdServer
    workers: dict[str, ServiceProcess]  # replica id -> process
    router: ServiceProcess
    gateway: ServiceProcess
    others: list[ServiceProcess]
    start_worker: Callable[[str], ServiceProcess]

    @property
    def url(self) -> str:
        return f"http://{self.gateway.address}"


@pytest.fixture
def fleet(default_model_dir):
    etcd = EtcdServer.create().start()
    started: list[ServiceProcess] = []

    def start(module: str, *args: str) -> ServiceProcess:
        started.append(start_service(module, *args))
        return started[-1]

    try:
        registry = start("tokenfleet.services.registry", "--etcd", etcd.endpoint)
        register_model(registry.address, MODEL, str(default_model_dir), plane("operator"), dtype="float32")
        def start_worker(rid: str) -> ServiceProcess:
            return start("tokenfleet.services.decode", "--registry", registry.address, "--model-name", MODEL,
                         "--etcd", etcd.endpoint, "--replica-id", rid, "--lease-ttl", "2", "--threads", "1",
                         "--num-blocks", "128")

        workers = {rid: start_worker(rid) for rid in ("w0", "w1")}
        router = start("tokenfleet.services.router", "--etcd", etcd.endpoint)
        gateway = start("tokenfleet.services.gateway", "--router", router.address, "--registry", registry.address,
                        "--grace-seconds", "60", "--metrics-port", "0")
        fleet = Fleet(etcd, workers, router, gateway, [registry], start_worker)
        wait_for(lambda: len(replicas(etcd.endpoint)) == 2, "both workers registered")
        wait_for(lambda: complete(fleet.url)[0] == 200, "gateway serving", 120)
        yield fleet
    finally:
        for service in reversed(started):
            if service.proc.poll() is None:
                service.proc.kill()
            service.proc.wait(timeout=30)
        etcd.cleanup()


def complete(url: str, max_tokens: int = 4, prompt: str = "The capital of France is") -> tuple[int, str, dict]:
    """(status, replica that served it, body) of one non-streamed completion."""
    body = json.dumps({"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}).encode()
    request = urllib.request.Request(f"{url}/v1/completions", data=body, headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            return response.status, response.headers.get(REPLICA_HEADER, ""), json.loads(response.read())
    except urllib.error.HTTPError as e:
        return e.code, e.headers.get(REPLICA_HEADER, ""), json.loads(e.read() or b"{}")
    except OSError as e:
        return 0, "", {"error": str(e)}


class Load:
    """Sequential requests from a background thread, each recorded with its start and end time."""

    def __init__(self, url: str):
        self.url = url
        self.results: list[tuple[float, float, int, str]] = []  # (start, end, status, replica)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Load:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=180)

    def _run(self) -> None:
        while not self._stop.is_set():
            start = time.monotonic()
            status, replica, _ = complete(self.url, max_tokens=6)
            self.results.append((start, time.monotonic(), status, replica))

    def successes_since(self, t: float, replica: str | None = None) -> int:
        return sum(1 for s, _, status, r in self.results if s > t and status == 200 and replica in (None, r))


def burst(url: str, n: int = 8) -> list[tuple[int, str, dict]]:
    with ThreadPoolExecutor(n) as pool:
        return list(pool.map(lambda _: complete(url, max_tokens=8), range(n)))


def test_requests_spread_and_a_killed_worker_costs_no_request(fleet):
    results = burst(fleet.url)
    assert all(status == 200 for status, _, _ in results)
    assert {replica for _, replica, _ in results} == {"w0", "w1"}  # spread over both

    with Load(fleet.url) as load:
        wait_for(lambda: load.successes_since(0) >= 3, "load running")
        killed = time.monotonic()
        fleet.workers["w0"].proc.kill()  # kill -9: no drain, no deregistration
        wait_for(lambda: "replicas/smol/w0" not in replicas(fleet.etcd.endpoint), "w0's lease expired", 60)
        expired = time.monotonic()
        wait_for(lambda: load.successes_since(expired, "w1") >= 3, "requests served by w1 after expiry", 120)

    failed = [(start, status, replica) for start, _, status, replica in load.results if status != 200]
    # The request on w0 when it died was continued on w1 (resumed, or placed again before its first token).
    assert not failed, failed
    after = [(status, replica) for start, _, status, replica in load.results if start > killed + 0.5]
    assert after and all(status == 200 and replica == "w1" for status, replica in after)

    fleet.workers["w0"] = fleet.start_worker("w0")  # restarts under the same replica id: registers cleanly
    wait_for(lambda: {replica for status, replica, _ in burst(fleet.url) if status == 200} == {"w0", "w1"},
             "the restarted worker takes requests again", 120)
    time.sleep(3)  # longer than the old lease's TTL: its expiry must not remove the new registration
    assert set(replicas(fleet.etcd.endpoint)) == {"replicas/smol/w0", "replicas/smol/w1"}


def test_etcd_outage_costs_no_request_and_membership_converges(fleet):
    with Load(fleet.url) as load:
        wait_for(lambda: load.successes_since(0) >= 2, "load running")
        fleet.etcd.stop()
        down = time.monotonic()
        time.sleep(5)
        fleet.etcd.start()
        wait_for(lambda: load.successes_since(down + 5) >= 3, "requests after etcd returned", 120)
    assert load.successes_since(down) >= 3 and all(status == 200 for _, _, status, _ in load.results), load.results
    wait_for(lambda: set(replicas(fleet.etcd.endpoint)) == {"replicas/smol/w0", "replicas/smol/w1"},
             "both workers registered again", 60)
    wait_for(lambda: {replica for status, replica, _ in burst(fleet.url) if status == 200} == {"w0", "w1"},
             "the router places on both workers again", 120)


def _stream(url: str, max_tokens: int = 48) -> tuple[http.client.HTTPConnection, http.client.HTTPResponse]:
    """An open streamed completion (ignore_eos, usage at the end)."""
    conn = http.client.HTTPConnection(url.removeprefix("http://"), timeout=120)
    body = {"model": MODEL, "prompt": "Count slowly:", "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    conn.request("POST", "/v1/completions", json.dumps(body), {"content-type": "application/json"})
    return conn, conn.getresponse()


def _lines(response: http.client.HTTPResponse):  # type: ignore[no-untyped-def]
    while line := response.readline():
        yield line.decode().rstrip("\n")


def _read_events(lines) -> list[dict | str]:  # type: ignore[no-untyped-def]
    events: list[dict | str] = []
    for line in lines:
        if line.startswith("data: "):
            data = line.removeprefix("data: ")
            events.append(data if data == "[DONE]" else json.loads(data))
    return events


def _check_complete(events: list[dict | str], max_tokens: int) -> None:
    assert events[-1] == "[DONE]"
    usage = [e["usage"] for e in events if isinstance(e, dict) and e.get("usage")]
    assert usage and usage[-1]["completion_tokens"] == max_tokens
    finish = [c["finish_reason"] for e in events if isinstance(e, dict) for c in e["choices"] if c["finish_reason"]]
    assert finish == ["length"]


def test_sigterm_worker_mid_stream_finishes_the_stream_then_exits(fleet):
    conn, response = _stream(fleet.url)
    with contextlib.closing(conn):
        assert response.status == 200
        serving = response.headers[REPLICA_HEADER]
        other = ({"w0", "w1"} - {serving}).pop()
        lines = _lines(response)
        head = [next(lines) for _ in range(6)]  # tokens are flowing
        fleet.workers[serving].proc.send_signal(signal.SIGTERM)
        wait_for(lambda: replicas(fleet.etcd.endpoint)[f"replicas/smol/{serving}"].state == "draining",
                 "worker marked draining", 30)
        assert all(replica == other and status == 200 for status, replica, _ in burst(fleet.url, 3))
        events = _read_events(head + list(lines))
    _check_complete(events, 48)
    assert fleet.workers[serving].proc.wait(timeout=60) == 0
    wait_for(lambda: f"replicas/smol/{serving}" not in replicas(fleet.etcd.endpoint), "deregistered", 30)


def test_sigterm_gateway_mid_stream_finishes_the_stream_then_exits(fleet):
    conn, response = _stream(fleet.url)
    with contextlib.closing(conn):
        lines = _lines(response)
        head = [next(lines) for _ in range(6)]
        fleet.gateway.proc.send_signal(signal.SIGTERM)
        events = _read_events(head + list(lines))
    _check_complete(events, 48)
    assert fleet.gateway.proc.wait(timeout=60) == 0
    assert complete(fleet.url)[0] == 0  # no longer accepting connections
