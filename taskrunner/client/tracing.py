"""OpenTelemetry tracing, as middleware (the `otel` extra: opentelemetry-api; setting up an
SDK and an exporter is the application's, as for any instrumented library):

    from taskrunner.client.tracing import Tracing
    app.add_middleware(Tracing())

Each enqueue makes a span "send <task>" (kind PRODUCER, a child of whatever span is current)
and puts its context into the job's headers (W3C `traceparent`, and `tracestate` when there is
one), so that the trace crosses Redis with the job. Each delivery runs in a span "run <task>"
(kind CONSUMER) whose parent is that context, with the job's attributes (messaging.system
"taskrunner", messaging.destination.name the queue, messaging.message.id the job id,
taskrunner.task, taskrunner.attempt); spans the task's own code makes (a database client's,
an HTTP client's) are its children. A task that raised marks it ERROR with the exception (an
"exception" event, from the job's outcome: no hook that reads the job's record is used); a
job stopped by a kill or its max duration runs no hook after before_run, so its span is not
ended (its process may be gone)."""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any

from opentelemetry import context, propagate, trace
from opentelemetry.trace import SpanKind, Status, StatusCode

if TYPE_CHECKING:
    from taskrunner.client.middleware import Enqueued
    from taskrunner.protocol.outcome import Outcome
    from taskrunner.worker.context import JobContext

#: Spans of runs begun and not ended that a Tracing keeps at most: runs whose after_run
#: never came (a cancelled coroutine) are forgotten, oldest first, past this many.
OPEN_MAX = 10_000
#: The headers the trace context travels in.
CARRIER = ("traceparent", "tracestate")


class Tracing:
    """The middleware; `tracer_provider` defaults to the global one."""

    def __init__(self, tracer_provider: trace.TracerProvider | None = None) -> None:
        self.tracer = trace.get_tracer("taskrunner", tracer_provider=tracer_provider)
        self._open: dict[tuple[str, int], tuple[trace.Span, object]] = {}
        self._lock = threading.Lock()  # threads of one child run jobs side by side

    def before_enqueue(self, job: Enqueued) -> None:
        with self.tracer.start_as_current_span(f"send {job.task}", kind=SpanKind.PRODUCER,
                                               attributes=_attributes(job.id, job.task, job.queue)):
            carrier: dict[str, str] = {}
            propagate.inject(carrier)
        job.headers = {**job.headers, **carrier}

    def before_run(self, job: JobContext) -> None:
        parent = propagate.extract({k: v for k, v in job.headers.items() if k in CARRIER and isinstance(v, str)})
        span = self.tracer.start_span(f"run {job.task}", context=parent, kind=SpanKind.CONSUMER,
                                      attributes={**_attributes(job.id, job.task, job.queue),
                                                  "taskrunner.attempt": job.attempt})
        token = context.attach(trace.set_span_in_context(span, parent))
        with self._lock:
            self._open[(job.id, job.attempt)] = (span, token)
            while len(self._open) > OPEN_MAX:
                self._open.pop(next(iter(self._open)))

    def after_run(self, job: JobContext, outcome: Outcome) -> None:
        with self._lock:
            found = self._open.pop((job.id, job.attempt), None)
        if found is None:
            return
        span, token = found
        if outcome.kind in ("failed", "error"):  # the exception as record_exception() has it, from the outcome
            span.add_event("exception", {"exception.type": outcome.v1, "exception.message": outcome.v2,
                                         "exception.stacktrace": outcome.v3})
            span.set_status(Status(StatusCode.ERROR, f"{outcome.v1}: {outcome.v2}"))
        span.set_attribute("taskrunner.outcome", outcome.kind)
        try:
            context.detach(token)  # type: ignore[arg-type]
        finally:
            span.end()


def _attributes(job_id: str, task: str, queue: str) -> dict[str, Any]:
    return {"messaging.system": "taskrunner", "messaging.destination.name": queue,
            "messaging.message.id": job_id, "taskrunner.task": task}
