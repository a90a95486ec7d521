"""Failed and killed jobs by queue, task and error type, and acting on many of them at once
(the dashboard's Failed and Killed pages, its bulk retry and delete).

The scripts that end a job failed or killed also list it by its task, its error type and
both (`p <state>:task:<task>`, `p <state>:error:<type>`, `p <state>:te:<task> <type>`, see
docs/PROTOCOL.md, *Failure indexes*), and those that take it out (retry, delete, the sweep's
trim) take it out of these: a filtered page is one ZREVRANGE per queue, whatever the number
of jobs, and a job that completes pays nothing."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from taskrunner.client.job import Job
from taskrunner.errors import InvalidName, JobNotFound, TaskRunnerError
from taskrunner.ops import listing
from taskrunner.ops.queue import shards_of
from taskrunner.protocol import codec, scripts
from taskrunner.protocol import shards as sharding
from taskrunner.protocol.connection import server_time

if TYPE_CHECKING:
    from taskrunner.client.app import TaskRunner

STATES = ("failed", "killed")
#: The longest error type the indexes keep, in UTF-8 bytes (facet_of in _lib.lua cuts it there).
ERROR_TYPE_MAX = 200
#: Most jobs one bulk call acts on: a call stays well under a second or two, and the
#: dashboard shows progress between calls.
BATCH_MAX = 1000


def cut_error_type(error_type: str) -> str:
    """An error type as the indexes keep it: its first ERROR_TYPE_MAX bytes of UTF-8, less a
    character they cut in two (as cut_utf8 in _lib.lua), so that a job's whole type filters."""
    raw = error_type.encode()
    return raw[:ERROR_TYPE_MAX].decode(errors="ignore") if len(raw) > ERROR_TYPE_MAX else error_type


@dataclass(frozen=True)
class Filter:
    """Which failed (or killed) jobs: every field None means all of that state. A queue is
    a queue as users name it (a sharded one: all its shards, docs/PROTOCOL.md, Sharded
    queues), or one shard's name, "Q~i" (a job's page names the shard it is in): that shard
    alone."""

    state: str = "failed"
    queue: str | None = None
    task: str | None = None
    error: str | None = None

    @classmethod
    def parse(cls, raw: dict[str, Any]) -> Filter:
        """A filter from a query string or a JSON object; ValueError (one line) when a field
        is not one. Empty fields mean "any"."""
        if not isinstance(raw, dict):
            raise ValueError("filter must be an object with state, queue, task, error")
        unknown = set(raw) - {"state", "queue", "task", "error"}
        if unknown:
            raise ValueError(f"unknown filter field {sorted(unknown)[0]!r}: use state, queue, task, error")
        values = {k: raw.get(k) or None for k in ("state", "queue", "task", "error")}
        for k, v in values.items():
            if v is not None and not isinstance(v, str):
                raise ValueError(f"filter {k} must be a string")
        state = values["state"] or "failed"
        if state not in STATES:
            raise ValueError("state must be failed or killed")
        try:
            if values["queue"] is not None:
                codec.check_queue(values["queue"])
            if values["task"] is not None:
                codec.check_name("task", values["task"])
        except InvalidName as e:
            raise ValueError(str(e)) from None
        error = values["error"]
        if error is not None and len(error) > ERROR_TYPE_MAX:
            raise ValueError(f"error type longer than {ERROR_TYPE_MAX} characters")
        return cls(state, values["queue"], values["task"], None if error is None else cut_error_type(error))

    def as_dict(self) -> dict[str, Any]:
        return {k: v for k, v in (("state", self.state), ("queue", self.queue), ("task", self.task),
                                  ("error", self.error)) if v is not None}

    def key(self, app: TaskRunner, queue: str) -> str:
        """The ZSET of the queue that lists exactly the jobs this filter picks."""
        s = app.keys.q(queue) + self.state
        if self.task and self.error:
            return f"{s}:te:{self.task} {self.error}"
        if self.task:
            return f"{s}:task:{self.task}"
        if self.error:
            return f"{s}:error:{self.error}"
        return s

    def queues(self, app: TaskRunner) -> list[str]:
        """The physical queues whose indexes the filter reads, in a fixed order (a cursor
        counts in it): every queue's, or the shards of the one it names (shard 0 first)."""
        names = sorted(app.queue_names())
        if self.queue is None:
            return names
        if self.queue not in names:
            return []
        return [self.queue] if sharding.is_shard(self.queue) else shards_of(app, self.queue)


def page(app: TaskRunner, f: Filter, offset: int = 0, limit: int = 50) -> tuple[int, list[dict[str, Any]]]:
    """(total, one page of rows) of the jobs the filter picks, newest first, across its
    queues: a ZCARD per queue, then a ZREVRANGE of the page alone when one queue has such
    jobs (any page costs the same), else of offset + limit entries of each queue that has,
    merged (as listing.finished: a deep page over several queues costs its depth)."""
    queues = f.queues(app)
    pipe = app.redis.pipeline(transaction=False)
    for q in queues:
        pipe.zcard(f.key(app, q))
    counts = pipe.execute() if queues else []
    total = sum(counts)
    queues = [q for q, n in zip(queues, counts) if n]  # the others have nothing to show
    start = offset if len(queues) == 1 else 0
    for q in queues:
        pipe.zrevrange(f.key(app, q), start, offset + limit - 1, withscores=True)
    res = pipe.execute() if queues else []
    merged = sorted(((t, q, i) for q, entries in zip(queues, res) for i, t in entries), reverse=True)
    rows = [{"id": i, "queue": q} for _, q, i in merged[offset - start:offset - start + limit]]
    return total, listing.fill(app, rows, listing.FINISHED_FIELDS)


def facets(app: TaskRunner, state: str, queue: str | None = None) -> dict[str, dict[str, int]]:
    """The tasks and error types of the state's jobs (of one queue or all), with how many
    jobs each: {"tasks": {task: n}, "errors": {type: n}}, most first. One SMEMBERS per queue
    and one ZCARD per (task, error type) pair: no job is read."""
    queues = Filter(state, queue).queues(app)
    pipe = app.redis.pipeline(transaction=False)
    for q in queues:
        pipe.smembers(app.keys.q(q) + state + ":facets")
    pairs = [(q, pair) for q, members in zip(queues, pipe.execute() if queues else []) for pair in sorted(members)]
    for q, pair in pairs:
        pipe.zcard(f"{app.keys.q(q)}{state}:te:{pair}")
    tasks: dict[str, int] = {}
    errors: dict[str, int] = {}
    for (_, pair), n in zip(pairs, pipe.execute() if pairs else []):
        task, _, error = pair.partition(" ")
        if n:
            tasks[task] = tasks.get(task, 0) + n
            errors[error] = errors.get(error, 0) + n
    return {"tasks": dict(sorted(tasks.items(), key=lambda kv: (-kv[1], kv[0]))),
            "errors": dict(sorted(errors.items(), key=lambda kv: (-kv[1], kv[0])))}


@dataclass
class Cursor:
    """Where a bulk action over a filter goes on: jobs that ended at or before `before`
    (the server's time at the first call: jobs that fail meanwhile, a retried one failing
    again among them, are not taken), in queue `queue` (an index into the filter's queues)
    past the `skip` jobs there that were refused (they stay in the index, newest first). Jobs
    done and jobs gone leave the index: a gone one's record expired (its own failed_ttl was
    shorter than the setting) and the script that found it so took its id out of every index
    (docs/PROTOCOL.md, Failure indexes, "Forget"), so no call reads it again."""

    before: float
    queue: int = 0
    skip: int = 0

    @classmethod
    def parse(cls, raw: Any) -> Cursor | None:
        if raw is None:
            return None
        try:
            c = cls(float(raw["before"]), int(raw.get("queue", 0)), int(raw.get("skip", 0)))
        except (TypeError, KeyError, ValueError, AttributeError):
            raise ValueError("cursor must be the object a previous call answered") from None
        if c.queue < 0 or c.skip < 0:
            raise ValueError("cursor must be the object a previous call answered")
        return c


def act_on_filter(app: TaskRunner, action: str, f: Filter, cursor: Cursor | None, limit: int, who: str
                  ) -> dict[str, Any]:
    """Retry or delete up to `limit` jobs the filter picks, newest first, from `cursor` (None:
    from the start). Answers the counts, `left` (jobs still to look at, an estimate when
    jobs end meanwhile) and the `cursor` for the next call (None: done)."""
    queues = f.queues(app)
    c = cursor or Cursor(server_time(app.redis))
    counts = {"done": 0, "refused": 0, "gone": 0}
    errors: list[str] = []
    while c.queue < len(queues) and counts["done"] + counts["refused"] + counts["gone"] < limit:
        q = queues[c.queue]
        want = limit - counts["done"] - counts["refused"] - counts["gone"]
        ids = app.redis.zrevrangebyscore(f.key(app, q), c.before, "-inf", start=c.skip, num=want)
        for job_id in ids:
            outcome = _act(app, action, f.state, job_id, q, who, errors)
            counts[outcome] += 1
            if outcome == "refused":
                c.skip += 1
        if len(ids) < want:
            c.queue, c.skip = c.queue + 1, 0
    left = _left(app, f, queues, c)
    return {**counts, "left": left, "cursor": None if c.queue >= len(queues) else vars(c), "errors": errors[:5]}


def act_on_ids(app: TaskRunner, action: str, state: str, ids: list[str], who: str) -> dict[str, Any]:
    """Retry or delete these jobs (each looked up in every queue) if they are in `state`;
    answers the counts."""
    counts = {"done": 0, "refused": 0, "gone": 0}
    errors: list[str] = []
    for job_id in ids:
        try:
            job = app.job(job_id)
        except (JobNotFound, InvalidName):
            counts["gone"] += 1
            continue
        if job.data.get("state") != state:
            counts["refused"] += 1
            continue
        counts[_act(app, action, state, job_id, job.queue, who, errors)] += 1
    return {**counts, "left": 0, "cursor": None, "errors": errors[:5]}


def _act(app: TaskRunner, action: str, state: str, job_id: str, queue: str, who: str, errors: list[str]) -> str:
    """Retry or delete one job, if it is still in `state` (retry.lua takes only failed and
    killed ones; delete.lua is told which): done, refused or gone."""
    if action == "delete":
        before = scripts.DELETE(app.redis, [app.keys.q(queue)], [job_id, app.settings.failed_ttl, state])
        return "gone" if not before else "done" if before == state else "refused"
    try:
        return "done" if Job(app, job_id, queue).retry(who) else "refused"
    except JobNotFound:
        return "gone"
    except TaskRunnerError as e:  # a workflow step that could never run
        errors.append(f"{job_id}: {e}")
        return "refused"


def _left(app: TaskRunner, f: Filter, queues: list[str], c: Cursor) -> int:
    """Jobs the cursor has still to look at."""
    rest = queues[c.queue:]
    if not rest:
        return 0
    pipe = app.redis.pipeline(transaction=False)
    for q in rest:
        pipe.zcount(f.key(app, q), "-inf", c.before)
    return max(0, sum(pipe.execute()) - c.skip)


#: Ids one reindex step reads (ZSCAN's COUNT) and indexes (one reindex.lua call).
REINDEX_BATCH = 500


def reindex(app: TaskRunner, queue: str | None = None, batch: int = REINDEX_BATCH,
            progress: Callable[[str, str, int, int, bool], None] | None = None) -> dict[str, dict[str, dict[str, int]]]:
    """Build the failure indexes of the failed and killed jobs that ended before the scripts
    kept them (`taskrunner failures reindex`): every queue's, or one queue's (a sharded one:
    each shard). Reads each `p <state>` with ZSCAN (every id there from start to end is seen,
    whatever jobs come and go meanwhile), `batch` ids a step, and hands each batch to
    reindex.lua, which indexes the ids still in that state with their score: safe beside live
    workers and to run again. `progress(queue, state, seen, total, last)` after each step. Answers
    {queue: {state: {"total", "indexed", "skipped"}}} (ZSCAN may give an id twice: counted
    twice, indexed once)."""
    out: dict[str, dict[str, dict[str, int]]] = {}
    for q in Filter(queue=queue).queues(app):
        p = app.keys.q(q)
        for state in STATES:
            counts = {"total": app.redis.zcard(p + state), "indexed": 0, "skipped": 0}
            cursor = None
            while cursor != 0 and counts["total"]:
                cursor, entries = app.redis.zscan(p + state, cursor or 0, count=batch)
                ids = [i for i, _ in entries]
                if ids:
                    indexed, skipped = scripts.REINDEX(app.redis, [p], [state, *ids])
                    counts["indexed"] += indexed
                    counts["skipped"] += skipped
                if progress:
                    progress(q, state, counts["indexed"] + counts["skipped"], counts["total"], cursor == 0)
            out.setdefault(q, {})[state] = counts
    return out
