"""Queue administration (after the pressure protocol): bounds, closing, exclusive
queues, pausing, rate limits, deletion, and each queue's counters. Settings live in the
queue's `meta` hash, which the enqueue and claim scripts read."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from redis.crc import key_slot

from taskrunner.errors import QueueNotFound, TaskRunnerError
from taskrunner.protocol import codec
from taskrunner.protocol import shards as sharding
from taskrunner.protocol.connection import is_cluster, server_time

if TYPE_CHECKING:
    from taskrunner.client.app import TaskRunner

COUNTERS = ("produced_messages", "produced_bytes", "consumed_messages", "consumed_bytes")


def create(app: TaskRunner, name: str, bound: int | None = None, exclusive: bool | None = None,
           rate: str | None = None, shards: int | None = None) -> dict[str, Any]:
    """Create a queue, or change its settings; a setting not given (None) stays as it is
    (a new queue: none), so that changing one, the shard count say, drops no other:
    `bound` > 0 caps its pending jobs (producers block, then QueueFull; 0: no bound);
    `exclusive` runs at most one of its jobs at a time, in order; `rate` ("50/s", "N/m",
    "N/h") is how many of its jobs may start, across all workers (set_rate() removes it).
    `shards` (1-64): one logical queue over that many physical queues, each in its own hash
    slot (protocol/shards.py); the bound and the rate are split evenly over them, and what
    was given is kept in `bound_total` and `rate_total`, to split again. The shard count
    changes only while no job of the queue is pending, delayed, waiting or running
    (TaskRunnerError otherwise; see _retire for fewer shards, whose removed shards' finished
    records go); an exclusive queue has one shard. Returns the queue's settings after:
    bound (the total given), exclusive, rate (None: none) and shards."""
    codec.check_name("queue", name)
    if bound is not None and bound < 0:
        raise ValueError("bound must be >= 0 (0: no bound)")
    if shards is not None and not 1 <= shards <= sharding.MAX:
        raise ValueError(f"shards must be from 1 to {sharding.MAX}, not {shards}")
    r, p = app.redis, app.keys.q(name)
    before, total, own, bound_total, own_bound, was_exclusive, closed, paused = r.hmget(
        p + "meta", "shards", "rate_total", "rate", "bound_total", "bound", "exclusive", "closed", "paused")
    now = sharding.count(before)
    n = shards or now
    if bound is None:  # as it was given; a queue sharded before bound_total was kept: its shards' sum
        bound = int(bound_total) if now > 1 and bound_total else int(own_bound or 0) * now
    if exclusive is None:
        if was_exclusive == "1" and n > 1:
            raise TaskRunnerError(f"queue {name} is exclusive (one job at a time, in order), which takes one "
                                  f"shard: give --no-exclusive with --shards {n} to shard it")
        exclusive = was_exclusive == "1"
    if exclusive and n > 1:
        raise TaskRunnerError(f"queue {name} has {n} shards: an exclusive queue runs one job at a time in order, "
                              "which takes one shard (--shards 1)")
    rate_total = rate if rate is not None else total if now > 1 else own  # the queue's rate, as it was given
    each = split_rate(rate_total, n) if rate_total is not None else None
    if n != now:
        busy = unfinished(app, sharding.names(name, max(n, now)))
        if busy:
            raise TaskRunnerError(f"queue {name} has {busy} jobs pending, delayed, waiting or running: its shard "
                                  f"count ({now}) changes only while it has none")
        if n < now:
            _retire(app, name, sharding.names(name, now)[n:], keep_closed=closed == "1")
    settings: dict[str, Any] = {"bound": -(-bound // n), "exclusive": int(exclusive)}
    if closed == "1":
        settings["closed"] = 1
    if paused == "1":
        settings["paused"] = 1
    pipe = r.pipeline(transaction=False)
    for shard in sharding.names(name, n):
        sp = app.keys.q(shard)
        if shard != name:  # a shard retired before, or new: as the queue is
            pipe.hdel(sp + "meta", "retired", *(() if closed == "1" else ("closed",)),
                      *(() if paused == "1" else ("paused",)))
        pipe.hset(sp + "meta", mapping=settings)
        if each is not None:
            pipe.hset(sp + "meta", "rate", each)
        pipe.lpush(sp + "notfull", "1").ltrim(sp + "notfull", 0, 0)
    if n > 1:
        pipe.hset(p + "meta", mapping={"shards": n, "bound_total": bound,
                                       **({"rate_total": rate_total} if rate_total is not None else {})})
    else:  # one shard: its `bound` and `rate` are the queue's
        pipe.hdel(p + "meta", "shards", "bound_total", "rate_total")
    pipe.sadd(app.keys.queues, *sharding.names(name, n))
    pipe.execute()
    app._spread.forget(name)
    return {"bound": bound, "exclusive": exclusive, "rate": rate_total, "shards": n}


def _retire(app: TaskRunner, name: str, gone: list[str], keep_closed: bool) -> None:
    """Remove the shards `gone` of queue `name` (a smaller shard count). A producer that read
    the old count (within sharding.KEEP) may still place jobs there, so they are closed and
    marked `retired` first (it gets QueueClosed from then on), and only then checked for
    jobs: one that came in before the close refuses the change (TaskRunnerError), the shards
    opened again as they were, so no job is left where no worker serves it, nor deleted after
    its producer was told it was enqueued. Then every key of theirs goes, finished records
    (results, failures, history) included, but their meta: closed and retired, it keeps
    refusing producers."""
    pipe = app.redis.pipeline(transaction=False)
    for shard in gone:
        pipe.hset(app.keys.q(shard) + "meta", mapping={"closed": 1, "retired": 1})
    pipe.execute()
    busy = unfinished(app, gone)
    if busy:
        pipe = app.redis.pipeline(transaction=False)
        for shard in gone:
            pipe.hdel(app.keys.q(shard) + "meta", "retired", *(() if keep_closed else ("closed",)))
        pipe.execute()
        raise TaskRunnerError(f"queue {name}: {busy} jobs came into the shards to remove while the shard count "
                              "changed (a producer had the old count): it stays; run it again once they are done")
    for shard in gone:
        _delete_keys(app, app.keys.q(shard), keep=app.keys.q(shard) + "meta")
    app.redis.srem(app.keys.queues, *gone)


def split_rate(rate: str, n: int) -> str:
    """Each shard's part of a queue's rate limit: `rate` over `n` shards, in the unit that
    keeps it whole ("50/s" over 3 shards: "1000/m" each). A rate that no unit splits
    evenly is refused (ValueError): every shard's spacing must be exactly n times the queue's."""
    count, period = codec.rate_period(codec.rate("rate", rate))
    if n == 1:
        return rate
    for unit, seconds in (("s", 1), ("m", 60), ("h", 3600)):
        if seconds >= period and (count * seconds // period) % n == 0:
            return f"{count * seconds // period // n}/{unit}"
    raise ValueError(f"rate {rate} cannot be split evenly over {n} shards (each starts at most the rate / {n}): "
                     f"give a rate per second, minute or hour divisible by {n}")


def unfinished(app: TaskRunner, names: list[str]) -> int:
    """Jobs pending (any priority), delayed, waiting or running in the queues `names`."""
    return sum(c["waiting"] + c["delayed"] + c["running"] for c in state_counts(app, names)) + sum(
        backlog(app, q) for q in names)


def shards_of(app: TaskRunner, name: str) -> list[str]:
    """The physical queues of queue `name`: its shards, or itself."""
    return sharding.names(name, sharding.count(app.redis.hget(app.keys.q(name) + "meta", "shards")))


#: How many shard counts that would spread a queue evenly a Placement names.
EVEN_SHOWN = 3


@dataclass(frozen=True)
class Placement:
    """Where the shards of a queue fall on a Redis Cluster's primaries. CRC16 of each
    shard's hash tag decides, so N shards over N primaries often leave one primary two and
    another none; this says so, and which shard counts would spread the name evenly (the
    key layout, `Q~i`, is protocol and cannot bend to the cluster)."""

    shards: int
    #: Every primary that serves slots (host:port), by host then port.
    primaries: list[str]
    #: The shards on each of `primaries`.
    per_primary: list[int]
    #: The smallest shard counts (EVEN_SHOWN at most, up to shards.MAX) that would spread
    #: this queue evenly with a shard on every primary.
    even: list[int]

    @property
    def uneven(self) -> bool:
        return sharding.uneven(self.per_primary)

    def to_dict(self) -> dict[str, Any]:
        """As --json gives it."""
        return {"per_primary": dict(zip(self.primaries, self.per_primary)), "uneven": self.uneven,
                "even_shard_counts": self.even}


def primaries_of(app: TaskRunner, physical: list[str]) -> list[str] | None:
    """The primary (host:port) that serves each of the physical queues `physical`, from the
    slot map the cluster client holds (no command); None off a cluster."""
    if not is_cluster(app.redis):
        return None
    nodes = app.redis.nodes_manager
    return [nodes.get_node_from_slot(key_slot(app.keys.q(q).encode())).name for q in physical]


def placement(app: TaskRunner, name: str, n: int) -> Placement | None:
    """How `n` shards of queue `name` fall on the cluster's primaries (None off a cluster)."""
    owners = primaries_of(app, sharding.names(name, sharding.MAX))
    if owners is None:
        return None
    # by name: redis-py before 5.1 cannot hash a ClusterNode
    serving = {nodes[0].name: nodes[0] for nodes in app.redis.nodes_manager.slots_cache.values() if nodes}
    primaries = [node.name for node in sorted(serving.values(), key=lambda node: (node.host, node.port))]
    return Placement(n, primaries, sharding.per_primary(owners[:n], primaries),
                     sharding.even_counts(owners, primaries, EVEN_SHOWN))


def close(app: TaskRunner, name: str) -> None:
    """No new jobs (enqueue raises QueueClosed); jobs already queued still run. open()
    undoes it."""
    must_exist(app, name)
    _each(app, name, lambda pipe, p: pipe.hset(p + "meta", "closed", 1))


def open(app: TaskRunner, name: str) -> None:  # the counterpart of close(), named as the CLI command
    """Take new jobs again after close()."""
    must_exist(app, name)
    _each(app, name, lambda pipe, p: pipe.hdel(p + "meta", "closed"))


def set_rate(app: TaskRunner, name: str, rate: str | None) -> None:
    """Limit how many of the queue's jobs start ("50/s", "N/m", "N/h"), across all
    workers; None removes the limit. Claims read it at once (docs/PROTOCOL.md, Flow
    control); a lower limit applies from the next start on."""
    must_exist(app, name)
    p = app.keys.q(name)
    n = sharding.count(app.redis.hget(p + "meta", "shards"))
    each = split_rate(rate, n) if rate is not None else None
    pipe = app.redis.pipeline(transaction=False)
    for shard in sharding.names(name, n):
        sp = app.keys.q(shard)
        if each is None:
            pipe.hdel(sp + "meta", "rate")
        else:
            pipe.hset(sp + "meta", "rate", each)
        # A wake token: a worker sleeping until the old limit's next token claims now.
        pipe.lpush(sp + "wake", "1").ltrim(sp + "wake", 0, 0)
    if n > 1:
        if rate is None:
            pipe.hdel(p + "meta", "rate_total")
        else:
            pipe.hset(p + "meta", "rate_total", rate)
    pipe.execute()


def pause(app: TaskRunner, name: str) -> None:
    """Workers claim nothing from the queue (claim.lua reads meta `paused` with the settings
    it reads anyway) and sleep on it: an enqueue into a paused queue leaves no wake token.
    It still takes new jobs; running ones go on. resume() undoes it."""
    must_exist(app, name)
    _each(app, name, lambda pipe, p: pipe.hset(p + "meta", "paused", 1))


def resume(app: TaskRunner, name: str) -> None:
    """Workers claim from the queue again: a wake token wakes one idle worker, whose claim
    leaves another while jobs remain (as after an enqueue)."""
    must_exist(app, name)
    _each(app, name, lambda pipe, p: pipe.hdel(p + "meta", "paused").lpush(p + "wake", "1").ltrim(p + "wake", 0, 0))


def _each(app: TaskRunner, name: str, change: Callable[[Any, str], Any]) -> None:
    """Make a change to every shard of queue `name` (one, unless sharded), in one round trip:
    `change(pipe, key prefix)`."""
    pipe = app.redis.pipeline(transaction=False)
    for shard in shards_of(app, name):
        change(pipe, app.keys.q(shard))
    pipe.execute()


def pending_keys(p: str, priorities: str | None) -> list[str]:
    """The pending lists of the queue of key prefix `p`, in claim order: one per priority
    its meta `priorities` lists (e.g. "95"), highest first, then `pending` (priority 0)."""
    return [f"{p}pending:{c}" for c in priorities or "" if c in "123456789"] + [p + "pending"]


def deletable(app: TaskRunner, name: str, force: bool = False) -> dict[str, int]:
    """What delete() would remove, jobs counted by state (of every shard); raises what
    delete() would (no such queue; jobs running and not forced), so that a caller can ask first."""
    must_exist(app, name)
    names = shards_of(app, name)
    counts = {s: sum(c[s] for c in state_counts(app, names)) for s in STATES}
    if counts["running"] and not force:
        raise TaskRunnerError(f"queue {name} has {counts['running']} running jobs: kill them, wait, or force")
    return {"pending": sum(backlog(app, q) for q in names), "delayed": counts["delayed"],
            "waiting": counts["waiting"], "running": counts["running"],
            "finished": sum(counts[s] for s in STATES[3:])}


#: The states whose jobs a queue counts with one command each (pending: backlog()).
STATES = ("waiting", "delayed", "running", "completed", "failed", "killed", "canceled")


def state_counts(app: TaskRunner, names: list[str]) -> list[dict[str, int]]:
    """Jobs of each queue of `names` in each of STATES, in one round trip."""
    pipe = app.redis.pipeline(transaction=False)
    for q in names:
        p = app.keys.q(q)
        pipe.zcard(p + "waiting").zcard(p + "delayed").hlen(p + "running")
        pipe.zcard(p + "completed").zcard(p + "failed").zcard(p + "killed").zcard(p + "canceled")
    counts = pipe.execute()
    n = len(STATES)
    return [dict(zip(STATES, counts[i * n:(i + 1) * n])) for i in range(len(names))]


def delete(app: TaskRunner, name: str, force: bool = False) -> int:
    """Remove every key of the queue (of each of its shards) and forget it; refused while
    its jobs run unless forced (their workers' results are then fenced off). Returns the
    keys deleted."""
    deletable(app, name, force)
    names = shards_of(app, name)
    deleted = sum(_delete_keys(app, app.keys.q(q)) for q in names)
    app.redis.srem(app.keys.queues, *names)
    app._known_queues.difference_update(names)
    app._spread.forget(name)
    return deleted


def _delete_keys(app: TaskRunner, p: str, keep: str | None = None) -> int:
    """Unlink every key of key prefix `p` but `keep`; how many."""
    deleted = 0
    # SCAN, not KEYS: an admin operation that must find every job record of the queue.
    pattern = p.replace("[", "\\[") + "*"
    batch: list[str] = []
    for key in app.redis.scan_iter(match=pattern, count=1000):
        if key == keep:
            continue
        batch.append(key)
        if len(batch) >= 1000:
            deleted += app.redis.unlink(*batch)
            batch = []
    if batch:
        deleted += app.redis.unlink(*batch)
    return deleted


def info(app: TaskRunner, name: str) -> dict[str, Any]:
    """Settings and counters of one queue (of all its shards together)."""
    return combined(settings(app, shards_of(app, name)))


def backlog(app: TaskRunner, name: str) -> int:
    """Jobs pending in the queue, of every priority."""
    return backlogs(app, [name], [app.redis.hget(app.keys.q(name) + "meta", "priorities")])[0]


def backlogs(app: TaskRunner, names: list[str], priorities: list[str | None]) -> list[int]:
    """Jobs pending in each queue of `names`, of every priority (each one's meta
    `priorities`, as pending_keys() takes them): one round trip, whatever their number."""
    lists = [pending_keys(app.keys.q(q), levels) for q, levels in zip(names, priorities)]
    pipe = app.redis.pipeline(transaction=False)
    for keys in lists:
        for key in keys:
            pipe.llen(key)
    lengths = iter(pipe.execute() if names else [])
    return [sum(next(lengths) for _ in keys) for keys in lists]


def settings(app: TaskRunner, names: list[str]) -> list[dict[str, Any]]:
    """Settings and counters of each queue (bound, closed, exclusive, paused), the priorities
    its jobs used (e.g. [9, 5]) and the duplicates of unique jobs not added, per task; with
    its rate limit (None: none) the starts it counted in the current period of the limit
    (`rate_used`: this second, minute or hour) and in the one before (`rate_used_last`), and
    the seconds until its limiter lets the next job start (`rate_next`, 0.0: now). Shard 0
    of a sharded queue also has the queue's rate (`rate`; `rate_each` its own) and, where
    the queue kept it, the bound it was given (`bound_total`; `bound` is its own part)."""
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
        d["rate_next"] = rate_next(limit, now) if meta.get("rate") else 0.0
        d["shards"] = sharding.count(meta.get("shards"))
        if d["shards"] > 1:  # shard 0 of a sharded queue: the queue's rate, and each shard's part
            d.update(rate=meta.get("rate_total"), rate_each=meta.get("rate"))
            if "bound_total" in meta:
                d["bound_total"] = int(meta["bound_total"])
        out.append(d)
    return out


def combined(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """One logical queue's figures from its shards' (shard 0 first, as settings() or
    listing.queue_stats() give them): counts, counters and rate use summed; its settings
    (paused, closed, rate) are shard 0's, as every shard has them. Its bound is the one it
    was given (`bound_total`), not the sum of the shards' rounded-up parts (10 over 3
    shards: 4 each); a queue sharded before bound_total was kept: that sum. `bound_each` is
    each shard's part, which each shard enforces: the queue holds at most shards ×
    bound_each pending jobs (12 for a bound of 10 over 3 shards)."""
    if len(rows) == 1:
        return rows[0]
    out = dict(rows[0])
    out["bound_each"] = rows[0]["bound"]
    for k, v in rows[0].items():
        if isinstance(v, int) and not isinstance(v, bool) and k not in ("shards", "bound_total"):
            out[k] = sum(r.get(k, 0) for r in rows)
    out["bound"] = out.pop("bound_total", out["bound"])
    out["paused"] = any(r["paused"] for r in rows)
    out["closed"] = any(r["closed"] for r in rows)
    out["priorities"] = sorted({p for r in rows for p in r["priorities"]}, reverse=True)
    dups: dict[str, int] = {}
    for r in rows:
        for task, n in r["duplicates"].items():
            dups[task] = dups.get(task, 0) + n
    out["duplicates"] = dups
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


def rate_next(limit: dict[str, str], now: float) -> float:
    """Seconds from server time `now` until a GCRA limiter (claim.lua's `tat`: the time
    from which the next start is allowed) lets a job start; 0.0 when one may start now."""
    try:
        return max(0.0, float(limit.get("tat") or 0) - now)
    except ValueError:
        return 0.0


def must_exist(app: TaskRunner, name: str) -> None:
    codec.check_name("queue", name)
    if not app.redis.sismember(app.keys.queues, name):
        raise QueueNotFound(f"no queue {name!r} (see `taskrunner queues`)")
