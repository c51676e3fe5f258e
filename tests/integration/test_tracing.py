"""OpenTelemetry traces through a disaggregated `tokenfleet up --tracing` cluster.

Every service exports OTLP/HTTP (the real SDK and exporter) to a receiver this test runs: an HTTP server that
decodes `ExportTraceServiceRequest` protobufs as a collector would. One chat request with a long prompt (the
router sends its prefill to the prefill worker) must give one trace whose spans come from the gateway, the router,
the decode worker and the prefill worker, with the KV transfer as a span, all parented into one tree, and the
GenAI attributes set. Prompts are not in spans unless TOKENFLEET_TRACE_CONTENT is on."""

from __future__ import annotations

import io
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import openai
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2

from tests.integration.conftest import start_up, wait_for

LONG = ("You are the help desk of a hardware shop. Answer briefly and politely. The shop sells nails, screws, bolts, "
        "hinges, locks, paint, brushes, rollers, ladders, drills, saws, sanders, glue, tape and garden tools. It opens "
        "at eight and closes at six on weekdays, nine to four on Saturdays, and it is closed on Sundays. Deliveries "
        "take two days within the city and five days elsewhere. Returns are accepted within thirty days with a "
        "receipt. ") * 2


class Receiver(BaseHTTPRequestHandler):
    spans: list[dict] = []
    lock = threading.Lock()

    def do_POST(self):  # noqa: N802 - http.server's name
        body = self.rfile.read(int(self.headers["Content-Length"]))
        request = trace_service_pb2.ExportTraceServiceRequest.FromString(body)
        for resource_spans in request.resource_spans:
            service = next(a.value.string_value for a in resource_spans.resource.attributes if a.key == "service.name")
            for scope in resource_spans.scope_spans:
                for span in scope.spans:
                    with self.lock:
                        self.spans.append({"service": service, "name": span.name, "trace": span.trace_id.hex(),
                                           "id": span.span_id.hex(), "parent": span.parent_span_id.hex(),
                                           "attributes": {a.key: _value(a.value) for a in span.attributes},
                                           "events": [e.name for e in span.events]})
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.end_headers()
        self.wfile.write(trace_service_pb2.ExportTraceServiceResponse().SerializeToString())

    def log_message(self, *args):
        pass


def _value(v):
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [_value(x) for x in v.array_value.values]
    return getattr(v, kind)


def test_one_request_is_one_trace_across_every_service(default_model_dir, tmp_path):
    receiver = ThreadingHTTPServer(("127.0.0.1", 0), Receiver)
    threading.Thread(target=receiver.serve_forever, daemon=True).start()
    environment = {"OTEL_BSP_SCHEDULE_DELAY": "200", "TOKENFLEET_TRACE_CONTENT": ""}  # prompts stay out of spans
    up = start_up(tmp_path, "--workers", "1", "--prefill-workers", "1", "--threads", "1", "--model",
                  str(default_model_dir), "--model-name", "smol", "--tracing", "--otlp-endpoint",
                  f"http://127.0.0.1:{receiver.server_port}", env=environment)
    try:
        client = openai.OpenAI(base_url=up.announced["gateway:"], api_key="unused", max_retries=0, timeout=120)
        Receiver.spans.clear()  # the startup's own requests (warm-ups, the readiness check) are not this one
        reply = client.chat.completions.with_raw_response.create(
            model="smol", messages=[{"role": "system", "content": LONG}, {"role": "user", "content": "Do you sell nails?"}],
            max_tokens=6, temperature=0)
        request_id = reply.headers["x-request-id"]
        completion = reply.parse()
        assert completion.usage.completion_tokens == 6

        def ours():
            with Receiver.lock:
                roots = [s for s in Receiver.spans if s["attributes"].get("tokenfleet.request_id") == request_id]
                if not roots:
                    return None
                trace = [s for s in Receiver.spans if s["trace"] == roots[0]["trace"]]
            services = {s["service"] for s in trace}
            wanted = {"tokenfleet-gateway", "tokenfleet-router", "tokenfleet-worker-decode", "tokenfleet-worker-prefill"}
            ids = {s["id"] for s in trace}
            whole = all(not s["parent"] or s["parent"] in ids for s in trace)  # every parent exported too
            return trace if wanted <= services and any(s["name"] == "kv.transfer" for s in trace) and whole else None

        trace = wait_for(ours, "the request's spans from every service", 60)

        # a batch line is a trace of its own, named and attributed as the endpoint's
        line = {"custom_id": "t0", "method": "POST", "url": "/v1/chat/completions",
                "body": {"model": "smol", "max_tokens": 3, "messages": [{"role": "user", "content": "Hi"}]}}
        upload = client.files.create(file=("t.jsonl", io.BytesIO(json.dumps(line).encode() + b"\n")), purpose="batch")
        batch = client.batches.create(input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="1h")
        wait_for(lambda: client.batches.retrieve(batch.id).status == "completed", "the batch", 120)

        def batch_span():
            with Receiver.lock:
                return next((s for s in Receiver.spans if s["attributes"].get("tokenfleet.batch_id") == batch.id), None)

        line_span = wait_for(batch_span, "the batch line's span", 60)
        assert line_span["name"] == "chat smol" and line_span["attributes"]["gen_ai.usage.output_tokens"] == 3
        assert line_span["attributes"]["tokenfleet.tier"] == "batch"
    finally:
        up.stop()
        receiver.shutdown()
    by_name = {s["name"]: s for s in trace}
    ids = {s["id"]: s for s in trace}
    (root,) = [s for s in trace if not s["parent"]]  # one root: the gateway's (FastAPI's own HTTP span, or ours)
    assert root["service"] == "tokenfleet-gateway"
    for span in trace:  # one tree: every span reaches the root through spans of this trace
        seen = span
        while seen["parent"]:
            seen = ids[seen["parent"]]
        assert seen is root, span["name"]
    request = by_name["chat smol"]
    assert request["service"] == "tokenfleet-gateway"
    attrs = request["attributes"]
    assert attrs["gen_ai.operation.name"] == "chat" and attrs["gen_ai.system"] == "tokenfleet"
    assert attrs["gen_ai.request.model"] == "smol" and attrs["gen_ai.response.model"] == "smol"
    assert attrs["gen_ai.usage.input_tokens"] == completion.usage.prompt_tokens
    assert attrs["gen_ai.usage.output_tokens"] == 6 and attrs["gen_ai.response.finish_reasons"] == ["length"]
    assert attrs["tokenfleet.tenant"] and "first_token" in request["events"] and "admitted" in request["events"]
    # the tree: gateway -> router.pick -> Pick on the router; gateway -> worker.generate -> Generate on the decode
    # worker -> kv.transfer -> Prefill on the prefill worker
    parent = {s["name"]: ids[s["parent"]]["name"] if s["parent"] in ids else None for s in trace}
    assert parent["router.pick"] == "chat smol" and parent["tokenfleet.v1.RouterService/Pick"] == "router.pick"
    assert parent["worker.generate"] == "chat smol"
    assert parent["tokenfleet.v1.EngineService/Generate"] == "worker.generate"
    assert parent["kv.transfer"] == "tokenfleet.v1.EngineService/Generate"
    assert parent["tokenfleet.v1.EngineService/Prefill"] == "kv.transfer"
    assert by_name["tokenfleet.v1.RouterService/Pick"]["service"] == "tokenfleet-router"
    generate = by_name["tokenfleet.v1.EngineService/Generate"]
    assert generate["service"] == "tokenfleet-worker-decode"
    assert generate["attributes"]["tokenfleet.remote_prefill"] is True
    assert generate["attributes"]["gen_ai.usage.output_tokens"] == 6
    assert "tokenfleet.queue_wait_s" in generate["attributes"] and "tokenfleet.preemptions" in generate["attributes"]
    assert by_name["tokenfleet.v1.EngineService/Prefill"]["service"] == "tokenfleet-worker-prefill"
    assert by_name["kv.transfer"]["attributes"]["tokenfleet.kv_bytes"] > 0
    assert "prefill_computed" in by_name["tokenfleet.v1.EngineService/Prefill"]["events"]
    # no prompt or completion text anywhere without TOKENFLEET_TRACE_CONTENT
    assert not any("nails" in str(v) for s in trace for v in s["attributes"].values())
    assert not any(e.startswith("gen_ai.prompt") or e == "gen_ai.choice" for s in trace for e in s["events"])
