"""OpenTelemetry tracing of requests across processes (docs/observability.md#tracing).

Off unless `--otlp-traces-endpoint` or the standard `OTEL_*` variables ask for it; off, every helper
here is a check of one module global and the SDK is never imported. On, each process (gateway,
router, workers) has a tracer provider exporting in batches from a background thread, and the
context travels between processes as a W3C `traceparent` in gRPC metadata (HTTP header at the
gateway).

The endpoint is an OTLP/gRPC collector (`http://host:4317`) or a file (`file:///path/traces.jsonl`):
one JSON object per span and line, appended, so every process of a stack can share one file
(`tandem trace FILE` prints a request's timeline from it).

Engine-side phases are not traced on the engine thread: it keeps cheap `time.monotonic()` stamps and
the asyncio side emits the spans afterwards with explicit times (`record`).

The environment is read in `settings_from_env` only, called from each entry point's `configure`.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import threading
import time
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass

TRACEPARENT = "traceparent"
FILE_SCHEME = "file://"

_tracer = None           # the SDK tracer while tracing is on; None: off
_provider = None


@dataclass(frozen=True)
class TraceSettings:
    endpoint: str = ""             # "" off; file:///path or an OTLP/gRPC address
    service_name: str = "tandem"

    @property
    def enabled(self) -> bool:
        return bool(self.endpoint)


def settings_from_env(endpoint: str, service_name: str, env: Mapping[str, str] | None = None) -> TraceSettings:
    """The flag wins; else OTEL_EXPORTER_OTLP_TRACES_ENDPOINT, OTEL_EXPORTER_OTLP_ENDPOINT, or
    OTEL_TRACES_EXPORTER=otlp alone (the collector's default address). OTEL_SDK_DISABLED=true or
    OTEL_TRACES_EXPORTER=none turn it off; OTEL_SERVICE_NAME renames the process."""
    env = os.environ if env is None else env
    name = env.get("OTEL_SERVICE_NAME") or service_name
    exporter = env.get("OTEL_TRACES_EXPORTER", "").strip().lower()
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true" or exporter == "none":
        return TraceSettings("", name)
    if not endpoint:
        endpoint = env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or env.get("OTEL_EXPORTER_OTLP_ENDPOINT") or ""
        if not endpoint and exporter == "otlp":
            endpoint = "http://localhost:4317"
    return TraceSettings(endpoint, name)


def configure(endpoint: str, service_name: str, env: Mapping[str, str] | None = None) -> bool:
    """Turn tracing on for this process if asked (a process's entry point calls it once). Returns
    whether it is on."""
    settings = settings_from_env(endpoint, service_name, env)
    if not settings.enabled:
        return False
    if settings.endpoint.startswith(FILE_SCHEME):
        exporter = JsonLinesExporter(settings.endpoint[len(FILE_SCHEME):])
    else:
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        exporter = OTLPSpanExporter(endpoint=settings.endpoint,
                                    insecure=not settings.endpoint.startswith("https://"))
    install(exporter, settings.service_name)
    atexit.register(shutdown)   # the last batch reaches the file or collector on a normal exit
    return True


def install(exporter, service_name: str) -> None:
    """Trace to `exporter` (an SDK SpanExporter; tests pass the in-memory one)."""
    global _tracer, _provider
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
    # A short delay: spans reach the file (or collector) about a second after they end.
    provider.add_span_processor(BatchSpanProcessor(exporter, schedule_delay_millis=500))
    _provider, _tracer = provider, provider.get_tracer("tandem")


def shutdown() -> None:
    """Flush and stop (idempotent); a process's exit path calls it."""
    global _tracer, _provider
    if _provider is not None:
        _provider.shutdown()
    _tracer = _provider = None


def flush() -> None:
    if _provider is not None:
        _provider.force_flush()


def enabled() -> bool:
    return _tracer is not None


# ---- spans -------------------------------------------------------------------------------------


def _ns(monotonic_s: float) -> int:
    """A time.monotonic() stamp as the epoch nanoseconds spans carry."""
    return time.time_ns() - int((time.monotonic() - monotonic_s) * 1e9)


def extract(carrier: Iterable[tuple[str, str | bytes]] | Mapping[str, str] | None):
    """The remote parent in gRPC metadata or HTTP headers (None: off or none sent)."""
    if _tracer is None or carrier is None:
        return None
    items = carrier.items() if isinstance(carrier, Mapping) else carrier
    value = next((v for k, v in items if k == TRACEPARENT), None)
    if not value:
        return None
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    return TraceContextTextMapPropagator().extract({TRACEPARENT: value if isinstance(value, str) else value.decode()})


def start(name: str, parent=None, attributes: Mapping | None = None, start_s: float | None = None,
          server: bool = False):
    """A started span (None when off). `parent`: a context from `extract`, a span, or None (the current
    one); `start_s`: a time.monotonic() stamp."""
    if _tracer is None:
        return None
    from opentelemetry import trace

    if parent is not None and not isinstance(parent, dict):   # a span, not a Context
        parent = trace.set_span_in_context(parent)
    kind = trace.SpanKind.SERVER if server else trace.SpanKind.INTERNAL
    return _tracer.start_span(name, context=parent, kind=kind, attributes=attributes,
                              start_time=None if start_s is None else _ns(start_s))


def end(span, attributes: Mapping | None = None, error: str | None = None, end_s: float | None = None) -> None:
    if span is None:
        return
    if attributes:
        span.set_attributes(attributes)
    if error:
        from opentelemetry.trace import Status, StatusCode

        span.set_status(Status(StatusCode.ERROR, error))
    span.end(None if end_s is None else _ns(end_s))


def record(name: str, parent, start_s: float | None, end_s: float | None, attributes: Mapping | None = None) -> None:
    """A finished span from two time.monotonic() stamps taken elsewhere (the engine thread); nothing
    when off or when either stamp is missing."""
    if _tracer is None or start_s is None or end_s is None or parent is None:
        return
    end(start(name, parent, attributes, start_s), end_s=max(start_s, end_s))


def event(span, name: str, attributes: Mapping | None = None) -> None:
    if span is not None:
        span.add_event(name, attributes)


@contextlib.contextmanager
def current(span) -> Iterator[None]:
    """Make `span` the parent of what starts inside (and of `outgoing()`), without ending it."""
    if span is None:
        yield
        return
    from opentelemetry import context, trace

    token = context.attach(trace.set_span_in_context(span))
    try:
        yield
    finally:
        context.detach(token)


def outgoing(span=None) -> tuple[tuple[str, str], ...] | None:
    """gRPC metadata carrying `span` (default: the current span) to the next process; None when off."""
    if _tracer is None:
        return None
    from opentelemetry import trace

    ctx = (span or trace.get_current_span()).get_span_context()
    if not ctx.is_valid:
        return None
    return ((TRACEPARENT, f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-{int(ctx.trace_flags):02x}"),)


# ---- the file exporter -------------------------------------------------------------------------


def span_to_json(span) -> dict:
    """One finished SDK span as the file exporter writes it."""
    ctx, parent = span.context, span.parent
    return {
        "trace_id": f"{ctx.trace_id:032x}", "span_id": f"{ctx.span_id:016x}",
        "parent_id": f"{parent.span_id:016x}" if parent is not None else None,
        "name": span.name, "service": span.resource.attributes.get("service.name", ""),
        "start_ns": span.start_time, "end_ns": span.end_time,
        "status": span.status.status_code.name, "attributes": dict(span.attributes or {}),
        "events": [{"name": e.name, "time_ns": e.timestamp, "attributes": dict(e.attributes or {})}
                   for e in span.events],
    }


class JsonLinesExporter:
    """Appends finished spans to a file, one JSON object per line; every line goes out in one
    O_APPEND write, so the processes of a stack can share the file."""

    def __init__(self, path: str):
        self.path = path
        self._lock = threading.Lock()
        self._fd: int | None = None

    def export(self, spans):
        from opentelemetry.sdk.trace.export import SpanExportResult

        data = "".join(json.dumps(span_to_json(s), default=str) + "\n" for s in spans).encode()
        with self._lock:
            if self._fd is None:
                os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
                self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            os.write(self._fd, data)
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        with self._lock:
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True
