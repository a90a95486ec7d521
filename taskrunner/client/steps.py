"""The client's operations — enqueue, wait, kill, find a job — written once, for the
synchronous API (app.py, job.py) and the asyncio one (aio.py) alike.

Each operation is a generator that yields what it needs from Redis (a request below) and
is sent the answer; an error the request met (a RedisError) is thrown into it, where its
own retry policy applies. `run()` answers requests with the synchronous client; aio.py
has the same driver with redis.asyncio. So what an enqueue checks and sends, how a wait
rides out a Redis restart, what a kill tells the worker — and the errors users see —
cannot drift apart between the two (sans-I/O, as in h11 or hyper-h2)."""

from __future__ import annotations

import os
import time
from collections.abc import Generator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

import redis

from taskrunner.client import declarations
from taskrunner.errors import JobNotFound, QueueClosed, QueueFull, Timeout
from taskrunner.protocol import codec, joins, scripts, shards
from taskrunner.protocol.blocking import pop_any
from taskrunner.protocol.connection import is_cluster
from taskrunner.protocol.outages import Backoff, Outage

if TYPE_CHECKING:
    from taskrunner.client.app import JobSpec, TaskRunner
    from taskrunner.client.middleware import Enqueued

T = TypeVar("T")
#: Errors of Redis (down, failing over, a cluster without a node for a slot): thrown into
#: the operation, which backs off and goes on where that is safe.
REDIS_ERRORS = (redis.RedisError, redis.exceptions.RedisClusterException)
#: Errors redis-py counts as connection errors that a wait does not end (a wrong or missing
#: password): a producer's enqueue raises them at once rather than riding them out (riding).
LASTING = (redis.AuthenticationError,)

#: Seconds between a waiter's looks at the job's state while no notification came: one
#: lost with a Redis restart or failover would otherwise leave it waiting forever.
LOOK_AGAIN = 5.0
FINAL = frozenset(("completed", "failed", "killed", "canceled"))


@dataclass(frozen=True)
class Command:
    """One Redis command (redis-py's method name and its arguments): its reply."""

    name: str
    args: tuple[Any, ...]


@dataclass(frozen=True)
class Pipeline:
    """Commands sent together, in one round trip: their replies, in order."""

    commands: tuple[Command, ...]


@dataclass(frozen=True)
class Script:
    """One call of a taskrunner script: its reply (a refusal raises ScriptError)."""

    script: scripts.Script
    keys: list[str]
    args: list[Any]


@dataclass(frozen=True)
class Scripts:
    """Script calls sent together, in one round trip (on a Redis Cluster, each to the primary
    of its slot): their replies, in order (a refusal raises ScriptError)."""

    calls: tuple[Script, ...]


@dataclass(frozen=True)
class Enqueue:
    """enqueue.lua for `jobs` ((id, delay, fields) each) into `queue`: one answer per job
    (1 created, 0 exists, -1 full, -2 closed; a unique job's duplicate: the holder's id). The
    queue joins the index of queues (on a cluster a separate command: the script touches the
    queue's slot only). `others`: the other queues a workflow's jobs are in or name as
    parents, written in this one call (not on a Redis Cluster: there canvas.written() writes
    such a workflow in several, canvas.across())."""

    queue: str
    jobs: list[tuple[str, float, list[Any]]]
    others: tuple[str, ...] = ()


@dataclass(frozen=True)
class Clustered:
    """Whether the client is a Redis Cluster's (asks Redis nothing): a workflow over several
    queues is then written in several calls, canvas.across()."""


@dataclass(frozen=True)
class Pop:
    """A blocking pop (BRPOP or BLPOP) of up to `timeout` seconds on a connection of its
    own: [key, item], or None."""

    command: str
    key: str
    timeout: float


@dataclass(frozen=True)
class Sleep:
    seconds: float


Request = Command | Pipeline | Script | Scripts | Enqueue | Clustered | Pop | Sleep
Steps = Generator[Request, Any, T]


def run(app: TaskRunner, steps: Steps[T]) -> T:
    """Carry out an operation with the synchronous client."""
    answer: Any = None
    error: BaseException | None = None
    while True:
        try:
            request = steps.send(answer) if error is None else steps.throw(error)
        except StopIteration as done:
            return done.value
        try:
            answer, error = _answer(app, request), None
        except Exception as e:
            answer, error = None, e
        except BaseException:
            steps.close()  # interrupted (Ctrl-C in a pause): its finally (Backoff.give_up) runs now
            raise


def riding(app: TaskRunner, operation: Steps[T], what: str) -> Steps[T]:
    """A producer's operation (an enqueue of a job, a batch, a workflow) that rides out a
    Redis outage (outages.transient(): down, restarting, failing over): a request
    that met such an error is sent again, backing off (outages.Backoff), until
    enqueue_retry seconds after the outage's first error; then, or at once for any
    other error (LASTING ones too), the error goes to the operation as run() would give it. Sending again is
    safe: the job ids were made before (draft), reads change nothing, and enqueue.lua
    adds nothing for an id that exists, answering 0, so a try whose answer was lost
    after it ran adds no second job (the Job's .created is then False). `what` names
    the operation in what it logs: the process's one warning per outage (outage_of())."""
    answer: Any = None
    error: BaseException | None = None
    while True:
        try:
            request = operation.send(answer) if error is None else operation.throw(error)
        except StopIteration as done:
            return done.value
        backoff = None
        try:
            while True:
                try:
                    answer, error = (yield request), None
                    if backoff is not None:
                        backoff.ok()  # it rode an outage: it leaves it (over, when no other rides it)
                    break
                except Exception as e:
                    answer, error = None, e
                    try:
                        backoff, pause = ride_out(app, e, backoff, what)
                    except Exception:  # e: the operation gets it
                        break
                yield Sleep(pause)
        finally:  # closed midway (an interrupt in its pause): it leaves the outage it rode
            if backoff is not None:
                backoff.give_up()


#: Per Redis URL, the outage its producers and waiters (Job.wait) in this process are riding
#: out (Outage.since None: none now): shared by their threads, so that one outage is one
#: warning, and one "answers again", however many requests and waits meet it (each request
#: that fails rides it, Outage.riders). A forked child starts with none.
_OUTAGES: dict[str | None, Outage] = {}
os.register_at_fork(after_in_child=_OUTAGES.clear)


def outage_of(app: TaskRunner) -> Outage:
    """The outage of the app's Redis that this process's producers share (_OUTAGES)."""
    outage = _OUTAGES.get(app.settings.redis_url)
    if outage is None:  # setdefault: two threads that come at once get the same one
        outage = _OUTAGES.setdefault(app.settings.redis_url, Outage("enqueueing"))
    return outage


def ride_out(app: TaskRunner, error: BaseException, backoff: Backoff | None, what: str) -> tuple[Backoff, float]:
    """The backoff (made at the request's first error, `backoff` None) and the pause before a
    producer's request that met `error` is sent again; raises `error` where it is not to be
    ridden out: enqueue_retry 0, not a Redis error, a LASTING one (or one raised from it: a
    cluster client that reached no node), one that does not pass by itself
    (outages.transient()), or the bound passed: the backoff then leaves the outage it rode
    (Backoff.give_up). riding() and enqueue_many's chunks (sent past the steps) decide so
    alike, and ride the process's shared outage (outage_of()): a request that fails while
    others wait logs at debug level; one that goes through leaves it (Backoff.ok)."""
    if not (app.settings.enqueue_retry and isinstance(error, REDIS_ERRORS)) \
            or isinstance(error, LASTING) or isinstance(error.__cause__, LASTING):
        if backoff is not None:
            backoff.give_up()
        raise error
    backoff = backoff or Backoff(what, time.monotonic() + app.settings.enqueue_retry, outage_of(app))
    return backoff, backoff.after(error)


def ride(app: TaskRunner, operation: Steps[T], what: str) -> T:
    """run() a producer's operation, riding out a Redis outage (riding())."""
    return run(app, riding(app, operation, what))


def _answer(app: TaskRunner, r: Request) -> Any:
    if isinstance(r, Command):
        return getattr(app.redis, r.name)(*r.args)
    if isinstance(r, Script):
        return r.script(app.redis, r.keys, r.args)
    if isinstance(r, Scripts):
        batch = scripts.Batch(app.redis)
        for s in r.calls:
            batch.call(s.script, s.keys, s.args)
        return batch.execute()
    if isinstance(r, Enqueue):
        return app._enqueue_batch(r.queue, r.jobs, r.others)
    if isinstance(r, Clustered):
        return is_cluster(app.redis)
    if isinstance(r, Pipeline):
        pipe = app.redis.pipeline(transaction=False)
        for c in r.commands:
            getattr(pipe, c.name)(*c.args)
        return pipe.execute()
    if isinstance(r, Pop):
        return pop_any(app.redis, [r.key], r.timeout, r.command)
    if isinstance(r, Sleep):
        return time.sleep(r.seconds)
    raise TypeError(f"not a request: {r!r}")


# -- the operations ------------------------------------------------------------------


def declared(app: TaskRunner, task: str) -> Steps[dict[str, Any] | None]:
    """The task's declaration as workers published it (None: no worker declared it),
    looked up in Redis at most once every few seconds per task. In eager mode, None:
    only the app's own tasks run, and Redis is never asked."""
    if app.settings.eager:
        return None
    found, d = app._declared.get(task)
    if not found:
        raw = yield Command("hget", (app.keys.tasks, task))
        d = app._declared.put(task, declarations.parse(task, raw))
    return d


def job_spec(app: TaskRunner, task: str, options: dict[str, Any]) -> Steps[tuple[JobSpec, list[str] | None]]:
    """The spec of a job of `task` with `options` (app._job_spec), the queue a task not
    declared here has looked up first."""
    codec.check_name("task", task)
    if task not in app.tasks and options.get("queue") is None:
        d = yield from declared(app, task)
        options = {**options, "queue": d.get("queue", "default") if d else "default"}
    return app._spec_of(task, options)


@dataclass
class Draft:
    """A job about to be enqueued: checked, its fields as enqueue.lua takes them."""

    id: str
    queue: str
    delay: float
    fields: list[Any]
    #: The job as its before_enqueue hooks are to see it, until hooked() runs them (None:
    #: they ran, or the app has none).
    unhooked: Enqueued | None = None


def draft(app: TaskRunner, task: str, args: Any, kwargs: dict | None, spec: JobSpec | None,
          options: dict[str, Any], delay: float | None, job_id: str | None,
          headers: dict[str, Any] | None = None, flow: list[Any] | None = None, fed: bool = False) -> Steps[Draft]:
    """Check a job and make its fields (TaskRunner.enqueue says how) before it is enqueued
    — or, in eager mode, run — once its before_enqueue hooks ran (hooked(), when every job
    of the call is checked). `flow`: its priority and unique lock fields (client/flow.py),
    checked already. `fed`: the job is given its parent's result (or error) first, a
    workflow step's or callback's (its arguments are checked counting it)."""
    spec, sent = (spec.merged(**options), None) if spec is not None else (yield from job_spec(app, task, options))
    spec = spec.merged(queue=(yield from placed(app, task, spec, flow or [], job_id)))
    job_id = codec.check_id(job_id) if job_id is not None else codec.new_id()
    fields, unhooked = app._checked(task, args, kwargs, spec, sent, headers, fed, job_id)
    if flow:
        fields += flow
    return Draft(job_id, spec.queue, codec.seconds("delay", delay) if delay is not None else 0.0, fields, unhooked)


def hooked(app: TaskRunner, drafts: list[Draft]) -> list[Draft]:
    """Run the before_enqueue hooks of the drafts, once every job of the call is checked (a
    workflow's steps, a job's callbacks): a call refused for one job's arguments runs none
    (TaskRunner._hook). Each draft's hooks run once. Returns the drafts."""
    for d in drafts:
        if d.unhooked is not None:
            job, d.unhooked = d.unhooked, None
            app._hook(d.fields, job)
    return drafts


def shard_count(app: TaskRunner, queue: str) -> Steps[int]:
    """How many shards `queue` has (1: not sharded), read from its meta at most once per
    shards.KEEP seconds per queue (a shard's own name: 1, it is a queue)."""
    if app.settings.eager or shards.is_shard(queue):
        return 1
    n = app._spread.cached(queue)
    if n is None:
        raw = yield Command("hget", (app.keys.q(queue) + "meta", "shards"))
        n = app._spread.put(queue, shards.count(raw))  # after the answer: a new client made a new cache
    return n


def placed(app: TaskRunner, task: str, spec: JobSpec, flow: list[Any], job_id: str | None = None) -> Steps[str]:
    """The physical queue a job of `task` with `spec` goes to: its queue, or on a sharded
    queue one of its shards. A job whose limits count per shard goes to the shard of its
    key, so that they stay exact: its concurrency key (the task's name by default) when its
    task has max_concurrency, else its task when that has a rate limit, else its unique key
    (`flow`: its flow.fields()), else the id given to it (`job_id`; None: a new one), as a
    job with an existing id is not enqueued again (a schedule's tick fires once); any other
    job goes round robin (docs/PROTOCOL.md, Sharded queues). A task not declared here: its
    limits as its workers declared them."""
    n = yield from shard_count(app, spec.queue)
    if n <= 1:
        return spec.queue
    limits: dict[str, Any] = {"max_concurrency": spec.max_concurrency, "rate_limit": spec.rate_limit}
    if task not in app.tasks:
        d = yield from declared(app, task)
        limits = {**(d or {}), **{k: v for k, v in limits.items() if v is not None}}
    key = None
    if limits.get("max_concurrency"):
        key = f"c:{spec.concurrency_key or task}"
    elif limits.get("rate_limit"):
        key = f"r:{task}"
    elif "unique_key" in flow:
        key = f"u:{flow[flow.index('unique_key') + 1]}"
    elif job_id is not None:
        key = f"i:{job_id}"
    return app._spread.place(spec.queue, n, key)


def enqueue(app: TaskRunner, job: Draft, block_timeout: float | None,
            others: tuple[str, ...] = ()) -> Steps[int | str]:
    """Enqueue a drafted job: 1 created, 0 a job with its id existed, or for a unique job
    whose key another holds, that job's id (nothing created). Into a full bounded
    queue it waits up to `block_timeout` seconds for room (QueueFull). `others`: the queues
    of its parents but its own (Enqueue)."""
    wait = codec.seconds("block_timeout", app.settings.block_timeout if block_timeout is None else block_timeout)
    deadline = None
    while True:
        [created] = yield Enqueue(job.queue, [(job.id, job.delay, job.fields)], others)
        if isinstance(created, str):
            return created
        if created == -2:
            raise QueueClosed(f"queue {job.queue} is closed: it takes no new jobs")
        if created != -1:
            return created
        deadline = deadline or time.monotonic() + wait  # from the first refusal
        left = deadline - time.monotonic()
        if left <= 0:
            raise QueueFull(f"queue {job.queue} is full (its bound is reached)"
                            + (f" and had no room within {wait:g}s" if wait else ""))
        yield Pop("BRPOP", app.keys.q(job.queue) + "notfull", max(0.01, min(left, 1.0)))


def parents(app: TaskRunner, jobs: Any) -> Steps[list[tuple[str, str]]]:
    """(queue, id) of each job of a depends_on list: Job objects, or ids (their queue
    looked up, JobNotFound when there is no such job)."""
    if isinstance(jobs, (str, bytes)) or not hasattr(jobs, "__iter__"):
        raise TypeError("depends_on takes a list of jobs (Job objects or ids)")
    out = []
    for j in jobs:
        if isinstance(j, str):
            queue, _ = yield from find(app, j)
            out.append((queue, j))
        elif hasattr(j, "queue") and hasattr(j, "id"):
            out.append((codec.check_queue(j.queue), codec.check_id(j.id)))
        else:
            raise TypeError(f"depends_on takes Job objects or job ids, not {type(j).__name__}")
    if not out:
        raise ValueError("depends_on is empty: give the jobs to wait for, or leave it out")
    return out


def find(app: TaskRunner, job_id: str, queue: str | None = None) -> Steps[tuple[str, dict[str, str]]]:
    """The queue and record of the job with that id (its queue looked up when not given)."""
    codec.check_id(job_id)
    queues = [queue] if queue else sorted((yield Command("smembers", (app.keys.queues,))))
    records = yield Pipeline(tuple(Command("hgetall", (app.keys.job(q, job_id),)) for q in queues))
    for q, data in zip(queues, records):
        if data:
            return q, data
    raise JobNotFound(f"no job {job_id} (never enqueued, or expired after its result TTL)")


def wait(app: TaskRunner, job_id: str, queue: str, timeout: float | None) -> Steps[dict[str, str]]:
    """Wait until the job ends, and give its record (the caller returns its result or
    raises its failure), or raise Timeout. Blocks in Redis (BLPOP on notify:<id>), no
    polling; it looks again at least every LOOK_AGAIN seconds, in case a notification was
    lost. When Redis fails meanwhile (a restart, a failover) it backs off and looks again:
    the job went on (logged in the process's shared outage, outage_of()). With a timeout,
    a Redis still unreachable at its end raises the Redis error (the job's state is
    unknown), not Timeout."""
    deadline = None if timeout is None else time.monotonic() + timeout
    backoff = Backoff(f"waiting for job {job_id}", deadline, outage_of(app))
    prefix = app.keys.q(queue)
    try:
        while True:
            try:
                state = yield Script(scripts.WATCH, [prefix], [job_id])
                if not state:
                    raise JobNotFound(f"no job {job_id} in queue {queue}")
                if state in FINAL:
                    data = yield Command("hgetall", (app.keys.job(queue, job_id),))
                    backoff.ok()
                    if data:
                        return data
                    raise JobNotFound(f"no job {job_id} in queue {queue} (expired as it ended)")
                left = LOOK_AGAIN if deadline is None else min(LOOK_AGAIN, deadline - time.monotonic())
                if left <= 0:
                    raise Timeout(f"job {job_id} still {state} after {timeout}s")
                yield Pop("BLPOP", f"{prefix}notify:{job_id}", max(left, 0.01))
                backoff.ok()
            except REDIS_ERRORS as e:
                yield Sleep(backoff.after(e))
    finally:  # ended otherwise than through (JobNotFound, Timeout, closed): it leaves the outage it rode
        backoff.give_up()


def kill(app: TaskRunner, job_id: str, queue: str, who: str) -> Steps[str]:
    """Kill the job: pending, delayed or waiting ones at once; a running one is stopped by
    the worker that holds it, told on its control list. Answers "killed" (by this call),
    "running" (the worker acts on the request), or "already <state>" for a job that had
    ended before (e.g. "already killed"): then nothing was done, and a caller must not
    report it killed now."""
    state, *rest = yield Script(scripts.KILL, [app.keys.q(queue)], [job_id, who, app.settings.failed_ttl])
    if not state:
        raise JobNotFound(f"no job {job_id} in queue {queue}")
    if state == "ended":
        return f"already {rest[0]}"
    if state == "running" and rest[0]:
        yield from send_control(app, rest[0], {"kill": job_id, "attempt": int(rest[1]), "reason": "killed"})
    return state


def kills(app: TaskRunner, jobs: list[tuple[str, str]], who: str) -> Steps[list[str]]:
    """kill() of several jobs ((queue, id) each) in one round trip (on a Redis Cluster each
    call to its slot's primary), the workers of those running told in one more: each one's
    answer as kill() gives it, "" for a job that does not exist."""
    found = yield Scripts(tuple(Script(scripts.KILL, [app.keys.q(q)], [i, who, app.settings.failed_ttl])
                                for q, i in jobs))
    out: list[str] = []
    tell: list[Command] = []
    for (_, job_id), (state, *rest) in zip(jobs, found):
        out.append(f"already {rest[0]}" if state == "ended" else state or "")
        if state == "running" and rest[0]:
            tell += control(app, rest[0], {"kill": job_id, "attempt": int(rest[1]), "reason": "killed"})
    if tell:
        yield Pipeline(tuple(tell))
    return out


def send_control(app: TaskRunner, worker: str, message: dict[str, Any]) -> Steps[None]:
    """Put a message on a worker's control list (it BRPOPs it at once); kept an hour."""
    yield Pipeline(control(app, worker, message))


def control(app: TaskRunner, worker: str, message: dict[str, Any]) -> tuple[Command, Command]:
    """The commands of send_control()."""
    key = app.keys.control(worker)
    return Command("lpush", (key, codec.dumps(message))), Command("expire", (key, 3600))


def carry(app: TaskRunner, found: list[joins.Entry]) -> Steps[int]:
    """Apply outbox entries (joins.py) with join.lua in their children's slots (one call per
    children's queue, all in one round trip), then delete them from their outboxes; then the
    entries those calls left in turn (a child canceled there that has children in other
    slots). Returns how many a child counted or was canceled by (join.lua's answer 1)."""
    applied = 0
    while found:
        by_child: dict[str, list[joins.Entry]] = {}
        for e in found:
            by_child.setdefault(e.fields["child"].split(" ", 1)[0], []).append(e)
        answers = yield Scripts(tuple(Script(scripts.JOIN, [app.keys.q(cq)], joins.join_args(app, entries))
                                      for cq, entries in by_child.items()))
        following: list[joins.Entry] = []
        for entries, answer in zip(by_child.values(), answers):
            done, more = joins.split(answer, len(entries))
            applied += done.count(1)
            following += more
        by_outbox: dict[str, list[str]] = {}
        for e in found:
            by_outbox.setdefault(e.queue, []).append(e.id)
        yield Pipeline(tuple(Command("xdel", (joins.outbox(app, q), *ids)) for q, ids in by_outbox.items()))
        found = following
    return applied
