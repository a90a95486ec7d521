"""OpenTelemetry: the producer's span and the run's, in a real worker's child, share one
trace (the real SDK: in-memory exporter here, a file exporter in the worker)."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("opentelemetry.sdk")

from tests import otel_app  # noqa: E402
from tests.conftest import wait_for  # noqa: E402


def _spans(path) -> dict[str, dict]:
    return {s["name"]: s for s in map(json.loads, path.read_text().splitlines())} if path.exists() else {}


def test_a_trace_crosses_redis_with_the_job(app, stack, tmp_path):
    otel_app.app.configure(redis_url=stack.url, prefix=app.settings.prefix)
    spans_file = tmp_path / "spans.jsonl"
    stack.worker(app="tests.otel_app", concurrency=1, env={"OTEL_SPANS_FILE": str(spans_file)})
    otel_app.memory.clear()
    with otel_app.tracer.start_as_current_span("request") as request:
        job = otel_app.traced.delay(21)
    assert job.wait(timeout=30) == 42
    failed = otel_app.fails.delay()
    wait_for(lambda: "run tests.otel_app.fails" in _spans(spans_file), what="the failing run's span")
    ours = {s.name: s for s in otel_app.memory.get_finished_spans()}
    send = ours["send tests.otel_app.traced"]
    assert send.context.trace_id == request.get_span_context().trace_id and send.parent.span_id == \
        request.get_span_context().span_id and send.kind.name == "PRODUCER"
    assert "traceparent" in job.refresh().to_dict()["headers"]
    theirs = wait_for(lambda: (s := _spans(spans_file)).get("inner") and s, what="the worker's spans")
    run, inner = theirs["run tests.otel_app.traced"], theirs["inner"]
    trace_id = f"0x{request.get_span_context().trace_id:032x}"
    assert run["context"]["trace_id"] == inner["context"]["trace_id"] == trace_id
    assert run["parent_id"] == f"0x{send.context.span_id:016x}" and run["kind"] == "SpanKind.CONSUMER"
    assert inner["parent_id"] == run["context"]["span_id"]
    assert run["attributes"]["messaging.message.id"] == job.id
    assert run["attributes"]["taskrunner.attempt"] == 1 and run["attributes"]["taskrunner.outcome"] == "completed"
    bad = _spans(spans_file)["run tests.otel_app.fails"]
    assert bad["status"]["status_code"] == "ERROR" and "no luck" in bad["status"]["description"]
    assert bad["events"][0]["name"] == "exception" and bad["events"][0]["attributes"]["exception.type"] \
        .endswith("ValueError")
    assert bad["attributes"]["messaging.message.id"] == failed.id
    # a job enqueued with no current span starts its own trace at the send span
    otel_app.memory.clear()
    lone = otel_app.traced.delay(1)
    [send] = otel_app.memory.get_finished_spans()
    assert send.parent is None and lone.wait(timeout=30) == 2
