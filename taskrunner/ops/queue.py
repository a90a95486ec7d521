"""Queue administration (after the pressure protocol): bounds, closing, exclusive
queues, deletion, and each queue's counters. Settings live in the queue's `meta` hash,
which the enqueue and claim scripts read."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from taskrunner.errors import QueueNotFound, TaskRunnerError
from taskrunner.protocol import codec

if TYPE_CHECKING:
    from taskrunner.client.app import TaskRunner

COUNTERS = ("produced_messages", "produced_bytes", "consumed_messages", "consumed_bytes")


def create(app: TaskRunner, name: str, bound: int = 0, exclusive: bool = False) -> None:
    """Create a queue, or change its settings: `bound` > 0 caps its pending jobs (producers
    block, then QueueFull); `exclusive` runs at most one of its jobs at a time, in order."""
    codec.check_name("queue", name)
    if bound < 0:
        raise ValueError("bound must be >= 0 (0: no bound)")
    meta = app.keys.q(name) + "meta"
    pipe = app.redis.pipeline(transaction=False)
    pipe.hset(meta, mapping={"bound": bound, "exclusive": int(exclusive)})
    pipe.sadd(app.keys.queues, name)
    pipe.lpush(app.keys.q(name) + "notfull", "1").ltrim(app.keys.q(name) + "notfull", 0, 0)
    pipe.execute()


def close(app: TaskRunner, name: str) -> None:
    """No new jobs (enqueue raises QueueClosed); jobs already queued still run. open()
    undoes it."""
    must_exist(app, name)
    app.redis.hset(app.keys.q(name) + "meta", "closed", 1)


def open(app: TaskRunner, name: str) -> None:  # the counterpart of close(), named as the CLI command
    """Take new jobs again after close()."""
    must_exist(app, name)
    app.redis.hdel(app.keys.q(name) + "meta", "closed")


def deletable(app: TaskRunner, name: str, force: bool = False) -> dict[str, int]:
    """What delete() would remove, jobs counted by state; raises what delete() would
    (no such queue; jobs running and not forced), so that a caller can ask first."""
    must_exist(app, name)
    p, r = app.keys.q(name), app.redis
    pending, delayed, waiting, running, *finished = (
        r.pipeline(transaction=False).llen(p + "pending").zcard(p + "delayed").zcard(p + "waiting")
        .hlen(p + "running").zcard(p + "completed").zcard(p + "failed").zcard(p + "killed").zcard(p + "canceled")
        .execute())
    if running and not force:
        raise TaskRunnerError(f"queue {name} has {running} running jobs: kill them, wait, or force")
    return {"pending": pending, "delayed": delayed, "waiting": waiting, "running": running,
            "finished": sum(finished)}


def delete(app: TaskRunner, name: str, force: bool = False) -> int:
    """Remove every key of the queue and forget it; refused while its jobs run unless
    forced (their workers' results are then fenced off). Returns the keys deleted."""
    deletable(app, name, force)
    p = app.keys.q(name)
    deleted = 0
    # SCAN, not KEYS: an admin operation that must find every job record of the queue.
    pattern = p.replace("[", "\\[") + "*"
    batch: list[str] = []
    for key in app.redis.scan_iter(match=pattern, count=1000):
        batch.append(key)
        if len(batch) >= 1000:
            deleted += app.redis.unlink(*batch)
            batch = []
    if batch:
        deleted += app.redis.unlink(*batch)
    app.redis.srem(app.keys.queues, name)
    app._known_queues.discard(name)
    return deleted


def info(app: TaskRunner, name: str) -> dict[str, Any]:
    """Settings and counters of one queue."""
    return settings(app, [name])[0]


def settings(app: TaskRunner, names: list[str]) -> list[dict[str, Any]]:
    pipe = app.redis.pipeline(transaction=False)
    for n in names:
        pipe.hgetall(app.keys.q(n) + "meta")
    out = []
    for meta in pipe.execute():
        d: dict[str, Any] = {c: int(meta.get(c, 0)) for c in COUNTERS}
        d.update(bound=int(meta.get("bound", 0)), closed=meta.get("closed") == "1",
                 exclusive=meta.get("exclusive") == "1")
        out.append(d)
    return out


def must_exist(app: TaskRunner, name: str) -> None:
    codec.check_name("queue", name)
    if not app.redis.sismember(app.keys.queues, name):
        raise QueueNotFound(f"no queue {name!r} (see `taskrunner queues`)")
