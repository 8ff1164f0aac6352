"""OpenTelemetry traces, switched on only by the standard OTEL_* environment variables.

On when `OTEL_TRACES_EXPORTER` names an exporter (`otlp`, `console`), or, with it unset, when
`OTEL_EXPORTER_OTLP_ENDPOINT` / `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT` is set; off otherwise, and always off with
`OTEL_SDK_DISABLED=true` or `OTEL_TRACES_EXPORTER=none`. Everything else (sampler, batch delays, headers, TLS,
service name, resource attributes) is the SDK's own reading of the standard variables. OTLP goes over gRPC.

Off, no OpenTelemetry module is imported: `start` returns the shared `NO_SPAN`, whose methods do nothing and whose
carriers are empty, so a request pays a few attribute lookups for being untraced.

Spans are passed explicitly (parent=a Span, or a W3C carrier received from another process) and never attached
to OpenTelemetry's implicit context: the router's spans live inside async generators, which may be finalised in
another task, where detaching an attached context fails. The one implicit piece is `current()`: the span of the
request a router task is serving, set by `request()` at the start of the RPC.

Timestamps are this module's clock: `time.monotonic()` seconds (what the services measure durations with),
converted to wall-clock nanoseconds once, at export.
"""

from __future__ import annotations

import contextvars
import logging
import os
import time
from collections.abc import Mapping
from typing import Any

log = logging.getLogger(__name__)

REQUEST_ID_KEY = "x-request-id"  # also the gRPC metadata key the router's clients send
REQUEST_ID_ATTRIBUTE = "kimiserve.request_id"
EXPORTERS = ("otlp", "console")
_KINDS = ("internal", "server", "client")


class TracingConfigError(ValueError):
    """The OTEL_* environment asks for something this build cannot do (an unknown exporter, OTLP over HTTP)."""


def exporters_wanted(env: Mapping[str, str] = os.environ) -> list[str]:
    """The exporters the environment asks for; [] means tracing stays off. Raises TracingConfigError."""
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return []
    named = [e.strip().lower() for e in env.get("OTEL_TRACES_EXPORTER", "").split(",") if e.strip()]
    if not named:
        endpoint = env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or env.get("OTEL_EXPORTER_OTLP_ENDPOINT")
        named = ["otlp"] if endpoint else []
    if named == ["none"]:
        return []
    unknown = [e for e in named if e not in EXPORTERS]
    if unknown:
        raise TracingConfigError(f"OTEL_TRACES_EXPORTER={env.get('OTEL_TRACES_EXPORTER')!r}: unknown exporter(s) "
                                 f"{unknown}; kimiserve exports traces with {list(EXPORTERS)} or 'none'")
    protocol = env.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or env.get("OTEL_EXPORTER_OTLP_PROTOCOL") or "grpc"
    if "otlp" in named and protocol != "grpc":
        raise TracingConfigError(f"OTLP protocol {protocol!r} (OTEL_EXPORTER_OTLP_[TRACES_]PROTOCOL) is not "
                                 "supported: kimiserve exports OTLP over gRPC only ('grpc')")
    return named


class _Tracing:
    """What setup() built: the tracer and the propagator. None while tracing is off."""

    tracer: Any = None
    propagator: Any = None
    provider: Any = None
    wall_offset_ns: int = 0  # wall-clock ns = monotonic s * 1e9 + this


_state = _Tracing()


def enabled() -> bool:
    return _state.tracer is not None


def setup_or_exit(service: str) -> None:
    """setup() at a service's start; a bad OTEL_* setting is the user's mistake: SystemExit with one line naming the
    service and the setting, no traceback."""
    try:
        setup(service)  # on only when the OTEL_* environment asks for traces
    except TracingConfigError as e:
        raise SystemExit(f"{service}: {e}") from e


def setup(service: str, env: Mapping[str, str] = os.environ) -> bool:
    """Called once at a service's start. Builds the SDK's tracer provider when the environment asks for traces
    (the service name defaults to `kimiserve-<service>`; OTEL_SERVICE_NAME overrides it). Returns whether on."""
    exporters = exporters_wanted(env)
    if not exporters:
        return False
    from opentelemetry.sdk.resources import SERVICE_NAME, Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    attributes = {} if env.get("OTEL_SERVICE_NAME") else {SERVICE_NAME: f"kimiserve-{service}"}
    provider = TracerProvider(resource=Resource.create(attributes))  # sampler: OTEL_TRACES_SAMPLER, parent-based
    for name in exporters:
        if name == "otlp":
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

            provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))  # OTEL_EXPORTER_OTLP_* settings
        else:
            provider.add_span_processor(BatchSpanProcessor(ConsoleSpanExporter()))
    _state.provider = provider
    _state.tracer = provider.get_tracer("kimiserve")
    _state.propagator = TraceContextTextMapPropagator()
    _state.wall_offset_ns = time.time_ns() - time.monotonic_ns()
    log.info("tracing on", extra={"exporters": exporters, "service": service,
                                  "endpoint": env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
                                  or env.get("OTEL_EXPORTER_OTLP_ENDPOINT", "")})
    return True


def shutdown() -> None:
    """Exports what is buffered and stops (the provider also does this at interpreter exit)."""
    if _state.provider is not None:
        _state.provider.shutdown()
    _state.tracer = _state.propagator = _state.provider = None


def _wall_ns(monotonic_s: float | None) -> int | None:
    return None if monotonic_s is None else int(monotonic_s * 1e9) + _state.wall_offset_ns


class NoSpan:
    """The span of an untraced request: every method is a no-op and every carrier is empty."""

    __slots__ = ()

    def child(self, name: str, start_s: float | None = None, kind: str = "internal", **attributes: Any) -> NoSpan:
        return self

    def set(self, key: str, value: Any) -> None:
        pass

    def rename(self, name: str) -> None:
        pass

    def fail(self, message: str) -> None:
        pass

    def end(self, at_s: float | None = None) -> None:
        pass

    def carrier(self) -> dict[str, str]:
        return {}

    def metadata(self) -> tuple[tuple[str, str], ...]:
        return ()

    def __enter__(self) -> NoSpan:
        return self

    def __exit__(self, *exc: object) -> None:
        pass


NO_SPAN = NoSpan()


class Span:
    """One recording span. Children inherit its request id; `carrier()` is its W3C context for another process."""

    __slots__ = ("_span", "request_id")

    def __init__(self, span: Any, request_id: str | None):
        self._span, self.request_id = span, request_id

    def child(self, name: str, start_s: float | None = None, kind: str = "internal", **attributes: Any) -> Span:
        from opentelemetry import trace

        return _start(name, trace.set_span_in_context(self._span), kind, start_s, self.request_id, attributes)

    def set(self, key: str, value: Any) -> None:
        if key == "request_id":
            self.request_id, key = value, REQUEST_ID_ATTRIBUTE
        self._span.set_attribute(key, value)

    def rename(self, name: str) -> None:
        """For a span whose name is known only after it started (an HTTP request's route, once routed)."""
        self._span.update_name(name)

    def fail(self, message: str) -> None:
        from opentelemetry.trace import Status, StatusCode

        self._span.set_status(Status(StatusCode.ERROR, message))

    def end(self, at_s: float | None = None) -> None:
        self._span.end(end_time=_wall_ns(at_s))

    def carrier(self) -> dict[str, str]:
        from opentelemetry import trace

        out: dict[str, str] = {}
        _state.propagator.inject(out, context=trace.set_span_in_context(self._span))
        return out

    def metadata(self) -> tuple[tuple[str, str], ...]:
        """gRPC metadata for a call made inside this span: its trace context and the request id."""
        pairs = tuple(self.carrier().items())
        return pairs + ((REQUEST_ID_KEY, self.request_id),) if self.request_id else pairs

    def __enter__(self) -> Span:
        return self

    def __exit__(self, exc_type: type | None, exc: BaseException | None, tb: object) -> None:
        if exc is not None:
            self.fail(f"{exc_type.__name__}: {exc}")
        self.end()


def _start(name: str, parent_context: Any, kind: str, start_s: float | None, request_id: str | None,
           attributes: Mapping[str, Any]) -> Span:
    from opentelemetry.trace import SpanKind

    if kind not in _KINDS:
        raise ValueError(f"span kind {kind!r}; expected one of {_KINDS}")
    attrs = {k: v for k, v in attributes.items() if v is not None}
    if request_id:
        attrs[REQUEST_ID_ATTRIBUTE] = request_id
    span = _state.tracer.start_span(name, context=parent_context, kind=getattr(SpanKind, kind.upper()),
                                    attributes=attrs, start_time=_wall_ns(start_s))
    return Span(span, request_id)


def start(name: str, parent: Mapping[str, str] | None = None, kind: str = "internal",
          start_s: float | None = None, request_id: str | None = None, **attributes: Any) -> Span | NoSpan:
    """A new span: a child of the W3C context in `parent` (trace headers from another process; a root without
    one), or NO_SPAN when tracing is off. `start_s`: its start on time.monotonic() (default: now)."""
    if _state.tracer is None:
        return NO_SPAN
    context = _state.propagator.extract(dict(parent)) if parent else None
    return _start(name, context, kind, start_s, request_id, attributes)


def start_from_grpc(name: str, context: Any, request_id_from_metadata: bool = True,
                    **attributes: Any) -> Span | NoSpan:
    """A server span for a gRPC call: its parent from the call's metadata, and its request id too unless the
    caller sets it (the router checks a client's id before using it: request_id_from_metadata=False)."""
    if _state.tracer is None:
        return NO_SPAN
    metadata = dict(context.invocation_metadata() or ())
    request_id = metadata.get(REQUEST_ID_KEY) if request_id_from_metadata else None
    return start(name, metadata, "server", request_id=request_id, **attributes)


# The span of the request a router task is serving (NO_SPAN outside one). Tasks copy it when they start.
_current: contextvars.ContextVar[Span | NoSpan] = contextvars.ContextVar("kimiserve_request_span", default=NO_SPAN)


def current() -> Span | NoSpan:
    return _current.get()


def set_current(span: Span | NoSpan) -> None:
    """Makes `span` the request span of the running task (set once per RPC task; never reset: the task ends)."""
    _current.set(span)
