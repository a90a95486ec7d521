"""How taskrunner's processes log: the one place that configures `logging` for the
worker, the dispatcher, `consume`, the dashboard and gunicorn, in one of two formats
(--log-format, TASKRUNNER_LOG_FORMAT):

- text (the default): `2026-01-02 03:04:05,678 WARNING message`, for people;
- json: one JSON object per line, for log collectors (Loki, Elasticsearch, CloudWatch...)
  that would otherwise have to parse free text and split tracebacks back together:
  `time` (ISO 8601, UTC, milliseconds), `level`, `logger`, `message`, `process` (pid),
  `exc` (a traceback, when there is one: newlines escaped, so still one line), and each
  field a record carries beyond logging's own: on every event about a job, `job_id`,
  `task`, `queue`, `attempt` and `worker` (job_fields()), so that a job's story can be
  found by its id across every process that touched it.

A worker's children are forked from it, so they log as it does; the job fields of what a
task logs come from the job it runs (worker/context.py, JobFields)."""

from __future__ import annotations

import json
import logging
import sys
from collections.abc import Callable, Mapping
from datetime import datetime, timezone
from typing import Any, NamedTuple, Protocol

import orjson

FORMATS = ("text", "json")
TEXT_FORMAT = "%(asctime)s %(levelname)s %(message)s"
#: What --help says about the choice (the CLI's and gunicorn's, from here).
FORMAT_HELP = ("text: for people. json: one object per line on stderr, for log collectors; fields: time (ISO 8601 "
               "UTC), level, logger, message, process, exc (a traceback, one line); on job events also job_id, "
               "task, queue, attempt, worker. Env: TASKRUNNER_LOG_FORMAT.")

# A LogRecord's own attributes: every other one was given with extra= and becomes a field.
_OWN = frozenset(logging.LogRecord("", 0, "", 0, "", (), None).__dict__) | {"message", "asctime", "taskName"}


class JobLike(Protocol):
    """A delivery (protocol.claims.Delivery), a running job (worker.context.JobContext) or
    anything else that names one run of a job."""

    @property
    def id(self) -> str: ...

    @property
    def task(self) -> str: ...

    @property
    def queue(self) -> str: ...

    @property
    def attempt(self) -> str | int: ...


class Run(NamedTuple):
    """One run of a job named by its parts, where no delivery or job object is at hand
    (the dispatcher reads them from the holding entry and the record)."""

    id: str
    task: str
    queue: str
    attempt: str | int


def job_fields(job: JobLike, worker: str | None = None) -> dict[str, Any]:
    """`extra=` for a record about one run of a job: the fields a log collector finds a job
    by. `worker` is the worker it ran on; left out (None) in a worker's own processes, whose
    records all carry their worker (Fields)."""
    fields = {"job_id": job.id, "task": job.task, "queue": job.queue, "attempt": _number(job.attempt)}
    if worker is not None:
        fields["worker"] = worker
    return fields


def _number(attempt: str | int) -> int | str:
    """Attempts are numbers on the wire as text; one another client wrote badly stays text."""
    try:
        return int(attempt)
    except ValueError:
        return attempt


class JsonFormatter(logging.Formatter):
    """One JSON object per record, on one line (see the module's docstring). Never raises:
    a value orjson cannot encode (a huge int, a lone surrogate, an object) is written by
    the json module, as text where it is no JSON value."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "time": datetime.fromtimestamp(record.created, timezone.utc).strftime("%Y-%m-%dT%H:%M:%S")
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
            "process": record.process,
        }
        for key, value in record.__dict__.items():
            if key not in _OWN and key not in out:
                out[key] = value
        if record.exc_info:
            record.exc_text = record.exc_text or self.formatException(record.exc_info)
        if record.exc_text:
            out["exc"] = record.exc_text
        if record.stack_info:
            out["stack"] = self.formatStack(record.stack_info)
        try:
            return orjson.dumps(out, default=str).decode()
        except (TypeError, orjson.JSONEncodeError):
            return json.dumps(out, default=str)


class Fields(logging.Filter):
    """Adds fields to every record a handler writes, unless the record has them already
    (extra= wins): a worker's name on all its processes' records, the running job's
    fields on what a task logs. `fields` is called for each record."""

    def __init__(self, fields: Callable[[], Mapping[str, Any]]) -> None:
        super().__init__()
        self.fields = fields

    def filter(self, record: logging.LogRecord) -> bool:
        for key, value in self.fields().items():
            if key not in record.__dict__:
                setattr(record, key, value)
        return True


def add_fields(fields: Callable[[], Mapping[str, Any]]) -> None:
    """Give every record this process's handlers write the fields `fields()` returns (see
    Fields); processes forked later inherit it."""
    for handler in logging.getLogger().handlers:
        handler.addFilter(Fields(fields))


def formatter(log_format: str) -> logging.Formatter:
    """The formatter for `log_format`; ValueError, saying the choices, for another."""
    if log_format == "json":
        return JsonFormatter()
    if log_format == "text":
        return logging.Formatter(TEXT_FORMAT)
    raise ValueError(f"log format must be one of {', '.join(FORMATS)}, not {log_format!r} "
                     "(--log-format, TASKRUNNER_LOG_FORMAT)")


def configure(level: str = "info", log_format: str = "text") -> None:
    """Log records of `level` and above to stderr in `log_format`: what every long-running
    command does first."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(formatter(log_format))
    logging.basicConfig(level=getattr(logging, level.upper()), handlers=[handler])
