"""The worker's scheduling policy, as pure functions of what it knows (no I/O, no clock:
`now` is an argument): how many jobs to keep sent to each child, which children have room
for more, when to talk to Redis next, whose answers may wait, and how long to wait for
anything. The worker's loop (main.py) acts on their answers; their tests are in
tests/test_policy.py.

A child is seen as a `Lane`: the deliveries sent to it, in order (the first runs once its
`began` is set), whether it takes more (`open`: it is not being stopped or replaced), how
many more it may be sent (`left`: inf, unless it is replaced after a number of jobs), how
many it runs at once (`capacity`: 1, or a loop child's threads and coroutine slots; each
job's `began` is then set when the child says it began, and `last_began` is the latest of
those), and when it gets SIGKILL if it is being stopped."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, TypeVar

from taskrunner.protocol.claims import Delivery

#: Seconds of work, by the runtimes seen so far, that a child is sent ahead (its prefetch).
#: 100 ms: a child of 20 ms jobs holds 4-5, and refills once it is down to half of them,
#: so that the worker claims for many children at once and their results go together (at
#: 64-way, 0.03 round trips to Redis per job instead of 0.15, and ~10% less Redis CPU per
#: job than at 10 ms, with no child waiting for a claim). Celery sends 4 jobs ahead whatever
#: their length; jobs held behind a long one go back to the queue after HOLD.
PREFETCH_WINDOW = 0.1
#: A job that runs longer than this (or than its max duration) hands the jobs sent ahead
#: of it back to the queue, for other workers.
HOLD = 1.0
#: Seconds results may wait to go to Redis together while children have jobs queued (they
#: run those without us), whether a sync is in flight or not; a claim due sooner takes them
#: along. Short, as a waiter sees its job's end that much later: at 64-way 20 ms jobs, as
#: few round trips per job as half the window gave (0.03), and a result seen at most 10 ms
#: late. A lone job's result goes at once.
FLUSH_AFTER = 0.01
#: Syncs in flight at most: Redis runs one while we act on another's answers.
FLIGHTS = 2
#: While children run short jobs with more queued, we look at their answers this often
#: instead of waking for each one.
GLANCE = 0.0005
#: Seconds a worker waits at most without a reason (a bound on any missed wake-up).
IDLE_MAX = 5.0

INF = float("inf")


class Lane(Protocol):
    @property
    def jobs(self) -> Sequence[Delivery]: ...

    @property
    def open(self) -> bool: ...

    @property
    def left(self) -> float: ...

    @property
    def capacity(self) -> int: ...

    @property
    def kill_at(self) -> float | None: ...

    @property
    def last_began(self) -> float | None: ...


L = TypeVar("L", bound=Lane)


def depth(runtime: float | None, prefetch: int) -> int:
    """How many jobs to keep sent to each child: as many as it should run in
    PREFETCH_WINDOW by the runtimes seen so far (`runtime`, a moving average; 1 until one
    has run), at most `prefetch`, so that a child never waits for our round trip to Redis
    while jobs are short, and a long job holds few others back."""
    if runtime is None or prefetch == 1:
        return 1
    return max(1, min(prefetch, int(PREFETCH_WINDOW / max(runtime, 1e-6))))


def spare(runtime: float | None, capacity: int, prefetch: int) -> int:
    """How many jobs a child that runs several at once is sent beyond its free slots, to
    begin as soon as a slot frees instead of a round trip to Redis later (a 20 ms job held
    its slot ~26 ms without them at 256-way): as many as it begins in PREFETCH_WINDOW by
    the runtimes seen so far, at most `prefetch`; none until one has run, with prefetch 1,
    or for a classic child (its depth() says)."""
    if runtime is None or prefetch == 1 or capacity == 1:
        return 0
    return min(prefetch, int(capacity * PREFETCH_WINDOW / max(runtime, 1e-6)))


def moving(lane: Lane, now: float) -> bool:
    """Has a child that runs several at once begun a job within PREFETCH_WINDOW? Then
    jobs sent beyond its free slots begin soon; not while long jobs hold every slot (as
    a classic child gets nothing behind a long job)."""
    return lane.last_began is not None and now - lane.last_began <= PREFETCH_WINDOW


def _ahead_of_spare(lane: Lane, now: float) -> float:
    """Seconds of max duration before the next job sent to a full child that runs several
    at once begins, at the latest: once every job ahead of it has ended, each slot is free
    (the running ones within what is left of their max duration, those waiting one behind
    the other, as claim.lua counts the jobs claimed with it)."""
    ahead = 0.0
    waiting = 0.0
    for d in lane.jobs:
        if d.began is None:
            waiting += d.max_duration
        else:
            ahead = max(ahead, d.max_duration - min(now - d.began, d.max_duration))
    return ahead + waiting


def slots(lanes: Sequence[L], depth: int, now: float, spare: int = 0) -> list[tuple[L, float]]:
    """Room in the children for more jobs, interleaved so that a short claim is shared
    out: (child, seconds of max duration ahead of its next job). None behind a job that
    has run longer than PREFETCH_WINDOW, nor in a child being stopped. A child that runs
    several at once is sent enough to fill its free slots (each begins at once), and
    `spare` more while it is moving()."""
    wants = []
    for lane in lanes:
        if not lane.open:
            continue
        if lane.capacity > 1:
            n = lane.capacity - len(lane.jobs) + (spare if moving(lane, now) else 0)
            if n > 0:
                ahead = 0.0 if len(lane.jobs) < lane.capacity else _ahead_of_spare(lane, now)
                wants.append((lane, min(n, lane.left), ahead))
            continue
        head = lane.jobs[0] if lane.jobs else None
        if head is not None and head.began is not None and now - head.began > PREFETCH_WINDOW:
            continue  # a long job: nothing more waits behind it
        ahead = sum(d.max_duration for d in lane.jobs)
        if head is not None and head.began is not None:
            ahead -= min(now - head.began, head.max_duration)
        wants.append((lane, min(depth - len(lane.jobs), lane.left), ahead))
    most = int(max((n for _, n, _ in wants), default=0))  # a loop child's free slots may exceed depth
    return [(lane, ahead) for i in range(most) for lane, n, ahead in wants if n > i]


def quiet(lanes: Sequence[L], runtime: float | None, depth: int, stopping: bool) -> list[L]:
    """Children busy with short jobs and with enough of them queued that their answers
    can wait for our next glance: we read them GLANCE apart, many at a time, instead of
    waking for each one."""
    if runtime is None or runtime > GLANCE or stopping:
        return []
    return [lane for lane in lanes if len(lane.jobs) > depth // 2 and lane.open]


def retire_reason(done: int, rss: int | None, max_jobs: int | None, max_memory_mb: float | None) -> str | None:
    """Why a child that has answered `done` jobs and uses `rss` bytes (None: not
    measured) is to be replaced by a fresh one (recycling), or None."""
    if max_jobs is not None and done >= max_jobs:
        return f"it ran {done} jobs (--max-jobs-per-child {max_jobs})"
    if max_memory_mb is not None and rss is not None and rss > max_memory_mb * 2**20:
        return f"it uses {rss / 2**20:.0f} MB (--max-memory-per-child {max_memory_mb:g})"
    return None


def running(lane: Lane) -> Sequence[Delivery]:
    """The jobs of a child that may be running: the first (a classic child), or those that
    began (a loop child begins them in order: a prefix of what it was sent)."""
    jobs = lane.jobs
    if lane.capacity == 1 or not jobs:
        return (jobs[0],) if jobs else ()
    begun = []  # a plain loop: the worker asks at each wake-up, of every job a child runs
    for d in jobs:
        if d.began is None:
            break
        begun.append(d)
    return begun


def hand_back_due(lane: Lane, stopping: bool) -> float:
    """When the jobs sent ahead to a child go back to the queue: at once while stopping,
    else when its running job has run HOLD seconds (or its max duration, if shorter);
    never with nothing sent ahead, or before the first job began. A child that runs
    several at once: when it has begun none for HOLD seconds while it holds more jobs
    than its slots (its spare ones wait behind long jobs)."""
    began = lane.jobs[0].began if len(lane.jobs) >= 2 else None
    if began is None:
        return INF
    if stopping:
        return -INF
    if lane.capacity > 1:
        last = lane.last_began
        return last + HOLD if last is not None and len(lane.jobs) > lane.capacity else INF
    return began + min(HOLD, lane.jobs[0].max_duration)


def sync_due(now: float, lanes: Sequence[Lane], depth: int, *, flights: int, urgent: bool,
             outbox_since: float | None, notes_due: float, can_claim: bool, stopping: bool,
             spare: int = 0) -> float:
    """When to talk to Redis next. At once when something is `urgent` (stuck marks, a
    reconcile) or a claim is due (claim_slots()); results (waiting since `outbox_since`)
    wait up to FLUSH_AFTER while a child has jobs queued (queued()), to go with more
    results or with the next claim, whether a sync is in flight or not: more per round
    trip, less work for Redis and for us; else (a lone job's, a stopping worker's) they go
    at once. Progress reports at `notes_due`. Never while FLIGHTS syncs are in flight.
    `can_claim`: claims are allowed now (none in flight, queues not found empty, not
    stopping). `spare`: as slots() takes it."""
    if flights >= FLIGHTS:
        return INF
    if urgent:
        return now
    due = notes_due
    if outbox_since is not None:
        due = min(due, outbox_since + FLUSH_AFTER if queued(lanes) and not stopping else now)
    if can_claim and claim_slots(lanes, depth, now, spare):
        return now
    return due


def queued(lanes: Sequence[Lane]) -> bool:
    """Does a child hold jobs beyond those it can run at once (its capacity: one, or its
    threads or async slots)? It goes on without us, so results may wait FLUSH_AFTER for
    company; a child running a few jobs at once with none waiting (an async worker with
    two jobs) sends each result at once, as a lone job's. Results sent at once whenever no
    sync was in flight went 1.5–2.5 per finish.lua call where each job makes a Redis round
    trip itself (Redis answered a one-result sync before the next job ended), and at 64-way
    with spare jobs, one sync per result or two cost a job 23 Redis commands and ~80 us of
    Redis CPU."""
    return any(len(lane.jobs) > lane.capacity for lane in lanes)


def claim_slots(lanes: Sequence[L], depth: int, now: float, spare: int = 0,
                probing: bool = False) -> list[tuple[L, float]]:
    """What a sync claims for: once a child is hungry(), every child's room (slots()), so
    that one claim serves them all; nothing before, even when a sync goes for results
    (such a sync topped up what room there was, a job or two, and a busy worker made a
    claim.lua call per ~4 jobs instead of per ~depth). `probing` (the last claim found the
    queues empty): one job per child with room, the first of slots()'s interleaved order. A
    lone job's claim asked for every child's depth, 256 jobs with 100 ms of short jobs, and
    claim.lua checks and the worker writes each one asked (+0.9 ms to a lone job's pickup);
    a probe that gets all it asked is followed at once by the full claim (the children are
    still hungry)."""
    if not any(hungry(lane, depth, now, spare) for lane in lanes):
        return []
    room = slots(lanes, depth, now, spare)
    if probing:
        first: dict[int, tuple[L, float]] = {}  # each child's first slot, in order
        for lane, ahead in room:
            first.setdefault(id(lane), (lane, ahead))
        room = list(first.values())
    return room


def listening(lanes: Sequence[Lane]) -> bool:
    """Should a worker that found its queues empty wait on their wake lists? While a child
    has nothing to do, or one that runs several at once has a free slot: a job enqueued
    now could begin at once. (A classic child busy with a job takes the next once it is
    done, when this holds again.)"""
    return any(lane.open and len(lane.jobs) < lane.capacity for lane in lanes)


def hungry(lane: Lane, depth: int, now: float, spare: int = 0) -> bool:
    """Is it time to claim for this child? A classic one once it is down to half of
    `depth`; one that runs several at once as soon as it has a free slot, or, while it is
    moving(), once it is down to half of its `spare` jobs (one claim for many)."""
    if not lane.open:
        return False
    if lane.capacity > 1:
        n = len(lane.jobs)
        return n < lane.capacity or (spare > 0 and n <= lane.capacity + spare // 2 and moving(lane, now))
    return len(lane.jobs) <= depth // 2


def wait_timeout(now: float, lanes: Sequence[Lane], *, redis_ok_at: float, next_beat: float, sync_at: float,
                 answer_by: float | None, stopping: bool, stop_at: float, give_up_at: float) -> float:
    """Seconds until the next thing to do. Only what is still ahead counts: a deadline
    that passed and was acted on (a job flagged stuck, the end of the shutdown grace) is
    not waited for again, and while we back off from a Redis failure (until `redis_ok_at`)
    nothing that talks to Redis is due: either would keep the timeout at 0, a spin.
    `answer_by`: when the syncs in flight must have been answered (None: none in flight)."""
    if now < redis_ok_at:
        t = [redis_ok_at]
    else:
        t = [next_beat, now + IDLE_MAX, sync_at]
        if answer_by is not None:
            t.append(answer_by)
    for lane in lanes:
        for d in running(lane):
            if not d.stuck:
                t.append(d.deadline)
            if d.stop_at is not None:
                t.append(d.stop_at)
        t.append(hand_back_due(lane, False))
        if lane.kill_at:
            t.append(lane.kill_at)
    if stopping:
        t.append(stop_at if now < stop_at else give_up_at)
    return max(0.0, min(t) - now)
