"""Queue administration (after the pressure protocol): bounds, closing, exclusive
queues, pausing, rate limits, deletion, and each queue's counters. Settings live in the
queue's `meta` hash, which the enqueue and claim scripts read."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from taskrunner.errors import QueueNotFound, TaskRunnerError
from taskrunner.protocol import codec
from taskrunner.protocol.connection import server_time

if TYPE_CHECKING:
    from taskrunner.client.app import TaskRunner

COUNTERS = ("produced_messages", "produced_bytes", "consumed_messages", "consumed_bytes")


def create(app: TaskRunner, name: str, bound: int = 0, exclusive: bool = False, rate: str | None = None) -> None:
    """Create a queue, or change its settings: `bound` > 0 caps its pending jobs (producers
    block, then QueueFull); `exclusive` runs at most one of its jobs at a time, in order;
    `rate` ("50/s", "N/m", "N/h"), when given, is how many of its jobs may start, across
    all workers (None: the queue's rate limit, if any, stays; set_rate() changes it)."""
    codec.check_name("queue", name)
    if bound < 0:
        raise ValueError("bound must be >= 0 (0: no bound)")
    settings: dict[str, Any] = {"bound": bound, "exclusive": int(exclusive)}
    if rate is not None:
        settings["rate"] = codec.rate("rate", rate)
    meta = app.keys.q(name) + "meta"
    pipe = app.redis.pipeline(transaction=False)
    pipe.hset(meta, mapping=settings)
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


def set_rate(app: TaskRunner, name: str, rate: str | None) -> None:
    """Limit how many of the queue's jobs start ("50/s", "N/m", "N/h"), across all
    workers; None removes the limit. Claims read it at once (docs/PROTOCOL.md, Flow
    control); a lower limit applies from the next start on."""
    must_exist(app, name)
    p = app.keys.q(name)
    pipe = app.redis.pipeline(transaction=False)
    if rate is None:
        pipe.hdel(p + "meta", "rate")
    else:
        pipe.hset(p + "meta", "rate", codec.rate("rate", rate))
    # A wake token: a worker sleeping until the old limit's next token claims now.
    pipe.lpush(p + "wake", "1").ltrim(p + "wake", 0, 0)
    pipe.execute()


def pause(app: TaskRunner, name: str) -> None:
    """Workers claim nothing from the queue (claim.lua reads meta `paused` with the settings
    it reads anyway) and sleep on it: an enqueue into a paused queue leaves no wake token.
    It still takes new jobs; running ones go on. resume() undoes it."""
    must_exist(app, name)
    app.redis.hset(app.keys.q(name) + "meta", "paused", 1)


def resume(app: TaskRunner, name: str) -> None:
    """Workers claim from the queue again: a wake token wakes one idle worker, whose claim
    leaves another while jobs remain (as after an enqueue)."""
    must_exist(app, name)
    p = app.keys.q(name)
    app.redis.pipeline(transaction=False).hdel(p + "meta", "paused").lpush(p + "wake", "1").ltrim(
        p + "wake", 0, 0).execute()


def pending_keys(p: str, priorities: str | None) -> list[str]:
    """The pending lists of the queue of key prefix `p`, in claim order: one per priority
    its meta `priorities` lists (e.g. "95"), highest first, then `pending` (priority 0)."""
    return [f"{p}pending:{c}" for c in priorities or "" if c in "123456789"] + [p + "pending"]


def deletable(app: TaskRunner, name: str, force: bool = False) -> dict[str, int]:
    """What delete() would remove, jobs counted by state; raises what delete() would
    (no such queue; jobs running and not forced), so that a caller can ask first."""
    must_exist(app, name)
    p, r = app.keys.q(name), app.redis
    pending = backlog(app, name)
    delayed, waiting, running, *finished = (
        r.pipeline(transaction=False).zcard(p + "delayed").zcard(p + "waiting")
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


def backlog(app: TaskRunner, name: str) -> int:
    """Jobs pending in the queue, of every priority."""
    p = app.keys.q(name)
    pipe = app.redis.pipeline(transaction=False)
    for key in pending_keys(p, app.redis.hget(p + "meta", "priorities")):
        pipe.llen(key)
    return sum(pipe.execute())


def settings(app: TaskRunner, names: list[str]) -> list[dict[str, Any]]:
    """Settings and counters of each queue (bound, closed, exclusive, paused), the priorities
    its jobs used (e.g. [9, 5]) and the duplicates of unique jobs not added, per task; with
    its rate limit (None: none) the starts it counted in the current period of the limit
    (`rate_used`: this second, minute or hour) and in the one before (`rate_used_last`)."""
    pipe = app.redis.pipeline(transaction=False)
    for n in names:
        pipe.hgetall(app.keys.q(n) + "meta")
        pipe.hgetall(app.keys.q(n) + "limit")
    answers = pipe.execute()
    now = server_time(app.redis) if any(meta.get("rate") for meta in answers[::2]) else 0.0
    out = []
    for meta, limit in zip(answers[::2], answers[1::2]):
        d: dict[str, Any] = {c: int(meta.get(c, 0)) for c in COUNTERS}
        d.update(bound=int(meta.get("bound", 0)), closed=meta.get("closed") == "1",
                 exclusive=meta.get("exclusive") == "1", rate=meta.get("rate"), paused=meta.get("paused") == "1",
                 priorities=[int(c) for c in meta.get("priorities", "") if c in "123456789"],
                 duplicates={k.partition("|")[2]: int(v) for k, v in meta.items() if k.startswith("duplicates|")})
        d.update(rate_use(meta.get("rate"), limit, now))
        out.append(d)
    return out


def rate_use(rate: str | None, limit: dict[str, str], now: float) -> dict[str, int]:
    """A rate limiter's starts this period and the last (claim.lua keeps them with its
    state: `win`, the period's number, `used` and `before`), read at server time `now`."""
    try:
        codec.rate("rate", rate)
        _, period = codec.rate_period(rate or "")
        win, used, before = int(limit["win"]), int(limit["used"]), int(limit["before"])
    except (ValueError, KeyError):
        return {"rate_used": 0, "rate_used_last": 0}
    current = int(now // period)
    if win == current:
        return {"rate_used": used, "rate_used_last": before}
    return {"rate_used": 0, "rate_used_last": used if win == current - 1 else 0}


def must_exist(app: TaskRunner, name: str) -> None:
    codec.check_name("queue", name)
    if not app.redis.sismember(app.keys.queues, name):
        raise QueueNotFound(f"no queue {name!r} (see `taskrunner queues`)")
