"""kill -9 of the decode worker mid-stream: the gateway continues the request on another
replica (prompt + tokens already streamed re-prefilled there) and the client sees one
uninterrupted stream, identical to an undisturbed greedy run; with no resumes left it gets a
clear error event instead of a cut connection."""

from __future__ import annotations

import contextlib
import urllib.request

from tests.integration.conftest import start_service
from tests.integration.test_fleet import REPLICA_HEADER, _check_complete, _lines, _read_events, _stream
from tests.integration.test_fleet import fleet as fleet  # noqa: F401 - the fixture

MAX_TOKENS = 64


def text_of(events: list) -> str:
    return "".join(c["text"] for e in events if isinstance(e, dict) for c in e.get("choices", ()))


def metric(url: str, name: str) -> float:
    with urllib.request.urlopen(f"{url}/metrics", timeout=30) as response:
        for line in response.read().decode().splitlines():
            if line.startswith(name + " ") or line.startswith(name + "{"):
                return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_kill_9_of_the_decode_worker_mid_stream_continues_elsewhere_with_identical_text(fleet):  # noqa: F811
    conn, response = _stream(fleet.url, MAX_TOKENS)
    with contextlib.closing(conn):
        undisturbed = _read_events(_lines(response))
    _check_complete(undisturbed, MAX_TOKENS)

    conn, response = _stream(fleet.url, MAX_TOKENS)
    with contextlib.closing(conn):
        serving = response.headers[REPLICA_HEADER]
        lines = _lines(response)
        head = [next(lines) for _ in range(12)]  # six token events have reached us
        fleet.workers[serving].proc.kill()  # no drain, no deregistration
        events = _read_events(head + list(lines))
    _check_complete(events, MAX_TOKENS)  # usage counts every token, finish_reason once, [DONE]
    assert text_of(events) == text_of(undisturbed)
    assert metric(fleet.url, 'tokenfleet_gateway_resumes_total{result="ok"}') == 1


def test_with_no_resumes_left_the_stream_ends_with_an_error_event(fleet):  # noqa: F811
    gateway = start_service("tokenfleet.services.gateway", "--router", fleet.router.address, "--registry",
                            fleet.others[0].address, "--max-resumes", "0")
    try:
        url = f"http://{gateway.address}"
        conn, response = _stream(url, MAX_TOKENS)
        with contextlib.closing(conn):
            serving = response.headers[REPLICA_HEADER]
            lines = _lines(response)
            head = [next(lines) for _ in range(6)]
            fleet.workers[serving].proc.kill()
            events = _read_events(head + list(lines))
        assert "[DONE]" not in events
        error = events[-1]["error"]
        assert error["code"] == "replica_lost" and "mid-stream" in error["message"]
        assert metric(url, 'tokenfleet_gateway_resumes_total{result="exhausted"}') == 1
    finally:
        gateway.stop()
