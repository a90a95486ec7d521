"""Headers and middleware with real workers: headers travel from the producer to the task
and the record; every hook fires in the process it belongs to; a raising hook is logged
with the job id and the job is neither lost nor run twice."""

from __future__ import annotations

import json

import pytest

from taskrunner import PayloadTooLarge, TaskRunner
from taskrunner.errors import NotJSONError
from tests import apps


def status(stack, job_id: str) -> dict:
    return json.loads(stack.cli("status", job_id, "--json", check=True).stdout)


def test_headers_reach_the_task_and_the_record(app, stack):
    job = apps.whoami.apply_async(headers={"trace": "t-1", "tenant": {"id": 7}})  # fails once: a retry has them too
    stack.worker()
    stack.dispatcher()
    assert job.wait(30)["headers"] == {"trace": "t-1", "tenant": {"id": 7}}
    assert status(stack, job.id)["headers"] == {"trace": "t-1", "tenant": {"id": 7}}
    plain = apps.add.delay(1, 2)
    assert plain.wait(30) == 3
    assert "headers" not in app.redis.hgetall(app.keys.job("default", plain.id))  # no headers: no field
    assert status(stack, plain.id)["headers"] == {}


def test_headers_are_checked_and_counted_in_the_payload(app: TaskRunner):
    with pytest.raises(TypeError, match="headers must be a dict"):
        apps.add.apply_async([1, 2], headers=["x"])
    with pytest.raises(NotJSONError):
        apps.add.apply_async([1, 2], headers={"x": object()})
    with pytest.raises(PayloadTooLarge, match="arguments and headers of tests.apps.add take"):
        apps.add.apply_async([1, 2], headers={"x": "y" * app.settings.max_payload})
    many = app.enqueue_many([{"task": "tests.apps.add", "args": [1, 2], "headers": {"n": 1}}])
    assert many[0].refresh().to_dict()["headers"] == {"n": 1}
