"""A tiny OTLP/gRPC trace receiver on localhost: what a collector receives from the services, kept in memory.

It serves opentelemetry-proto's TraceService (the service an OpenTelemetry Collector's OTLP receiver serves), so the
services export to it through their real OTLP exporters, configured by the standard OTEL_* variables.
"""

from __future__ import annotations

import threading
import time
from concurrent import futures
from dataclasses import dataclass, field

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

from kimiserve.ports import free_port


@dataclass(frozen=True)
class ReceivedSpan:
    service: str  # the resource's service.name
    name: str
    trace_id: str  # hex
    span_id: str
    parent_id: str  # "" for a root
    start_ns: int
    end_ns: int
    attributes: dict = field(hash=False)
    error: str = ""  # the status message of a span with status ERROR

    @property
    def ms(self) -> float:
        return (self.end_ns - self.start_ns) / 1e6


def _value(v):
    kind = v.WhichOneof("value")
    return getattr(v, kind) if kind else None


class _Collector(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self) -> None:
        self.spans: list[ReceivedSpan] = []
        self.lock = threading.Lock()

    def Export(self, request, context):
        got = []
        for rs in request.resource_spans:
            service = next((_value(a.value) for a in rs.resource.attributes if a.key == "service.name"), "")
            for ss in rs.scope_spans:
                for s in ss.spans:
                    got.append(ReceivedSpan(service, s.name, s.trace_id.hex(), s.span_id.hex(), s.parent_span_id.hex(),
                                            s.start_time_unix_nano, s.end_time_unix_nano,
                                            {a.key: _value(a.value) for a in s.attributes},
                                            s.status.message if s.status.code == 2 else ""))
        with self.lock:
            self.spans.extend(got)
        return trace_service_pb2.ExportTraceServiceResponse()


class OtlpReceiver:
    def __init__(self) -> None:
        self.port = free_port()
        self._collector = _Collector()
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(self._collector, self._server)
        self._server.add_insecure_port(f"127.0.0.1:{self.port}")

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> OtlpReceiver:
        self._server.start()
        return self

    def stop(self) -> None:
        self._server.stop(None)

    def spans(self) -> list[ReceivedSpan]:
        with self._collector.lock:
            return list(self._collector.spans)

    def wait(self, until, which, timeout: float = 30.0) -> list[ReceivedSpan]:
        """The received spans for which `which(span)` holds, once `until(those)` holds (spans arrive in batches,
        from three processes)."""
        end = time.monotonic() + timeout
        while True:
            spans = [s for s in self.spans() if which(s)]
            if until(spans):
                return spans
            if time.monotonic() > end:
                raise AssertionError(f"spans incomplete after {timeout} s:\n{render_tree(spans)}")
            time.sleep(0.1)

    def trace(self, trace_id: str, until, timeout: float = 30.0) -> list[ReceivedSpan]:
        """The spans of one trace, once `until(spans)` holds."""
        return self.wait(until, lambda s: s.trace_id == trace_id, timeout)


def render_tree(spans: list[ReceivedSpan], attributes: tuple[str, ...] = ()) -> str:
    """The trace as indented text: start offset and duration (ms) of each span, its service and chosen attributes;
    spans whose parent is not in the list are roots."""
    ids = {s.span_id for s in spans}
    children: dict[str, list[ReceivedSpan]] = {}
    for s in spans:
        children.setdefault(s.parent_id if s.parent_id in ids else "", []).append(s)
    t0 = min((s.start_ns for s in spans), default=0)
    lines = []

    def walk(parent: str, depth: int) -> None:
        for s in sorted(children.get(parent, []), key=lambda s: (s.start_ns, s.name)):
            extra = " ".join(f"{k}={s.attributes[k]}" for k in attributes if k in s.attributes)
            label = f"{'  ' * depth}{s.name}"
            lines.append(f"{(s.start_ns - t0) / 1e6:9.1f} ms {s.ms:9.1f} ms  {label:<34} {s.service:<20} {extra}"
                         .rstrip())
            walk(s.span_id, depth + 1)

    walk("", 0)
    return "\n".join(lines)
