"""current_job(): what a running task may know about the delivery it runs in (its id,
attempt, queue and deadline), without taking it as an argument, and where it reports its
progress and log lines. A context variable, so it is right in threads and coroutines as
well as in a plain child process."""

from __future__ import annotations

import logging
import time
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import orjson

from taskrunner.errors import MAX_RETRIES, TaskRunnerError
from taskrunner.logs import job_fields
from taskrunner.worker import spark_session

if TYPE_CHECKING:
    from taskrunner.protocol.outcome import Outcome

#: Log lines a job keeps (the oldest go first; the record counts those dropped), and the
#: characters a line or a progress note is cut to.
LOG_LINES = 100
LINE_MAX = 2000


class Reporter(Protocol):
    """Where a job's progress and log lines go: in a worker's child, the pipe to the
    worker (which batches them into its syncs with Redis); in eager mode, the record."""

    def progress(self, job: JobContext, fraction: float, note: str) -> None: ...

    def log(self, job: JobContext, line: str) -> None: ...

    def record(self, job: JobContext, fields: tuple[str, ...]) -> list[str | None]:
        """Fields of the job's record, read when asked (in a worker's child: one round
        trip to Redis), so that what few tasks and hooks ask costs the others nothing."""
        ...


@dataclass(frozen=True)
class JobContext:
    """The delivery a task runs in. `attempt` counts deliveries (1 the first; the fencing
    token of its finish); `deadline` is when its max duration ends (epoch seconds);
    `headers` the job's (a dict, {} when none)."""

    id: str
    task: str
    queue: str
    attempt: int
    deadline: float
    headers: dict[str, Any] = field(default_factory=dict)
    reporter: Reporter | None = field(default=None, repr=False, compare=False)
    uses_spark: bool = field(default=False, repr=False, compare=False)  # its task is spark=True

    @property
    def spark(self) -> Any:
        """The SparkSession of this process, for a task declared `@app.task(spark=True)`:
        made on first use (local[*], or TASKRUNNER_SPARK_MASTER; settings as `taskrunner
        analyze`'s: TASKRUNNER_SPARK_CONF over the defaults) and kept for the next jobs of
        this child; this job's Spark jobs run in its job group, canceled if the job is
        killed or passes its max duration (spark_session.py). Other tasks get
        TaskRunnerError: their children must not start a JVM."""
        if not self.uses_spark:
            raise TaskRunnerError(f"current_job().spark is for tasks declared with @app.task(spark=True); "
                                  f"{self.task} is not")
        return spark_session.CHILD.get(self.id)

    def progress(self, fraction: float, note: str = "") -> None:
        """Say how far the job is (0..1) and, optionally, what it is doing: shown live by
        `taskrunner status ID`, /api/jobs/<id> and the job page. Costs no Redis round trip:
        the worker sends the latest with its next sync (within half a second)."""
        f = float(fraction)
        if not 0.0 <= f <= 1.0:
            raise ValueError(f"progress takes a fraction from 0 to 1, not {fraction!r}")
        if self.reporter is not None:
            self.reporter.progress(self, f, str(note)[:LINE_MAX])

    @property
    def retries_left(self) -> int:
        """How many more times an exception raised now would be retried (0: the job fails
        if this run raises); read from the job's record when asked."""
        retries, failures = self._record("retries", "failures")
        return max(0, _whole(retries) - _whole(failures))

    def will_retry(self, outcome: Outcome) -> bool:
        """Will the job run again after this run ends with `outcome`? finish.lua's rule
        (Outcome.will_retry), on the record as it is now."""
        retries, failures, max_retries, asked = self._record("retries", "failures", "max_retries", "retry_requests")
        most = MAX_RETRIES if max_retries is None else _whole(max_retries)
        return outcome.will_retry(_whole(retries) - _whole(failures), most - _whole(asked))

    def _record(self, *fields: str) -> list[str | None]:
        return list(self.reporter.record(self, fields)) if self.reporter is not None else [None] * len(fields)

    def log(self, message: str, *args: Any) -> None:
        """Add a line to the job's log (`message % args`, as logging does), kept with the
        job (the last LOG_LINES lines, each cut to LINE_MAX characters) and expiring with it."""
        line = str(message) % args if args else str(message)
        if self.reporter is not None:
            self.reporter.log(self, line[:LINE_MAX])


def _whole(text: str | None) -> int:
    """A count from the record (0 when absent or not a number another client wrote)."""
    try:
        return int(text or 0)
    except ValueError:
        return 0


_current: ContextVar[JobContext | None] = ContextVar("taskrunner_job", default=None)


def current_job() -> JobContext:
    """The job the calling task runs in; TaskRunnerError outside a task."""
    job = _current.get()
    if job is None:
        raise TaskRunnerError("current_job() is only available inside a task that a worker runs")
    return job


def log_line(job: JobContext, line: str) -> bytes:
    """A log line as the record keeps it: the JSON array [time, attempt, text]."""
    return orjson.dumps([round(time.time(), 6), job.attempt, line])


def running_job_fields() -> dict[str, Any]:
    """The log fields of the job the caller runs ({} outside a job): a worker's children
    give them to every record (logs.add_fields), so that what a task logs names its job."""
    job = _current.get()
    return {} if job is None else job_fields(job)


class JobLogHandler(logging.Handler):
    """Installed in workers' children (and in eager mode): a record logged while a task
    runs (through `logging`, at the worker's log level) goes to that job's log too."""

    def emit(self, record: logging.LogRecord) -> None:
        job = _current.get()
        if job is None:
            return
        try:
            job.log(f"{record.levelname} {record.name}: {record.getMessage()}")
        except Exception:  # noqa: BLE001 — a log line must never fail the task
            self.handleError(record)
