"""Tracing switches: off by default (no SDK work), sampled whole at the root, and no span for calls without context.

Each case runs in its own interpreter: OpenTelemetry's tracer provider is process-global."""

from __future__ import annotations

import subprocess
import sys

SCRIPT = """
import os, sys
from tokenfleet.telemetry import tracing
print(tracing.setup("gateway"))
root = tracing.Trace.start("chat m", "server", {"gen_ai.system": "tokenfleet"})
child = root.child("router.pick", "client")
print(root.recording, child.recording, dict(child.metadata()).get("traceparent", "")[:2] or "-")
with tracing.server_span("S/M", [("x-request-id", "r")]) as span:
    print(span is tracing.NO_SPAN)  # no traceparent in the call: no span
with tracing.server_span("S/M", child.metadata()) as span:
    print(span.is_recording() == child.recording)
root.end(); root.end()  # ending twice is harmless
"""


def run(env: dict[str, str]) -> list[str]:
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=60,
                         env={"PATH": "/usr/bin:/bin", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:9", **env})
    assert out.returncode == 0, out.stderr
    return out.stdout.split("\n")


def test_off_by_default_every_call_is_inert():
    assert run({})[:4] == ["False", "False False -", "True", "True"]


def test_on_a_sampled_request_carries_its_context_and_an_unsampled_one_nothing():
    assert run({"TOKENFLEET_TRACING": "1"})[:4] == ["True", "True True 00", "True", "True"]
    assert run({"TOKENFLEET_TRACING": "1", "TOKENFLEET_TRACE_SAMPLE": "0"})[:4] == ["True", "False False -", "True",
                                                                                    "True"]
