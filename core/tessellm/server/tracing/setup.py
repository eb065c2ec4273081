"""Building the server's RequestTracer at start-up (`--otlp-traces-endpoint URL`).

Spans go by OTLP over HTTP/protobuf to URL (a collector's traces path, e.g.
http://localhost:4318/v1/traces) through a batching processor, from a TracerProvider of the
server's own (never the process-wide global one), with the resource `service.name=tessellm`.
Without `tessellm[otel]` the server refuses to start with a ConfigError that names the
extra; it is never found missing in the middle of a request.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from tessellm.errors import ConfigError

if TYPE_CHECKING:
    from tessellm.server.tracing.request_span import RequestTracer

INSTALL_HINT = "pip install 'tessellm[otel]'"


def load_tracer(endpoint: str) -> RequestTracer:
    """The RequestTracer exporting to `endpoint`, or a ConfigError saying what to install."""
    try:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor

        from tessellm.server.tracing.request_span import RequestTracer
    except ImportError as e:
        raise ConfigError(f"--otlp-traces-endpoint needs OpenTelemetry ({INSTALL_HINT}): {e}") \
            from e
    provider = TracerProvider(resource=Resource.create({"service.name": "tessellm"}))
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint)))
    return RequestTracer(provider)
