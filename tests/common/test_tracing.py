"""common/tracing.py: which OTEL_* settings turn tracing on, and that off costs nothing."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from common import tracing


@pytest.mark.parametrize("env, endpoint, wanted", [
    ({}, None, []),                                                        # off by default
    ({}, "http://collector:4317", ["otlp"]),                               # --otlp-traces-endpoint
    ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4317"}, None, ["otlp"]),
    ({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://c:4318/v1/traces"}, None, ["otlp"]),
    ({"OTEL_TRACES_EXPORTER": "console"}, None, ["console"]),
    ({"OTEL_TRACES_EXPORTER": "otlp,console"}, None, ["otlp", "console"]),
    ({"OTEL_TRACES_EXPORTER": "none", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4317"}, "x", []),
    ({"OTEL_SDK_DISABLED": "true", "OTEL_TRACES_EXPORTER": "otlp"}, None, []),
    ({"OTEL_TRACES_EXPORTER": "zipkin"}, None, []),                        # unsupported: warned, off
])
def test_exporters_wanted(env, endpoint, wanted):
    assert tracing.exporters_wanted(endpoint, env) == wanted


def test_off_imports_no_tracing_sdk_and_makes_no_tracer():
    """With no OTEL_* set no tracer is built and the tracing SDK is not even imported, so
    no span object can exist. (redis >= 7 imports the OpenTelemetry API and the SDK's
    *metrics* for its own observability hooks when they are installed; not traces.)"""
    code = ("import os, sys\n"
            "for k in [k for k in os.environ if k.startswith('OTEL_')]: del os.environ[k]\n"
            "import common.tracing, gateway.main, gateway.service, worker.serve.service\n"
            "assert common.tracing.configure('x') is None\n"
            "print(sorted(m for m in sys.modules if m.startswith(('opentelemetry.sdk.trace', "
            "'opentelemetry.exporter'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True,
                         cwd=Path(tracing.__file__).resolve().parent.parent).stdout
    assert out.strip() == "[]"


@pytest.mark.parametrize("protocol, module", [("grpc", "grpc"), ("http/protobuf", "http")])
def test_on_builds_an_otlp_tracer_for_the_protocol(protocol, module):
    pytest.importorskip("opentelemetry.sdk")
    env = {"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": protocol, "OTEL_SERVICE_NAME": "svc"}
    tracer = tracing.configure("inflight-test", "http://127.0.0.1:9/v1/traces", env)
    assert tracer is not None
    processor = tracer.span_processor._span_processors[0]  # the SDK's internals, for this check only
    exporter = getattr(processor, "span_exporter", None) or processor._batch_processor._exporter
    assert f".proto.{module}." in type(exporter).__module__


def test_traceparent_round_trip():
    pytest.importorskip("opentelemetry.sdk")
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.trace import get_current_span

    span = TracerProvider().get_tracer("t").start_span("s")
    header = tracing.traceparent_of(span)
    ctx = span.get_span_context()
    assert header == f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-{int(ctx.trace_flags):02x}"
    assert int(ctx.trace_flags) & 1  # sampled
    parent = get_current_span(tracing.context_from_traceparent(header)).get_span_context()
    assert (parent.trace_id, parent.span_id, parent.is_remote) == (span.get_span_context().trace_id,
                                                                    span.get_span_context().span_id, True)
    assert tracing.context_from_traceparent("") is None
    assert tracing.context_from_traceparent("garbage") is None
