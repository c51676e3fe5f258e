"""OpenTelemetry traces: one trace per request across gateway -> router -> decode worker -> prefill worker.

Off by default. ``TOKENFLEET_TRACING=1`` turns it on in every process that inherits the environment (`tokenfleet up
--tracing` sets it); the SDK is imported only then. Settings:

- ``TOKENFLEET_TRACE_SAMPLE``: the share of requests traced (0..1, default 1). The gateway decides; every later hop
  follows its parent's decision (``ParentBased``), so a trace is whole or absent.
- ``TOKENFLEET_TRACE_CONTENT=1``: prompts and completions go into spans (``gen_ai.prompt`` /
  ``gen_ai.completion`` events). Never without it.
- The OTLP/HTTP exporter's own variables: ``OTEL_EXPORTER_OTLP_ENDPOINT`` (default ``http://localhost:4318``),
  ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``, ``OTEL_BSP_SCHEDULE_DELAY``...

Context crosses hops in gRPC metadata as W3C ``traceparent`` (``Trace.metadata()`` on the client side, beside the request
id; ``server_span()`` on the server side, in ``services.common.errors.map_errors``, which every handler has). Span
attributes follow the OpenTelemetry GenAI semantic conventions (``gen_ai.*``) plus ours (``tokenfleet.*``).

With tracing off every function here is a cheap no-op: ``span()`` yields ``NO_SPAN``.
"""

from __future__ import annotations

import atexit
import contextlib
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from tokenfleet import envs

TRACEPARENT, TRACESTATE = "traceparent", "tracestate"

_tracer: Any = None  # an opentelemetry Tracer once setup() turned tracing on
_propagator: Any = None
_content = False


class _NoSpan:
    """What ``span()`` yields with tracing off (or for an unsampled request): every call does nothing."""

    def set_attribute(self, key: str, value: Any) -> None:
        pass

    def set_attributes(self, attributes: Mapping[str, Any]) -> None:
        pass

    def add_event(self, name: str, attributes: Mapping[str, Any] | None = None) -> None:
        pass

    def update_name(self, name: str) -> None:
        pass

    def is_recording(self) -> bool:
        return False


NO_SPAN = _NoSpan()


def setup(service: str, environ: Mapping[str, str] | None = None) -> bool:
    """Turn tracing on for this process when the environment asks (``TOKENFLEET_TRACING``): a tracer provider
    named ``tokenfleet-<service>``, sampled by ratio at the root, exporting OTLP/HTTP in batches (flushed at exit).
    Returns whether tracing is on."""
    global _tracer, _propagator, _content
    if not envs.tracing(environ):
        return False
    ratio = envs.trace_sample(environ)
    if not 0.0 <= ratio <= 1.0:
        raise ValueError(f"{envs.TRACE_SAMPLE} must be between 0 and 1, got {ratio}")
    from opentelemetry import trace
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor
    from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    provider = TracerProvider(resource=Resource.create({"service.name": f"tokenfleet-{service}",
                                                        "service.namespace": "tokenfleet"}),
                              sampler=ParentBased(TraceIdRatioBased(ratio)))
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    atexit.register(provider.shutdown)  # the last batch goes out before the process ends
    _tracer = provider.get_tracer("tokenfleet")
    _propagator = TraceContextTextMapPropagator()
    _content = envs.trace_content(environ)
    trace.set_tracer_provider(provider)
    return True


def enabled() -> bool:
    return _tracer is not None


def record_content() -> bool:
    """Whether prompts and completions may go into spans (``TOKENFLEET_TRACE_CONTENT``; off by default)."""
    return _tracer is not None and _content


@contextlib.contextmanager
def span(name: str, kind: str = "internal", attributes: Mapping[str, Any] | None = None,
         parent: Sequence[tuple[str, Any]] | None = None) -> Iterator[Any]:
    """A span around the block, child of the current one, or of the trace context in ``parent`` (gRPC metadata)
    when given. An exception leaving the block is recorded on it and sets its status to error."""
    if _tracer is None:
        yield NO_SPAN
        return
    from opentelemetry.trace import SpanKind

    context = _extract(parent) if parent is not None else None
    with _tracer.start_as_current_span(name, context=context, kind=getattr(SpanKind, kind.upper()),
                                       attributes=_clean(attributes)) as current:
        yield current


def current() -> Any:
    """The active span (``NO_SPAN`` with tracing off)."""
    if _tracer is None:
        return NO_SPAN
    from opentelemetry import trace

    return trace.get_current_span()


def _extract(metadata: Sequence[tuple[str, Any]]) -> Any:
    carrier = {k: v for k, v in metadata if k in (TRACEPARENT, TRACESTATE) and isinstance(v, str)}
    return _propagator.extract(carrier) if carrier else None


def server_span(name: str, metadata: Sequence[tuple[str, Any]] | None,
                attributes: Mapping[str, Any] | None = None) -> contextlib.AbstractContextManager[Any]:
    """A gRPC handler's span, child of the caller's (``traceparent`` in its metadata). A call without trace context
    (a Load stream, an operator's RPC, an untraced request) gets no span: traces begin at the gateway."""
    items = tuple(metadata or ())
    if _tracer is None or not any(k == TRACEPARENT for k, _ in items):
        return contextlib.nullcontext(NO_SPAN)
    return span(name, "server", attributes, parent=items)


def _clean(attributes: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """Attributes OpenTelemetry accepts: no None values, sequences as tuples."""
    if not attributes:
        return None
    out: dict[str, Any] = {}
    for k, v in attributes.items():
        if v is None:
            continue
        out[k] = tuple(v) if isinstance(v, list) else v
    return out


def record_error(target: Any, exc: BaseException) -> None:
    """Mark a span (or ``NO_SPAN``) failed with ``exc``."""
    if not target.is_recording():
        return
    from opentelemetry.trace import Status, StatusCode

    target.record_exception(exc)
    target.set_status(Status(StatusCode.ERROR, f"{type(exc).__name__}: {exc}"[:300]))


def set_attributes(target: Any, attributes: Mapping[str, Any]) -> None:
    """Set ``attributes`` (None values skipped) on a span or ``NO_SPAN``."""
    cleaned = _clean(attributes)
    if cleaned:
        target.set_attributes(cleaned)


class Trace:
    """A span started and ended by hand, for work that outlives one block (a streamed response: the gateway's
    request span ends with the stream). ``child()`` spans hang under it whatever the current context is, and
    ``metadata()`` carries it to the next hop. Inert with tracing off."""

    def __init__(self, span: Any = None):
        self.span: Any = span if span is not None else NO_SPAN
        self._ended = span is None

    @classmethod
    def start(cls, name: str, kind: str = "server", attributes: Mapping[str, Any] | None = None,
              parent: Any = None) -> Trace:
        """``parent``: a Trace or a span (e.g. ``current()`` captured where the work was asked for); None: a root
        span, sampled by ratio."""
        if _tracer is None:
            return cls()
        from opentelemetry.trace import SpanKind, set_span_in_context

        parent_span = parent.span if isinstance(parent, Trace) else parent
        if parent is not None and not (parent_span is not None and parent_span.is_recording()):
            return cls()  # the request is not traced (unsampled): nor is its part here
        context = set_span_in_context(parent_span) if parent_span is not None else None
        return cls(_tracer.start_span(name, context=context, kind=getattr(SpanKind, kind.upper()),
                                      attributes=_clean(attributes)))

    @property
    def recording(self) -> bool:
        return bool(self.span.is_recording())

    def child(self, name: str, kind: str = "internal", attributes: Mapping[str, Any] | None = None) -> Trace:
        return Trace.start(name, kind, attributes, parent=self) if self.recording else Trace()

    def set(self, **attributes: Any) -> None:
        if self.recording:
            set_attributes(self.span, attributes)

    def event(self, name: str, **attributes: Any) -> None:
        if self.recording:
            self.span.add_event(name, _clean(attributes))

    def rename(self, name: str) -> None:
        if self.recording:
            self.span.update_name(name)

    def metadata(self) -> tuple[tuple[str, str], ...]:
        """This span's trace context as gRPC metadata: the next hop's spans become its children."""
        if not self.recording:
            return ()
        from opentelemetry.trace import set_span_in_context

        carrier: dict[str, str] = {}
        _propagator.inject(carrier, context=set_span_in_context(self.span))
        return tuple((k, v) for k, v in carrier.items() if k in (TRACEPARENT, TRACESTATE))

    def end(self, error: BaseException | str | None = None) -> None:
        """End the span once (later calls do nothing); ``error`` marks it failed."""
        if self._ended:
            return
        self._ended = True
        if error is not None:
            from opentelemetry.trace import Status, StatusCode

            if isinstance(error, BaseException):
                self.span.record_exception(error)
            self.span.set_status(Status(StatusCode.ERROR, str(error)[:300]))
        self.span.end()
