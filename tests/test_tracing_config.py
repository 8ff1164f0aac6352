"""kimiserve/tracing.py without services: which OTEL_* environments switch traces on, the named refusals, and the
off state, which must import nothing of OpenTelemetry and cost next to nothing per request."""

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
import json, sys, timeit
from kimiserve import tracing
import router.service, tokenizer_svc.rpc, shard_svc.server.engine_loop  # every module that makes spans
assert not tracing.setup("router", env={})

class Call:
    def invocation_metadata(self):
        return (("x-request-id", "r-1"),)

def one_request():  # the router's and the tokenizer's calls for one chat request, as the code makes them
    span = tracing.start_from_grpc("router.Chat", Call(), request_id_from_metadata=False, method="Chat")
    tracing.set_current(span)
    tracing.current().set("request_id", "r-1")
    with tracing.current().child("render_chat", kind="client", messages=1) as s:
        s.metadata()
    tracing.current().child("admission", start_s=0.0).end(1.0)
    with tracing.current().child("stream", shard="s") as st:
        st.carrier(), st.metadata()
    span.end()
    tracing.start_from_grpc("tokenizer.RenderChat", Call()).end()

n = 20000
print(json.dumps([timeit.timeit(one_request, number=n) / n, [m for m in sys.modules if m.startswith("opentelemetry")]]))
"""


def test_off_imports_no_opentelemetry_and_costs_microseconds():
    out = subprocess.run([sys.executable, "-c", OFF_PROBE], capture_output=True, text=True, timeout=120,
                         env={"PATH": "/usr/bin:/bin", "PYTHONPATH": ":".join(sys.path)})
    assert out.returncode == 0, out.stderr[-3000:]
    seconds, modules = json.loads(out.stdout.strip().splitlines()[-1])
    assert modules == [], f"tracing off imported {modules}"
    # A few microseconds here (measured 5-8 us on a loaded 2-core machine); a request takes milliseconds at least.
    assert seconds < 100e-6, f"the no-op tracing path costs {seconds * 1e6:.1f} us per request"
