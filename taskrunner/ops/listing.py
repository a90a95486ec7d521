"""Read-only views of queues, jobs and workers for the CLI and the dashboard. Each reads
only what it shows: counts with LLEN/SCARD/ZCARD/HLEN and pages with ranges, never KEYS
or SCAN."""

from __future__ import annotations

from dataclasses import asdict
from typing import TYPE_CHECKING, Any

from taskrunner.client.job import Job, typed
from taskrunner.ops import queue
from taskrunner.ops.queue import backlog, pending_keys, shards_of
from taskrunner.protocol import codec
from taskrunner.protocol import shards as sharding
from taskrunner.protocol.connection import server_time
from taskrunner.protocol.holders import Holding, number

if TYPE_CHECKING:
    from taskrunner.client.app import TaskRunner

LIST_STATES = ("waiting", "pending", "delayed", "running", "stuck", "completed", "failed", "killed", "canceled")


def queue_stats(app: TaskRunner, shards: bool = False) -> list[dict[str, Any]]:
    """Counts, counters and settings per queue: a sharded queue once, its shards' figures
    summed (queue.combined), unless `shards`: then each physical queue, shards included,
    each with its own figures: shard 0's `rate` is its part, as the other shards' are (the
    queue's is its `rate_total`), where queue.settings() gives it the queue's."""
    rows = _physical_stats(app)
    if shards:
        for row in rows:
            if "rate_each" in row:
                row["rate_total"], row["rate"] = row["rate"], row.pop("rate_each")
        return rows
    by_queue: dict[str, list[dict[str, Any]]] = {}
    for row in rows:  # sorted by name: shard 0 ("Q") before "Q~1"
        by_queue.setdefault(sharding.logical(row["name"]), []).append(row)
    return [{**queue.combined(group), "name": name} for name, group in by_queue.items()]


def shard_stats(app: TaskRunner, name: str) -> list[dict[str, Any]]:
    """Counts, counters and settings of each shard of queue `name` (shard 0 first; one row
    when it is not sharded), for its dashboard page: a few round trips, O(1) commands per
    shard and state (LLEN, ZCARD, HLEN), whatever the number of jobs."""
    return _physical_stats(app, shards_of(app, name))


def _physical_stats(app: TaskRunner, names: list[str] | None = None) -> list[dict[str, Any]]:
    names = app.queue_names() if names is None else names
    metas = queue.settings(app, names)
    counts = queue.state_counts(app, names)
    pending = queue.backlogs(app, names, ["".join(map(str, meta["priorities"])) for meta in metas])
    return [{"name": q, **c, "pending": n, **meta} for q, c, n, meta in zip(names, counts, pending, metas)]


def job_ids(app: TaskRunner, queue: str, state: str, limit: int = 50, offset: int = 0) -> list[str]:
    """Ids in a state, oldest pending (and waiting) first, soonest delayed first, newest
    finished first."""
    p, r = app.keys.q(queue), app.redis
    end = offset + limit - 1
    if state == "pending":
        keys = pending_keys(p, r.hget(p + "meta", "priorities"))
        if len(keys) == 1:
            return r.lrange(p + "pending", -end - 1, -offset - 1 if offset else -1)[::-1]
        return _pending_page(app, keys, offset, limit)
    if state in ("delayed", "waiting"):
        return r.zrange(p + state, offset, end)
    if state in ("running", "stuck"):
        ids = sorted(r.hkeys(p + "running"))
        return ids if state == "stuck" else ids[offset:end + 1]
    return r.zrevrange(p + state, offset, end)


def _pending_page(app: TaskRunner, keys: list[str], offset: int, limit: int) -> list[str]:
    """A page of the ids of a queue with priorities, in claim order: the lists `keys` one
    after the other (highest priority first), each oldest first."""
    lengths = app.redis.pipeline(transaction=False)
    for key in keys:
        lengths.llen(key)
    ids: list[str] = []
    for key, n in zip(keys, lengths.execute()):
        if len(ids) >= limit:
            break
        if offset >= n:
            offset -= n
            continue
        take = min(n - offset, limit - len(ids))
        ids += app.redis.lrange(key, -(offset + take), -offset - 1)[::-1]
        offset = 0
    return ids


def list_jobs(app: TaskRunner, queue: str | None = None, state: str | None = None,
              limit: int = 50, offset: int = 0) -> list[Job]:
    if state is not None and state not in LIST_STATES:
        raise ValueError(f"state must be one of {', '.join(LIST_STATES)}")
    queues = shards_of(app, queue) if queue else app.queue_names()
    states = [state] if state else ["running", "pending", "waiting", "delayed", "failed", "killed", "canceled",
                                    "completed"]
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


def workers(app: TaskRunner, held: bool = False) -> list[dict[str, Any]]:
    """Live workers with their last heartbeat, then the dead ones (kept an hour); with
    `held`, each keeps the `running` list its heartbeat gives (worker() reads those jobs)."""
    r = app.redis
    now = server_time(app.redis)
    live = r.zrange(app.keys.workers, 0, -1, withscores=True)
    dead = r.zrange(app.keys.workers_dead, 0, -1, withscores=True)
    rows = [(n, t, False) for n, t in live] + [(n, t, True) for n, t in dead]
    infos = r.mget([app.keys.worker(n) for n, _, _ in rows]) if rows else []
    out = []
    for (n, t, buried), raw in zip(rows, infos):
        info = _worker_info(raw)
        is_dead = buried or now - t >= app.settings.dead_after
        if is_dead:  # its last heartbeat's figures are not the truth any more: a dead worker runs nothing
            info.update(busy=None, cpu=None)
        if not held:
            info.pop("running", None)
        out.append({**info, "name": n, "state": "dead" if is_dead else "alive",
                    "heartbeat_age": None if buried else round(now - t, 3), "died_at": t if buried else None})
    return out


def worker(app: TaskRunner, name: str, limit: int = 100) -> dict[str, Any] | None:
    """One worker as workers() gives it, with its children (PID and RSS, when the worker
    publishes them), how many jobs it runs now (`held`) and up to `limit` of them, those it
    has held longest, oldest first (those its heartbeat lists: a read of each, whatever the
    number of running jobs); None when no worker of that name is listed."""
    now = server_time(app.redis)
    found = next((w for w in workers(app, held=True) if w["name"] == name), None)
    if found is None:
        return None
    rss = found.pop("children_rss", None)
    rss = rss if isinstance(rss, dict) else {}
    pids = found.get("children")
    found["children"] = [{"pid": pid, "rss": number(rss.get(str(pid)))}
                         for pid in (pids if isinstance(pids, list) else []) if number(pid) is not None]
    held = found.pop("running", None)
    if found["state"] != "alive" or not limit:
        jobs: list[dict[str, Any]] = []
        found["held"] = 0 if found["state"] != "alive" else None
    elif isinstance(held, list):
        found["held"], jobs = held_by(app, name, held, now, limit)
    else:  # a consumer's heartbeat (ours, the Node client's) lists none: the holding lists', by name
        jobs = [r for r in running(app, limit=10**9)[1] if r["worker"] == name]
        found["held"] = len(jobs)
    found["jobs"] = jobs[:limit]
    return found


def held_by(app: TaskRunner, name: str, held: list[Any], now: float, limit: int) -> tuple[int, list[dict[str, Any]]]:
    """The jobs of `held` (the [queue, id] pairs a worker's heartbeat lists, in its
    children's order) that the holding lists still give to worker `name`: how many, and the
    `limit` it has held longest as running() rows, oldest first. A read of each holding entry,
    then of the records of those rows, not of every running job. Pairs that are not one are
    left out."""
    pairs = [(q, i) for q, i in (h for h in held if isinstance(h, list) and len(h) == 2)
             if isinstance(q, str) and isinstance(i, str)]
    pipe = app.redis.pipeline(transaction=False)
    for q, job_id in pairs:
        pipe.hget(app.keys.q(q) + "running", job_id)
    rows = []
    for (q, job_id), raw in zip(pairs, pipe.execute() if pairs else []):
        h = Holding.parse(raw) if raw else None
        if h is not None and h.worker == name:
            rows.append({"id": job_id, "queue": q, **asdict(h), "elapsed": max(0.0, now - h.started_at),
                         "state": "running"})
    rows.sort(key=lambda r: (r["started_at"], r["id"]))
    page = rows[:limit]
    for r, (task, args, kwargs) in zip(page, hmget(app, page, "task", "args", "kwargs")):
        r.update(task=task, args=_short(args, kwargs))
    return len(rows), page


#: Fields of a worker's info that pages and the CLI format as numbers, and as text.
_WORKER_NUMBERS = ("pid", "busy", "concurrency", "processed", "rss", "cpu", "started_at")
_WORKER_TEXT = ("host", "ip", "kind")


def _worker_info(raw: str | None) -> dict[str, Any]:
    """A worker's heartbeat info as readers expect it, whoever wrote it: a value of the
    wrong type is left out, as if missing, so that no page or command trips on it."""
    try:
        info = codec.loads(raw) if raw else {}
    except ValueError:
        info = {}
    if not isinstance(info, dict):
        return {}
    wrong = [k for k, v in info.items() if (k in _WORKER_NUMBERS and number(v) is None)
             or (k in _WORKER_TEXT and not isinstance(v, str))
             or (k == "queues" and not (isinstance(v, list) and all(isinstance(q, str) for q in v)))]
    return {k: v for k, v in info.items() if k not in wrong}


def _entry(raw: str) -> dict[str, Any] | None:
    """A JSON object kept in Redis (dispatcher, schedule), or None when it is not one."""
    try:
        e = codec.loads(raw)
    except ValueError:
        return None
    return e if isinstance(e, dict) else None


#: A row's holder fields when its holding entry is not one.
_NO_HOLDER = {"worker": None, "attempt": None, "host": None, "ip": None, "pid": None, "started_at": 0,
              "max_duration": 0, "ahead": 0}


def live_workers(app: TaskRunner, now: float) -> set[str]:
    since = now - app.settings.dead_after
    return set(app.redis.zrangebyscore(app.keys.workers, since, "+inf"))


def running(app: TaskRunner, queue: str | None = None, offset: int = 0, limit: int = 100,
            only_stuck: bool = False) -> tuple[int, list[dict[str, Any]]]:
    """The holding lists, oldest first: (total, one page of rows). A row is stuck when the
    job passed its max duration or its worker is dead (with `why`)."""
    now = server_time(app.redis)
    queues = shards_of(app, queue) if queue else app.queue_names()
    pipe = app.redis.pipeline(transaction=False)
    for q in queues:
        pipe.hgetall(app.keys.q(q) + "running")
    rows: list[dict[str, Any]] = []
    for q, entries in zip(queues, pipe.execute()):
        for job_id, raw in entries.items():
            h = Holding.parse(raw)
            rows.append({"id": job_id, "queue": q, **(asdict(h) if h else _NO_HOLDER),
                         "corrupt": None if h else raw[:200]})
    rows.sort(key=lambda r: (r["started_at"], r["id"]))  # ids sort by creation too
    alive = live_workers(app, now)
    if only_stuck:
        flags = hmget(app, rows, "stuck")
        rows = [r for r, (s,) in zip(rows, flags) if s == "1" or r["worker"] not in alive
                or now > r["started_at"] + r["ahead"] + r["max_duration"]]
    total = len(rows)
    page = rows[offset:offset + limit]
    for r, (task, args, kwargs, stuck, kill) in zip(page, hmget(app, page, "task", "args", "kwargs", "stuck",
                                                                 "kill_requested")):
        elapsed = max(0.0, now - r["started_at"])
        over = elapsed > r["ahead"] + r["max_duration"]
        corrupt = r.pop("corrupt")
        why = [f"its holding entry is not one: {corrupt!r}"] if corrupt is not None else []
        if stuck == "1" or over:
            why.append(f"ran past its max duration ({r['max_duration']:g} s)")
        if r["worker"] not in alive:
            why.append(f"its worker {r['worker']} is not alive (no heartbeat for {app.settings.dead_after:g} s)")
        r.update(task=task, args=_short(args, kwargs), elapsed=elapsed, stuck=bool(why), why=why,
                 kill_requested=bool(kill), state="running")
    return total, page


def hmget(app: TaskRunner, rows: list[dict[str, Any]], *fields: str) -> list[list[Any]]:
    pipe = app.redis.pipeline(transaction=False)
    for r in rows:
        pipe.hmget(app.keys.job(r["queue"], r["id"]), *fields)
    return pipe.execute() if rows else []


def _short(args: str | None, kwargs: str | None, width: int = 80) -> str:
    """Arguments as shown in a table: the JSON text, cut."""
    text = (args or "[]")[1:-1]
    if kwargs and kwargs != "{}":
        text += (", " if text else "") + kwargs[1:-1]
    return text if len(text) <= width else text[:width - 1] + "…"


def page_of(app: TaskRunner, queue: str, state: str, offset: int = 0, limit: int = 50
            ) -> tuple[int, list[dict[str, Any]]]:
    """(total, one page) of a queue's pending, delayed or finished jobs; of a sharded
    queue, its shards' one after the other (shard 0 first), each in its own order."""
    total, rows = page_ids(app, queue, state, offset, limit)
    fields = ("task", "args", "kwargs", "state", "enqueued_at", "due_at", "started_at", "finished_at", "attempts",
              "error_type", "error", "worker")
    return total, fill(app, rows, fields)


def page_ids(app: TaskRunner, queue: str, state: str, offset: int = 0, limit: int = 50
             ) -> tuple[int, list[dict[str, Any]]]:
    """page_of()'s (total, page) without the records: {"id", "queue"} rows (the dashboard's
    live queue page polls these)."""
    rows: list[dict[str, Any]] = []
    total = 0
    for shard in shards_of(app, queue):
        p = app.keys.q(shard)
        n = backlog(app, shard) if state == "pending" else app.redis.zcard(p + state)
        total += n
        if len(rows) < limit and offset < n:
            rows += [{"id": i, "queue": shard} for i in job_ids(app, shard, state, limit - len(rows), offset)]
        offset = max(0, offset - n)
    return total, rows


def fill(app: TaskRunner, rows: list[dict[str, Any]], fields: tuple[str, ...]) -> list[dict[str, Any]]:
    """Add the fields of each row's job record (typed), with args shortened for tables.
    Rows whose record is gone are left out: a job with a shorter result_ttl or failed_ttl
    than the one its queue's finished sets are trimmed by (see sweep.lua) expired first."""
    out = []
    for r, values in zip(rows, hmget(app, rows, *fields)):
        d = {f: typed(f, v) for f, v in zip(fields, values)}
        if d["state"] is not None:
            r.update(d, args=_short(d["args"], d.pop("kwargs")))
            out.append(r)
    return out


#: The fields of a finished job that its row in a table shows.
FINISHED_FIELDS = ("task", "args", "kwargs", "state", "finished_at", "attempts", "error_type", "error", "worker",
                   "host", "pid", "killed_by")


def finished(app: TaskRunner, state: str, offset: int = 0, limit: int = 50) -> tuple[int, list[dict[str, Any]]]:
    """Newest first, across queues: completed, failed or killed jobs."""
    queues = app.queue_names()
    pipe = app.redis.pipeline(transaction=False)
    for q in queues:
        pipe.zcard(app.keys.q(q) + state)
        pipe.zrevrange(app.keys.q(q) + state, 0, offset + limit - 1, withscores=True)
    res = pipe.execute()
    total = sum(res[0::2])
    merged = sorted(((t, q, i) for q, entries in zip(queues, res[1::2]) for i, t in entries), reverse=True)
    rows = [{"id": i, "queue": q} for _, q, i in merged[offset:offset + limit]]
    return total, fill(app, rows, FINISHED_FIELDS)


#: A dispatcher silent this long (seconds) is shown gone, not late: it was killed or lost
#: its host (a clean stop removes its entry at once); a live dispatcher removes the entry
#: after DISPATCHER_FORGET.
DISPATCHER_GONE = 60.0
DISPATCHER_FORGET = 3600.0


def overview(app: TaskRunner) -> dict[str, Any]:
    """Per queue counts (and finished in the last 5 minutes), workers, dispatchers."""
    now = server_time(app.redis)
    physical = _physical_stats(app)  # as queue.settings() gives them: combined() wants shard 0's rate the queue's
    pipe = app.redis.pipeline(transaction=False)
    for q in physical:
        p = app.keys.q(q["name"])
        pipe.zcount(p + "completed", now - 300, "+inf").zcount(p + "failed", now - 300, "+inf")
    counts = pipe.execute()
    _, stuck_rows = running(app, limit=10**9, only_stuck=True)
    by_queue: dict[str, list[dict[str, Any]]] = {}
    for i, q in enumerate(physical):
        q["completed_5m"], q["failed_5m"] = counts[2 * i], counts[2 * i + 1]
        q["stuck"] = sum(1 for r in stuck_rows if r["queue"] == q["name"])
        by_queue.setdefault(sharding.logical(q["name"]), []).append(q)
    queues = [{**queue.combined(group), "name": name} for name, group in by_queue.items()]
    ws = workers(app)
    consumed = {sharding.logical(q) for w in ws if w["state"] == "alive" for q in w.get("queues", [])}
    for q in queues:  # jobs wait with nobody to run them: the overview says so
        q["unserved"] = q["name"] not in consumed and q["pending"] > 0
    return {"now": now, "queues": queues, "workers": ws, "dispatchers": dispatchers(app, now)}


def dispatchers(app: TaskRunner, now: float) -> list[dict[str, Any]]:
    """The dispatchers' entries, most recent pass first, each with its `age` (seconds since
    its last pass) and `health`: ok (`healthy`), late, or gone."""
    out = []
    for raw in app.redis.hvals(app.keys.dispatchers):
        d = _entry(raw)
        if d is None:
            continue
        d["age"] = max(0.0, now - (number(d.get("last_pass")) or 0))  # a pass may begin after our clock read
        if not isinstance(d.get("history_backlog"), dict):
            d["history_backlog"] = {}
        d["healthy"] = d["age"] < max(5 * app.settings.dispatch_interval, 5)
        d["health"] = "ok" if d["healthy"] else "late" if d["age"] < DISPATCHER_GONE else "gone"
        out.append(d)
    return sorted(out, key=lambda d: d["age"])
