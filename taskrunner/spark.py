"""Spark for producers: one job per row of a DataFrame, enqueued by Spark's executors.

    from taskrunner.spark import enqueue_dataframe
    n = enqueue_dataframe(df, "shop.reindex", id_column="sku", queue="reindex")

Each partition enqueues its rows in batches (TaskRunner.enqueue_many: one round trip per
`batch` jobs), the row's `id_column` as the job's id and its other columns as the task's
keyword arguments. enqueue.lua leaves a job whose id exists untouched (answer 0), so a
partition Spark runs again (a lost executor, a retried task) or the whole call run twice
enqueues each row once: as long as the job's record lives (until its result or failed TTL
after it ends). The executors get the settings (Redis URL, prefix, payload limit), never
the app: they connect on their own, and run no middleware of the app.

pyspark is only needed by the caller, who has a DataFrame: this module imports none."""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator
from dataclasses import asdict, replace
from typing import Any

from taskrunner.client.app import TaskRunner
from taskrunner.config import Settings
from taskrunner.protocol import codec
from taskrunner.protocol.urls import default_url

#: Spark types whose values a job's arguments (JSON) take as they are.
_JSON_TYPES = {"string", "integer", "long", "short", "byte", "float", "double", "boolean", "void", "null"}
#: Rows an executor hands enqueue_many at once (it sends them `batch` a round trip).
_SLICE = 10_000


def enqueue_dataframe(df: Any, task: str, *, id_column: str, queue: str | None = None, app: TaskRunner | None = None,
                      batch: int = 1000) -> int:
    """Enqueue `task` once per row of `df` (a pyspark DataFrame), with the job id from
    `id_column` (text or whole numbers; 1-200 letters, digits and _.:@-) and the other
    columns as keyword arguments; into `queue` (default: the task's). Settings from `app`,
    else from the environment (REDIS_URL, TASKRUNNER_PREFIX ...). Returns the number of
    jobs created: rows whose job exists already (this call run before, or a duplicate id)
    are not counted; nor are those that a Spark task enqueued in an attempt that Spark
    then ran again (the jobs are there once; the count of a retried partition is its last
    attempt's). A column of a type JSON does not have (timestamp, date, decimal, binary)
    is refused here, before Spark runs: cast it first."""
    codec.check_name("task", task)
    if queue is not None:
        codec.check_name("queue", queue)
    if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
        raise ValueError(f"batch must be a whole number >= 1, not {batch!r}")
    if id_column not in df.columns:
        raise ValueError(f"no column {id_column!r} in the DataFrame (its columns: {', '.join(df.columns)})")
    for field in df.schema.fields:
        if not _json_type(field.dataType):
            raise ValueError(f"column {field.name!r} is {field.dataType.simpleString()}, which JSON has not: cast it "
                             f"(e.g. to a string) before enqueue_dataframe")
    settings = app.settings if app is not None else Settings.from_env()
    if settings.eager:
        raise ValueError("enqueue_dataframe does not run in eager mode (the executors would run the jobs)")
    settings = replace(settings, redis_url=settings.redis_url or default_url())  # as resolved here

    def partition(rows: Iterable[Any]) -> Iterator[int]:
        yield enqueue_rows(settings, task, queue, id_column, rows, batch)

    return int(df.rdd.mapPartitions(partition).sum())


def enqueue_rows(settings: Settings, task: str, queue: str | None, id_column: str, rows: Iterable[Any],
                 batch: int = 1000) -> int:
    """In an executor: enqueue a partition's rows (pyspark Rows); the number of jobs created."""
    app = TaskRunner("enqueue_dataframe", **asdict(settings))
    created = 0
    jobs = (_job(task, queue, id_column, row.asDict(recursive=True)) for row in rows)
    while chunk := list(itertools.islice(jobs, _SLICE)):
        created += sum(job.created for job in app.enqueue_many(chunk, chunk=batch))
    return created


def _job(task: str, queue: str | None, id_column: str, values: dict[str, Any]) -> dict[str, Any]:
    job_id = values.pop(id_column)
    if isinstance(job_id, bool) or not isinstance(job_id, (str, int)):
        raise ValueError(f"column {id_column!r} holds {job_id!r}: a job id is text or a whole number")
    job: dict[str, Any] = {"task": task, "id": str(job_id), "kwargs": values}
    if queue is not None:
        job["queue"] = queue
    return job


def _json_type(t: Any) -> bool:
    """Is a Spark type's value (as Row.asDict gives it) JSON as it is?"""
    name = t.typeName()
    if name == "array":
        return _json_type(t.elementType)
    if name == "map":
        return t.keyType.typeName() == "string" and _json_type(t.valueType)
    if name == "struct":
        return all(_json_type(f.dataType) for f in t.fields)
    return name in _JSON_TYPES
