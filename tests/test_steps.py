"""The synchronous API and the asyncio client carry out the same operations (steps.py):
the same scenarios through both give the same answers and the same errors, word for word.
(The asyncio client used to re-implement them and had drifted: its QueueFull and
QueueClosed said less, and its block timeout counted from before the first try.)"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from taskrunner.client.aio import AsyncClient
from taskrunner.errors import JobFailed, JobNotFound, QueueClosed, QueueFull, Timeout
from taskrunner.ops import queue as queues


class Sync:
    def __init__(self, app):
        self.app = app

    def enqueue(self, *args: Any, **kwargs: Any) -> str:
        return self.app.enqueue(*args, **kwargs).id

    def wait(self, job_id: str, timeout: float) -> Any:
        return self.app.job(job_id).wait(timeout)

    def kill(self, job_id: str) -> str:
        return self.app.job(job_id).kill("test")

    def record(self, job_id: str) -> dict[str, Any]:
        return self.app.job(job_id).to_dict()


class Async:
    """AsyncClient's coroutines, each run to its end on a loop of its own."""

    def __init__(self, app):
        self.app = app

    def _call(self, name: str, *args: Any, **kwargs: Any) -> Any:
        async def go() -> Any:
            client = AsyncClient(self.app)
            try:
                return await getattr(client, name)(*args, **kwargs)
            finally:
                await client.close()

        return asyncio.run(go())

    def enqueue(self, *args: Any, **kwargs: Any) -> str:
        return self._call("enqueue", *args, **kwargs)

    def wait(self, job_id: str, timeout: float) -> Any:
        return self._call("wait", job_id, timeout)

    def kill(self, job_id: str) -> str:
        return self._call("kill", job_id, "test")

    def record(self, job_id: str) -> dict[str, Any]:
        return self._call("job", job_id)


@pytest.fixture(params=["sync", "async"])
def api(request, app):
    return Sync(app) if request.param == "sync" else Async(app)


def error_of(call: Any) -> tuple[type, str]:
    with pytest.raises(Exception) as e:
        call()
    return type(e.value), str(e.value)


def test_refusals_are_the_same_words(app):
    queues.create(app, "tight", bound=1)
    app.enqueue("tests.apps.add", [1, 1], queue="tight")
    queues.create(app, "shut")
    queues.close(app, "shut")

    def refusals(api: Sync | Async) -> list[tuple[type, str]]:
        return [
            error_of(lambda: api.enqueue("tests.apps.add", [1, 2], queue="tight", block_timeout=0)),
            error_of(lambda: api.enqueue("tests.apps.add", [1, 2], queue="shut")),
            error_of(lambda: api.wait("no-such-job", 1)),
            error_of(lambda: api.kill("no-such-job")),
            error_of(lambda: api.enqueue("tests.apps.add", [1, 2], delay=-1)),
            error_of(lambda: api.enqueue("tests.apps.add", [1, 2], job_id="bad id")),
        ]

    seen = {type(api).__name__: refusals(api) for api in (Sync(app), Async(app))}
    assert seen["Sync"] == seen["Async"]
    kinds = [kind for kind, _ in seen["Sync"]]
    assert kinds[:4] == [QueueFull, QueueClosed, JobNotFound, JobNotFound]
    assert "is full (its bound is reached)" in seen["Async"][0][1]
    assert "is closed: it takes no new jobs" in seen["Async"][1][1]


def test_a_job_runs_and_its_result_or_failure_comes_back(api, app, stack):
    stack.worker()
    done = api.enqueue("tests.apps.add", [2, 3])
    assert api.wait(done, 30) == 5
    failed = api.enqueue("tests.apps.boom", ["no luck"])
    with pytest.raises(JobFailed) as e:
        api.wait(failed, 30)
    assert (e.value.state, e.value.message) == ("failed", "no luck")
    assert api.record(done)["state"] == "completed"


def test_waiting_on_a_job_that_does_not_end_times_out_and_kill_ends_it(api, app):
    job_id = api.enqueue("tests.apps.add", [1, 1], delay=600)
    with pytest.raises(Timeout, match=f"job {job_id} still delayed after 0.2s"):
        api.wait(job_id, 0.2)
    assert api.kill(job_id) == "killed"
    assert api.record(job_id)["state"] == "killed"
    with pytest.raises(JobFailed):
        api.wait(job_id, 5)


def test_a_task_unknown_here_goes_to_the_queue_its_workers_declared(api, app):
    app.redis.hset(app.keys.tasks, "elsewhere.task", '{"queue": "remote", "worker": "w1"}')
    job_id = api.enqueue("elsewhere.task", [1])
    assert api.record(job_id)["queue"] == "remote"
