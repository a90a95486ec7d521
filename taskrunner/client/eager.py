"""Eager mode (`TaskRunner(..., eager=True)` or TASKRUNNER_EAGER=1), for users' own tests:
an enqueue runs the task here and now, in the calling process, and returns a Job that holds
its record in memory. No Redis is needed and no connection is made.

What a job sees is what a worker's child would give it: the task runs through the child's
own `run` (the JSON round-tripped arguments, the same outcomes: NotRegistered,
BadArguments, Rejected, a result that is not JSON), and the record ends as finish.lua would
end it: an exception is retried while the task's retries last, a `raise Retry(...)` while
its max_retries last (then MaxRetriesExceeded). Differences, on purpose: those run again at
once, without sleeping the backoff or the Retry's delay, and a `delay` given at enqueue is
not waited either. The record is not expired (result_ttl, failed_ttl).

Workflows too: a chain runs its steps in order, each given its parent's result first (unless
immutable); a job with depends_on runs once its parents (Job objects: there is no Redis to
look ids up in) completed. A step after one that did not complete ends `canceled`, as
finish.lua ends it."""

from __future__ import annotations

import logging
import os
import socket
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from taskrunner.client.job import Job
from taskrunner.errors import MAX_RETRIES, JobNotFound
from taskrunner.protocol import codec
from taskrunner.worker.child import message as job_message
from taskrunner.worker.child import run as run_in_child
from taskrunner.worker.context import LOG_LINES, JobContext, JobLogHandler, log_line

if TYPE_CHECKING:
    from taskrunner.client.app import TaskRunner


class EagerJob(Job):
    """A job that ran already: its record lives in memory, never in Redis."""

    def refresh(self) -> Job:
        if not self.data:
            raise JobNotFound(f"no job {self.id} in queue {self.queue} (deleted)")
        return self

    @property
    def state(self) -> str:
        return self.refresh().data["state"]

    def wait(self, timeout: float | None = None) -> Any:
        """The result, or JobFailed, at once: the job ended before enqueue returned."""
        if self.state == "completed":
            return self.result
        raise self._failure()

    def kill(self, who: str | None = None) -> str:
        """Nothing to kill: the job ended already; "already <state>", as Job.kill answers
        for an ended job."""
        return f"already {self.state}"

    def retry(self, who: str | None = None) -> bool:
        """Run a failed or killed job again, here and now."""
        if self.state not in ("failed", "killed"):
            return False
        for k in ("finished_at", "result"):
            self.data.pop(k, None)
        self.data.update({"failures": "0", "requeues": "0", "retry_requests": "0",
                          f"action:{_now()}": f"retried by {who or 'eager'}"})
        _run(self.app, self)
        return True

    def requeue(self, who: str | None = None) -> bool:
        self.refresh()
        return False  # never delayed nor running

    def delete(self) -> bool:
        self.refresh()
        self.data = {}
        return True


def enqueue(app: TaskRunner, job_id: str, fields: list[Any], parents: list[Job] | None = None) -> EagerJob:
    """Run the job that enqueue.lua would have stored with `fields` (app._fields's list);
    returns it ended. With `parents` (depends_on), only if they all completed: else it ends
    canceled, naming the first that did not."""
    data = {k: v.decode() if isinstance(v, bytes) else str(v) for k, v in zip(fields[::2], fields[1::2])}
    data.pop("expires", None)  # it runs now: no claim to come late (as a delay, ignored)
    data.update(enqueued_at=_now(), attempts="0", failures="0", requeues="0", retry_requests="0")
    job = EagerJob(app, job_id, data["queue"], data)
    failed = next((p for p in parents or () if p.data.get("state") != "completed"), None)
    if parents:
        data["parents"] = " ".join(f"{p.queue} {p.id}" for p in parents)
    if failed is None:
        _run(app, job)
    else:
        d = failed.data
        by = d.get("canceled_by") or f"{failed.queue} {failed.id}"
        why = d.get("error") if d.get("state") == "canceled" else (
            f"step {failed.id} (task {d.get('task')}) {d.get('state')}: {d.get('error_type')}: {d.get('error')}")
        data.update(state="canceled", finished_at=_now(), canceled_by=by, error_type="Canceled", error=why or "")
    return job


def parents_of(depends_on: Iterable[Job | str] | None) -> list[Job] | None:
    """depends_on in eager mode: Job objects only (an id names a job kept nowhere)."""
    if depends_on is None:
        return None
    given = list(depends_on)
    jobs = [j for j in given if isinstance(j, Job)]
    if len(jobs) != len(given):
        raise TypeError("in eager mode depends_on takes the Job objects that enqueue returned, not ids")
    return jobs


def chain(app: TaskRunner, steps: list[tuple[str, list[Any]]], immutable: list[bool]) -> EagerJob:
    """Run a chain's steps ((id, fields) each) in order: each given its parent's result
    first in its args unless immutable; after one that did not complete, canceled. The
    last step's job."""
    job: EagerJob | None = None
    for (job_id, fields), fixed in zip(steps, immutable):
        if job is not None and not fixed and job.data.get("state") == "completed":
            fields = _taking(fields, job.result)
        job = enqueue(app, job_id, fields, None if job is None else [job])
    assert job is not None
    return job


def chord(app: TaskRunner, callback: tuple[str, list[Any]], members: list[Job], immutable: bool,
          go_on: bool) -> EagerJob:
    """Run a chord's callback ((id, fields)) after its members ran: given the array of their
    results first in its args unless immutable; canceled after a member that did not
    complete, unless `go_on` (on_member_failure="continue": None in its place)."""
    job_id, fields = callback
    if not immutable:
        fields = _taking(fields, [m.result if m.data.get("state") == "completed" else None for m in members])
    return enqueue(app, job_id, fields, None if go_on else members)


def _taking(fields: list[Any], value: Any) -> list[Any]:
    """A job's fields with `value` first in its args: what the join does in Redis
    (_lib.lua's prepend()) for a step that takes its parents' results."""
    fields = list(fields)
    at = fields[::2].index("args") * 2 + 1
    fields[at] = codec.dumps([value, *codec.loads(fields[at])])
    return fields


def _run(app: TaskRunner, job: EagerJob) -> None:
    """Deliveries of the job until it ends, each recorded as finish.lua records it."""
    d = job.data
    d.update(worker="eager", host=socket.gethostname(), pid=str(os.getpid()))
    while True:
        attempt, t = int(d["attempts"]) + 1, _now()
        d.update(state="running", attempts=str(attempt), started_at=t)
        max_duration = d.get("max_duration") or str(app.settings.max_duration)
        message = job_message(job.id, str(attempt), d["task"], d["queue"], max_duration, d["args"], d["kwargs"],
                              d.get("headers", ""), "")  # no soft limit: soft_limit.py
        outcome, v1, v2, v3, _ = run_in_child(app, message, _Record(d)).wire()
        if outcome == "requeue":  # the task raised Retry
            asked, most = _count(d, "retry_requests"), int(d.get("max_retries", MAX_RETRIES))
            if asked <= most:
                _count(d, "requeues")
                d[f"end:{attempt}"] = f"{_now()} requeued itself (Retry), run again at once (eager)"
                continue
            v1, v2, v3 = "MaxRetriesExceeded", f"asked to retry {asked} times; max_retries is {most}", ""
        elif outcome == "error" and _count(d, "failures") <= int(d["retries"]):
            d.update(error_type=v1, error=v2, traceback=v3)  # kept until the next end, as finish.lua does
            d[f"end:{attempt}"] = f"{_now()} failed {v1}, run again at once (eager)"
            continue
        if outcome == "completed":
            d["result"] = v1
        else:
            d.update(error_type=v1, error=v2, traceback=v3)
        d.update(state="completed" if outcome == "completed" else "failed", finished_at=_now())
        d[f"end:{attempt}"] = f"{d['finished_at']} {'completed' if outcome == 'completed' else 'failed ' + v1}"
        return


def _count(d: dict[str, str], counter: str) -> int:
    """Add one to a counter of the record; its new value."""
    d[counter] = str(int(d[counter]) + 1)
    return int(d[counter])


def _now() -> str:
    return f"{time.time():.6f}"


class _Record:
    """Eager mode's context.Reporter: progress and log lines go straight into the record,
    as progress.lua would write them."""

    def __init__(self, data: dict[str, str]) -> None:
        self.data = data
        root = logging.getLogger()
        if not any(isinstance(h, JobLogHandler) for h in root.handlers):
            root.addHandler(JobLogHandler())  # `logging` in a task goes to its log too

    def progress(self, job: JobContext, fraction: float, note: str) -> None:
        self.data.update(progress=repr(fraction), progress_note=note, progress_at=_now())

    def record(self, job: JobContext, fields: tuple[str, ...]) -> list[str | None]:
        return [self.data.get(f) for f in fields]

    def log(self, job: JobContext, line: str) -> None:
        lines = [*filter(None, self.data.get("logs", "").split("\n")), log_line(job, line).decode()]
        if len(lines) > LOG_LINES:
            self.data["logs_dropped"] = str(int(self.data.get("logs_dropped", 0)) + len(lines) - LOG_LINES)
        self.data["logs"] = "\n".join(lines[-LOG_LINES:])
