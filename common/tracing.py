"""OpenTelemetry tracing, shared by the gateway and the worker: off unless asked for.

Tracing is turned on by the standard OpenTelemetry environment variables, or by
``--otlp-traces-endpoint`` (vLLM's flag; the same as
``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``):

* ``OTEL_SDK_DISABLED=true`` or ``OTEL_TRACES_EXPORTER=none``: off, whatever else is set;
* ``OTEL_TRACES_EXPORTER`` = ``otlp`` and/or ``console`` (comma-separated): on, with
  those exporters;
* otherwise on (OTLP) when an endpoint is given: the flag,
  ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` or ``OTEL_EXPORTER_OTLP_ENDPOINT``;
* otherwise off. (The OpenTelemetry default exporter is ``otlp`` to localhost:4317; we
  do not export to a collector nobody asked for.)

OTLP goes over gRPC unless ``OTEL_EXPORTER_OTLP_TRACES_PROTOCOL`` (or
``OTEL_EXPORTER_OTLP_PROTOCOL``) is ``http/protobuf``. Everything else the SDK reads
itself: ``OTEL_SERVICE_NAME`` and ``OTEL_RESOURCE_ATTRIBUTES`` (the service name
defaults to ``inflight-gateway`` / ``inflight-worker``), ``OTEL_EXPORTER_OTLP_HEADERS``,
``OTEL_TRACES_SAMPLER``, ``OTEL_BSP_*``.

When off, :func:`configure` returns None and imports nothing of OpenTelemetry: the
callers keep None and skip every hook, so no span object is ever created.
The W3C ``traceparent`` helpers below are what crosses the queue
(``QueuedRequest.traceparent``).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from typing import Any

log = logging.getLogger(__name__)

_TRUE = {"1", "true", "yes", "on"}


def exporters_wanted(endpoint: str | None = None, env: Mapping[str, str] | None = None) -> list[str]:
    """The span exporters asked for ("otlp", "console"); empty = tracing off.

    Args:
        endpoint: ``--otlp-traces-endpoint`` (None or "" = not given).
        env: the environment (default ``os.environ``).
    """
    env = os.environ if env is None else env
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() in _TRUE:
        return []
    named = [e.strip().lower() for e in env.get("OTEL_TRACES_EXPORTER", "").split(",") if e.strip()]
    if "none" in named:
        return []
    if named:
        unknown = [e for e in named if e not in ("otlp", "console")]
        if unknown:
            log.warning("OTEL_TRACES_EXPORTER: ignoring unsupported exporter(s) %s", ", ".join(unknown))
        return [e for e in named if e in ("otlp", "console")]
    if endpoint or env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or env.get("OTEL_EXPORTER_OTLP_ENDPOINT"):
        return ["otlp"]
    return []


def configure(default_service_name: str, endpoint: str | None = None,
              env: Mapping[str, str] | None = None) -> Any | None:
    """An OpenTelemetry ``Tracer`` exporting in batches, or None when tracing is off.

    The tracer provider is this process's own (not installed as the global one) and
    flushes its spans at exit.

    Args:
        default_service_name: ``service.name`` unless ``OTEL_SERVICE_NAME`` sets one.
        endpoint: ``--otlp-traces-endpoint`` (None or "": the environment decides).
        env: the environment (default ``os.environ``).
    """
    env = os.environ if env is None else env
    wanted = exporters_wanted(endpoint, env)
    if not wanted:
        return None
    from opentelemetry.sdk.resources import SERVICE_NAME, Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter

    attrs = {} if env.get("OTEL_SERVICE_NAME") else {SERVICE_NAME: default_service_name}
    provider = TracerProvider(resource=Resource.create(attrs))
    for name in wanted:
        exporter = _otlp_exporter(endpoint, env) if name == "otlp" else ConsoleSpanExporter()
        provider.add_span_processor(BatchSpanProcessor(exporter))
    log.info("tracing on: exporter(s) %s, service %s", ", ".join(wanted),
             provider.resource.attributes.get(SERVICE_NAME))
    return provider.get_tracer("inflight")


def _otlp_exporter(endpoint: str | None, env: Mapping[str, str]) -> Any:
    protocol = (env.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or env.get("OTEL_EXPORTER_OTLP_PROTOCOL")
                or "grpc").strip().lower()
    kwargs = {"endpoint": endpoint} if endpoint else {}
    if protocol.startswith("http"):
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    else:
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    return OTLPSpanExporter(**kwargs)


def traceparent_of(span: Any) -> str:
    """The W3C ``traceparent`` header value naming ``span`` as the parent
    ("" when the span is not valid, e.g. not sampled by a parent-based sampler)."""
    ctx = span.get_span_context()
    if not ctx.is_valid:
        return ""
    return f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-{int(ctx.trace_flags):02x}"


def context_from_traceparent(traceparent: str) -> Any | None:
    """The OpenTelemetry ``Context`` whose parent is the remote span ``traceparent``
    names, or None (no parent: a new trace) when it is empty or malformed."""
    if not traceparent:
        return None
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
    from opentelemetry.trace import get_current_span

    ctx = TraceContextTextMapPropagator().extract({"traceparent": traceparent})
    return ctx if get_current_span(ctx).get_span_context().is_valid else None
