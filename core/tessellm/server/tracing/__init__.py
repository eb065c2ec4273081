"""OpenTelemetry tracing of requests (`tessellm serve --otlp-traces-endpoint URL`).

Modules: attributes (the span's attribute names, vLLM's `gen_ai.*`), request_span (one span
per request from the timings the server already keeps), setup (the OTLP exporter; a missing
`tessellm[otel]` is a start-up error). Nothing here imports OpenTelemetry unless tracing is
asked for.
"""
