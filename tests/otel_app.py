"""An app traced with OpenTelemetry (taskrunner.client.tracing): its own SDK provider, whose
spans go to an in-memory exporter in the test process, or, in a worker started with
OTEL_SPANS_FILE, to that file as one JSON object per line (read back by the test)."""

from __future__ import annotations

import os

from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import ConsoleSpanExporter, SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from taskrunner import TaskRunner
from taskrunner.client.tracing import Tracing

provider = TracerProvider()
memory = InMemorySpanExporter()
if os.environ.get("OTEL_SPANS_FILE"):
    out = open(os.environ["OTEL_SPANS_FILE"], "a")  # noqa: SIM115 (open for the process's life)
    provider.add_span_processor(SimpleSpanProcessor(ConsoleSpanExporter(
        out=out, formatter=lambda span: span.to_json(indent=None) + "\n")))
else:
    provider.add_span_processor(SimpleSpanProcessor(memory))
tracer = provider.get_tracer("otel_app")

app = TaskRunner("otel")
app.add_middleware(Tracing(tracer_provider=provider))


@app.task
def traced(x: int) -> int:
    with tracer.start_as_current_span("inner"):
        return x * 2


@app.task
def fails() -> None:
    raise ValueError("no luck")
