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


GRPC_SCRIPT = """
import asyncio
from opentelemetry import trace
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from tokenfleet.telemetry import tracing
from tokenfleet.services.gateway.catalog import ModelCatalog
from tokenfleet.services.gateway.grpc_api import CHAT, InferenceAPI
from tokenfleet.services.gateway.pipeline import Gateway
from tokenfleet.api.openai_schema import APIError
from tokenfleet.tenancy.admission import Admission
from tokenfleet.tenancy.tenants import Directory

tracing.setup("gateway")
exporter = InMemorySpanExporter()
trace.get_tracer_provider().add_span_processor(SimpleSpanProcessor(exporter))

class Context:
    def invocation_metadata(self):
        return (("x-request-id", "req-grpc-1"),)
    def peer(self):
        return "ipv4:127.0.0.1:1"

async def main():
    api = InferenceAPI(Gateway(["127.0.0.1:1"], ModelCatalog(), admission=Admission(Directory())))
    try:
        async for _ in api._serve(Context(), CHAT, None, chat=True):
            print("a chunk")
    except APIError as e:
        print(e.status)
    else:
        print("no error")

asyncio.run(main())
for span in exporter.get_finished_spans():
    a = span.attributes
    print(span.name, a.get("tokenfleet.request_id"), a.get("gen_ai.operation.name"), a.get("rpc.grpc.status_code"),
          a.get("error.type"), span.status.status_code.name)
"""


def test_the_public_grpc_api_starts_the_request_span_too():
    out = subprocess.run([sys.executable, "-c", GRPC_SCRIPT], capture_output=True, text=True, timeout=60,
                         env={"PATH": "/usr/bin:/bin", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:9",
                              "TOKENFLEET_TRACING": "1"})
    assert out.returncode == 0, out.stderr
    # no API key: 401 (UNAUTHENTICATED, 16), and the request's span ended with the error
    lines = [line for line in out.stdout.split("\n") if line and "authentication failed" not in line]  # the log line
    assert lines == ["401", "chat req-grpc-1 chat 16 invalid_api_key ERROR"]
