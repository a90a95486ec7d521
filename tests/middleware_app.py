"""An app with middleware, for tests/test_middleware.py: every hook it defines records
(hook, PID, job id) in a Redis list the test reads, and raises when the job's headers say
`{"raise": "<hook>"}`. Its tasks count their runs in the tests' ledger."""

from __future__ import annotations

import asyncio
import json
import os
from typing import Any

from taskrunner import Retry, TaskRunner, current_job
from tests import apps as base
from tests.apps import mark

app = TaskRunner("tests-middleware")


def recorded() -> list[list[Any]]:
    """[hook, pid, job id or None, detail] per hook call, oldest first."""
    return [json.loads(x) for x in base.app.redis.lrange(f"{base.app.settings.prefix}:hooks", 0, -1)]


class Recorder:
    def _record(self, hook: str, job: Any = None, detail: Any = None) -> None:
        base.app.redis.rpush(f"{base.app.settings.prefix}:hooks",
                             json.dumps([hook, os.getpid(), job.id if job is not None else None, detail]))
        if job is not None and job.headers.get("raise") == hook:
            raise RuntimeError(f"{hook} hook failed on purpose")

    def before_enqueue(self, job: Any) -> None:
        job.headers["stamp"] = f"enqueued by {os.getpid()}"
        self._record("before_enqueue", job)

    def child_start(self) -> None:
        self._record("child_start")

    def child_stop(self) -> None:
        self._record("child_stop")

    def before_run(self, job: Any) -> None:
        self._record("before_run", job)

    def after_run(self, job: Any, outcome: Any) -> None:
        self._record("after_run", job, outcome.kind)

    def on_retry(self, job: Any, exc: BaseException) -> None:
        self._record("on_retry", job, type(exc).__name__)

    def on_failure(self, job: Any, exc: BaseException) -> None:
        self._record("on_failure", job, type(exc).__name__)


app.add_middleware(Recorder())


@app.task(max_duration=60)
def work(key: str) -> dict:
    """Counts its run; answers its headers and PID."""
    mark(key)
    return {"headers": current_job().headers, "pid": os.getpid()}


@app.task(retries=1, retry_backoff=0.05, max_duration=60)
def boom(key: str) -> None:
    mark(key)
    raise ValueError("no")


@app.task(max_retries=1, max_duration=60)
def asks_again(key: str) -> None:
    """Raises Retry each time: once within max_retries, then past it."""
    mark(key)
    raise Retry(delay=0)


@app.task(retries=2, retry_backoff=0.05, max_duration=60)
def counts_down(key: str) -> None:
    """Notes how many retries it has left, then fails."""
    base.app.redis.rpush(f"{base.app.settings.prefix}:left:{key}", current_job().retries_left)
    raise ValueError("again")


@app.task(max_duration=60)
async def async_work(key: str) -> dict:
    mark(key)
    await asyncio.sleep(0)
    return {"headers": current_job().headers, "pid": os.getpid()}
