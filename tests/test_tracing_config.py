"""kimiserve/tracing.py without services: which OTEL_* environments switch traces on, the named refusals, and the
off state, which must import nothing of OpenTelemetry and make no span of its own per request."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from kimiserve.tracing import TracingConfigError, exporters_wanted


@pytest.mark.parametrize("env, wanted", [
    ({}, []),
    ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4317"}, ["otlp"]),
    ({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://collector:4317"}, ["otlp"]),
    ({"OTEL_TRACES_EXPORTER": "otlp"}, ["otlp"]),  # the exporter's default endpoint, localhost:4317
    ({"OTEL_TRACES_EXPORTER": "console"}, ["console"]),
    ({"OTEL_TRACES_EXPORTER": "otlp, console"}, ["otlp", "console"]),
    ({"OTEL_TRACES_EXPORTER": "none", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4317"}, []),
    ({"OTEL_SDK_DISABLED": "true", "OTEL_TRACES_EXPORTER": "otlp"}, []),
    ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4317", "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"}, ["otlp"]),
])
def test_which_environments_switch_traces_on(env, wanted):
    assert exporters_wanted(env) == wanted


@pytest.mark.parametrize("env, message", [
    ({"OTEL_TRACES_EXPORTER": "zipkin"}, "unknown exporter(s) ['zipkin']"),
    ({"OTEL_TRACES_EXPORTER": "otlp,jaeger"}, "unknown exporter(s) ['jaeger']"),
    ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318", "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf"},
     "OTLP protocol 'http/protobuf'"),
    ({"OTEL_TRACES_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/json"}, "OTLP protocol 'http/json'"),
])
def test_environments_it_cannot_serve_are_refused_by_name(env, message):
    with pytest.raises(TracingConfigError) as e:
        exporters_wanted(env)
    assert message in str(e.value)


OFF_PROBE = """
import json, sys
from kimiserve import tracing
import router.service, tokenizer_svc.rpc, shard_svc.server.engine_loop  # every module that makes spans
assert not tracing.setup("router", env={})

class Call:
    def invocation_metadata(self):
        return (("x-request-id", "r-1"),)

def one_request():  # the router's and the tokenizer's calls for one chat request, as the code makes them
    spans, carried = [], []
    span = tracing.start_from_grpc("router.Chat", Call(), request_id_from_metadata=False, method="Chat")
    tracing.set_current(span)
    tracing.current().set("request_id", "r-1")
    with tracing.current().child("render_chat", kind="client", messages=1) as s:
        spans.append(s)
        carried.append(s.metadata())
    admission = tracing.current().child("admission", start_s=0.0)
    admission.end(1.0)
    with tracing.current().child("stream", shard="s") as st:
        spans.append(st)
        carried += [st.carrier(), st.metadata()]
    span.end()
    served = tracing.start_from_grpc("tokenizer.RenderChat", Call())
    served.end()
    return [span, tracing.current(), admission, served, *spans], carried

spans, carried = one_request()
print(json.dumps([all(s is tracing.NO_SPAN for s in spans), carried,
                  [m for m in sys.modules if m.startswith("opentelemetry")]]))
"""


def test_off_imports_no_opentelemetry_and_allocates_no_spans():
    """Off costs next to nothing because every call returns the one shared no-op span and carries nothing: checked as
    that structure, not as a wall-clock bound that a busy machine could break."""
    out = subprocess.run([sys.executable, "-c", OFF_PROBE], capture_output=True, text=True, timeout=120,
                         env={"PATH": "/usr/bin:/bin", "PYTHONPATH": ":".join(sys.path)})
    assert out.returncode == 0, out.stderr[-3000:]
    shared, carried, modules = json.loads(out.stdout.strip().splitlines()[-1])
    assert modules == [], f"tracing off imported {modules}"
    assert shared, "tracing off made a span object of its own instead of returning tracing.NO_SPAN"
    assert carried == [[], {}, []], f"tracing off put trace context on outgoing calls: {carried}"
