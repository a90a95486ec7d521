"""Read-only views of queues, jobs and workers for the CLI and the dashboard. Each reads
only what it shows: counts with LLEN/SCARD/ZCARD/HLEN and pages with ranges, never KEYS
or SCAN."""

from __future__ import annotations

from typing import Any

from . import codec
from .app import TaskRunner
from .job import Job

LIST_STATES = ("pending", "delayed", "running", "stuck", "completed", "failed", "killed")


def queue_stats(app: TaskRunner) -> list[dict[str, Any]]:
    names = app.queue_names()
    pipe = app.redis.pipeline(transaction=False)
    for q in names:
        p = app.keys.q(q)
        pipe.llen(p + "pending").zcard(p + "delayed").hlen(p + "running")
        pipe.zcard(p + "completed").zcard(p + "failed").zcard(p + "killed")
    r = pipe.execute()
    fields = ("pending", "delayed", "running", "completed", "failed", "killed")
    return [{"name": q, **dict(zip(fields, r[i * 6:(i + 1) * 6]))} for i, q in enumerate(names)]


def job_ids(app: TaskRunner, queue: str, state: str, limit: int = 50, offset: int = 0) -> list[str]:
    """Ids in a state, oldest pending first, soonest delayed first, newest finished first."""
    p, r = app.keys.q(queue), app.redis
    end = offset + limit - 1
    if state == "pending":
        return r.lrange(p + "pending", -end - 1, -offset - 1 if offset else -1)[::-1]
    if state == "delayed":
        return r.zrange(p + "delayed", offset, end)
    if state in ("running", "stuck"):
        ids = sorted(r.hkeys(p + "running"))
        return ids if state == "stuck" else ids[offset:end + 1]
    return r.zrevrange(p + state, offset, end)


def list_jobs(app: TaskRunner, queue: str | None = None, state: str | None = None,
              limit: int = 50, offset: int = 0) -> list[Job]:
    if state is not None and state not in LIST_STATES:
        raise ValueError(f"state must be one of {', '.join(LIST_STATES)}")
    queues = [queue] if queue else app.queue_names()
    states = [state] if state else ["running", "pending", "delayed", "failed", "killed", "completed"]
    found: list[tuple[str, str]] = []
    for q in queues:
        for s in states:
            found += [(q, i) for i in job_ids(app, q, s, limit, offset)]
    pipe = app.redis.pipeline(transaction=False)
    for q, i in found:
        pipe.hgetall(app.keys.job(q, i))
    jobs = [Job(app, i, q, d) for (q, i), d in zip(found, pipe.execute()) if d]
    if state == "stuck":
        jobs = [j for j in jobs if j.data.get("stuck") == "1"][offset:offset + limit]
    return jobs[:limit] if queue or state else jobs


def workers(app: TaskRunner) -> list[dict[str, Any]]:
    """Live workers with their last heartbeat, then the dead ones (kept an hour)."""
    r = app.redis
    sec, usec = r.time()
    now = sec + usec / 1e6
    live = r.zrange(app.keys.workers, 0, -1, withscores=True)
    dead = r.zrange(app.keys.workers_dead, 0, -1, withscores=True)
    names = [n for n, _ in live] + [n for n, _ in dead]
    infos = r.mget([app.keys.worker(n) for n in names]) if names else []
    out = []
    for (n, t), raw in zip(live + dead, infos):
        try:
            info = codec.loads(raw) if raw else {}
        except ValueError:
            info = {}
        is_dead = (n, t) in dead or now - t >= app.settings.dead_after
        out.append({**info, "name": n, "state": "dead" if is_dead else "alive",
                    "heartbeat_age": round(now - t, 3) if (n, t) in live else None,
                    "died_at": t if (n, t) in dead else None})
    return out
