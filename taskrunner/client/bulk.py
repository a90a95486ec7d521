"""TaskRunner.enqueue_many: many jobs, one round trip per chunk (its docstring says what the
call promises; this module is how).

One call is several concerns, each a part here, so that each can be read on its own:
  - draft_of(), links_of(): one job given, checked and encoded as enqueue.lua takes it;
  - Chunk: the jobs gathered for the next round trip, and the per-queue (per-slot, on a
    Redis Cluster) calls they make;
  - Flight: a chunk sent, whose answers Redis has not given yet, read while riding out an
    outage (it is sent again: each job has its id, so none is enqueued twice);
  - Tally: what became of the jobs so far (enqueued, refused, and a lone call's job in
    flight), and the error that stops the call, carrying them;
  - BulkEnqueue: the call itself, which feeds the jobs through these, overlapping the
    building of one chunk with Redis running the one before it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import redis

from taskrunner.client import canvas, eager, flow, steps
from taskrunner.client.canvas import Signature
from taskrunner.client.job import Job
from taskrunner.errors import QueueClosed, QueueFull, restated
from taskrunner.protocol import codec, outages, scripts
from taskrunner.protocol.codec import seconds
from taskrunner.protocol.connection import is_cluster
from taskrunner.protocol.links import Direct
from taskrunner.protocol.outages import Backoff

if TYPE_CHECKING:
    from taskrunner.client.app import TaskRunner

#: One job as enqueue.lua takes it: (id, delay, fields).
Item = tuple[str, float, list[Any]]
#: A job's links: its parents ((queue, id) each), on_success and on_failure.
Links = tuple[list[tuple[str, str]], Signature | None, Signature | None]
#: The fields a job given to enqueue_many may have.
FIELDS = frozenset(("task", "args", "kwargs", "queue", "delay", "max_duration", "retries", "max_retries", "id",
                    "headers", "depends_on", "on_success", "on_failure", "priority", "unique_key", "unique_for",
                    "unique_until", "expires"))


def draft_of(app: TaskRunner, spec: Any) -> steps.Draft:
    """One job of enqueue_many, checked like enqueue's (its hooks not run yet: with its
    links', steps.hooked)."""
    if not isinstance(spec, dict) or "task" not in spec:
        raise ValueError("expected an object with a 'task' field")
    unknown = set(spec) - FIELDS
    if unknown:
        raise ValueError(f"unknown fields {sorted(unknown)}")
    task = codec.check_name("task", spec["task"])
    job, sent = app._job_spec(task, {k: spec.get(k) for k in ("queue", "retries", "max_retries", "max_duration")})
    job_id = codec.check_id(spec["id"]) if spec.get("id") is not None else codec.new_id()
    delay = seconds("delay", spec.get("delay") or 0)
    args = spec.get("args") or []
    extra = flow.fields(task, args, spec.get("kwargs"), spec.get("priority"), spec.get("unique_for"),
                        spec.get("unique_key"), spec.get("unique_until"), spec.get("expires"))
    job = job.merged(queue=steps.ride(app, steps.placed(app, task, job, extra, spec.get("id")), "enqueueing"))
    fields, unhooked = app._checked(task, args, spec.get("kwargs"), job, sent, spec.get("headers"), job_id=job_id)
    return steps.Draft(job_id, job.queue, delay, fields + extra, unhooked)


def links_of(app: TaskRunner, spec: dict[str, Any], seen: dict[str, Job]) -> Links | None:
    """The depends_on (as (queue, id)), on_success and on_failure of one job of
    enqueue_many; None when it has none. An id of a job given earlier in the same call
    names that job (in eager mode, only those and Job objects can be named)."""
    depends_on, on_success, on_failure = (spec.get(k) for k in ("depends_on", "on_success", "on_failure"))
    if depends_on is None and on_success is None and on_failure is None:
        return None
    parents: list[tuple[str, str]] = []
    if depends_on is not None:
        given = depends_on if isinstance(depends_on, (list, tuple)) else None
        if given is None:
            raise TypeError("depends_on takes a list of jobs (ids or Job objects)")
        here = [seen.get(j, j) if isinstance(j, str) else j for j in given]
        if app.settings.eager:
            parents = [(j.queue, j.id) for j in eager.parents_of(here) or ()]
        else:
            parents = steps.ride(app, steps.parents(app, here), "enqueueing")
    return parents, app.callback_of(on_success, "on_success"), app.callback_of(on_failure, "on_failure")


class Chunk:
    """The jobs gathered for the next round trip, in the order given. Sent, they are one
    enqueue.lua call per queue (on a Redis Cluster each goes to its queue's slot), which
    names the other queues its jobs' parents are in."""

    def __init__(self) -> None:
        self.jobs: list[tuple[str, str, float, list[Any]]] = []  # (queue, id, delay, fields)
        self.queue_of: dict[str, str] = {}  # id -> queue
        self.parent_queues: dict[str, set[str]] = {}  # queue -> the other queues its jobs' parents are in

    def __len__(self) -> int:
        return len(self.jobs)

    def add(self, queue: str, job_id: str, delay: float, fields: list[Any]) -> None:
        self.jobs.append((queue, job_id, delay, fields))
        self.queue_of[job_id] = queue

    def holds_parent(self, parents: list[tuple[str, str]], queue: str) -> bool:
        """Whether one of `parents` is here in another queue than `queue`: its call may run
        after the child's, so the child waits for the next chunk (its parent written first)."""
        return any(i in self.queue_of and q != queue for q, i in parents)

    def by_queue(self) -> dict[str, list[Item]]:
        """The jobs by queue, in the order given within each: one script call each."""
        out: dict[str, list[Item]] = {}
        for queue, job_id, delay, fields in self.jobs:
            out.setdefault(queue, []).append((job_id, delay, fields))
        return out


class Flight:
    """A chunk sent, its answers still to come: what Redis runs while the next chunk is
    built."""

    def __init__(self, app: TaskRunner, chunk: Chunk, callbacks: set[str]) -> None:
        self.app = app
        self.by_queue = chunk.by_queue()
        self.others = chunk.parent_queues
        self.order = [job_id for _, job_id, _, _ in chunk.jobs]  # in the order given
        self.count = len(chunk) - len(callbacks & chunk.queue_of.keys())  # the jobs the call reports
        self.batch = self.batch_of(app._direct)

    def send(self) -> None:
        """Send the batch on the thread's link, not waiting for the answers (answers() reads
        them); on an error, a batch made anew is sent by answers(), riding out the outage."""
        try:
            self.batch.send()
        except steps.REDIS_ERRORS:
            self.batch = self.batch_of(None)

    def batch_of(self, direct: Direct | None) -> scripts.Batch:
        """The chunk's calls in one batch, anew: a pipeline is spent once executed."""
        app = self.app
        batch = scripts.Batch(app.redis, direct)
        for queue, items in self.by_queue.items():
            app._queue_enqueue(batch, queue, items, self.others.get(queue, ()))
        if is_cluster(app.redis):  # elsewhere the script registers the queue
            batch.pipe.sadd(app.keys.queues, *self.by_queue)
        return batch

    def answers(self) -> list[Any]:
        """The chunk's answers, the chunk sent again while Redis is out (steps.riding
        says why that is safe), up to enqueue_retry seconds from the first error (as
        riding(): a first try that waited out a hung Redis's socket timeout took none of it)."""
        backoff: Backoff | None = None
        batch = self.batch  # that one stays, for unsure() to abandon what it sent on the link
        try:
            while True:
                try:
                    answers = batch.execute(raise_on_error=False)
                    # A script's refusal of bad input (refusal(): nothing written) stays in its
                    # place (its queue's jobs refused, the others' taken); an error that passes
                    # sends the chunk again; any other (one of a command, or a script's that may
                    # have written part of its call: WRONGTYPE, a Lua error) makes it unsure.
                    for k, a in enumerate(answers):
                        if isinstance(a, Exception) and (k >= len(self.by_queue) or outages.transient(a)
                                                         or isinstance(a, redis.RedisError)):
                            raise a
                    if backoff is not None:
                        backoff.ok()
                    return answers
                except steps.REDIS_ERRORS as e:
                    backoff, pause = steps.ride_out(self.app, e, backoff, "enqueue_many")  # raises e when not
                    time.sleep(pause)
                batch = self.batch_of(None)
        finally:  # interrupted in a pause: it leaves the outage it rode
            if backoff is not None:
                backoff.give_up()

    def unsure(self, callbacks: set[str]) -> list[Job]:
        """Its jobs, as the call stopped before their answers came (each may be enqueued).
        The answers owed on this thread's link are abandoned with it (Batch.abandon()), or
        its next lone enqueue would take one of them for its own: not read, as the call may
        be stopping because Redis does not answer (Ctrl-C), nor sent again."""
        queue_of = {i: q for q, items in self.by_queue.items() for i, _, _ in items}
        unsure = [Job(self.app, i, queue_of[i]) for i in self.order if i not in callbacks]
        self.batch.abandon()
        return unsure


@dataclass
class Tally:
    """What became of the jobs of one call so far, each list in the order given: the error
    that stops the call carries them, so that a caller can send again exactly those not
    enqueued (TaskRunner.enqueue_many says how)."""

    enqueued: list[Job] = field(default_factory=list)  # what the call returns
    refused: list[Job] = field(default_factory=list)  # those Redis refused (a chunk's answers raised)
    alone: list[Job] = field(default_factory=list)  # a job written by a call of its own, until its answer came

    def settle(self, flight: Flight, answers: list[Any], callbacks: set[str]) -> BaseException | None:
        """Count a chunk's answers: its jobs Redis took are enqueued, and those it refused,
        refused. Returns the error that refusal is to raise (a script's, restated; else
        QueueClosed when a queue was closed, else QueueFull); None when there was none."""
        made: dict[str, Job] = {}
        no: dict[str, Job] = {}
        why: list[tuple[str, Any]] = []  # (queue, -1, -2 or the script's refusal) per refused call
        for (queue, items), answer in zip(flight.by_queue.items(), answers):
            for k, (job_id, _, _) in enumerate(items):
                created = answer if isinstance(answer, Exception) else answer[k]
                if job_id in callbacks:
                    continue
                job = Job(flight.app, created if isinstance(created, str) else job_id, queue)
                job.created = created == 1
                if isinstance(created, str) or (isinstance(created, int) and created >= 0):
                    made[job_id] = job
                else:
                    no[job_id] = job
                    why.append((queue, created))
            flight.app._known_queues.add(queue)
        self.enqueued.extend(made[job_id] for job_id in flight.order if job_id in made)  # in the order given
        self.refused.extend(no[job_id] for job_id in flight.order if job_id in no)
        if not why:
            return None
        queue, first = next(((q, w) for q, w in why if isinstance(w, Exception)), why[0])
        if isinstance(first, Exception):
            return restated(first, f"{len(no)} jobs refused: queue {queue}: {first}")
        kind = QueueClosed if any(w == -2 for _, w in why) else QueueFull
        return kind(f"{len(no)} jobs refused: queue {queue} is {'closed' if kind is QueueClosed else 'full'}")

    def stopped(self, e: BaseException, failed: BaseException | None, n: int,
                in_flight: list[Job]) -> tuple[BaseException, BaseException | None]:
        """The error that stops the call, and its cause: `e`, what was raised at job `n`
        given, or, when it is a job's own refusal (`failed`: its arguments, links or hook;
        it was not sent), that one; said with how many jobs were enqueued, and carrying them
        (carrying()). `in_flight`: the jobs of the chunk sent whose answers did not come."""
        # A lone call's job: killed by its across() (withdrawn: its id is taken by the killed
        # record, given again it would add nothing), or there (across() kept it), or
        # refused (a refusal, nothing written: the job is not there), or else unsure.
        killed, kept = set(getattr(e, "withdrawn", ())), set(getattr(e, "kept", ()))
        withdrawn = [j for j in self.alone if (j.queue, j.id) in killed]
        lost = isinstance(e, steps.REDIS_ERRORS) or not isinstance(e, Exception)
        self.refused += [j for j in self.alone if (j.queue, j.id) not in killed | kept and not lost]
        unsure = [j for j in self.alone if (j.queue, j.id) in kept or (j.queue, j.id) not in killed and lost]
        unsure += in_flight
        told = "".join((f", {len(self.refused)} refused" if self.refused else "",
                        f", {len(withdrawn)} withdrawn (killed: enqueue them with new ids)" if withdrawn else "",
                        f", the {len(unsure)} after them sent with no answer (maybe enqueued)" if unsure else ""))
        done = len(self.enqueued)
        if failed is None or not isinstance(e, Exception):  # an interrupt (Ctrl-C) is the user's: it goes on
            said = carrying(e, f"{e} (enqueue_many: {done} of the first {n} jobs given enqueued{told}, none after)",
                            self.enqueued, unsure, self.refused, withdrawn)
            return said, (None if said is e else e)
        # The job's own refusal stopped the call; the chunk before it read then (settle()) may
        # have failed too: both are said, that one as the cause.
        also = f"; and before it: {type(e).__name__}: {e}" if e is not failed else ""
        return carrying(failed, f"job {n}: {failed} ({done} of the {n - 1} before it enqueued{told}, none after{also})",
                        self.enqueued, unsure, self.refused, withdrawn), (None if e is failed else e)


def carrying(e: BaseException, message: str, enqueued: list[Job], unsure: list[Job],
             refused: list[Job], withdrawn: list[Job]) -> BaseException:
    """`e` said with `message` (how many jobs the call enqueued: errors.restated(); an error
    not an Exception, as KeyboardInterrupt, as it is), carrying `enqueued`, `unsure`,
    `refused` and `withdrawn` (TaskRunner.enqueue_many says what they are)."""
    said = restated(e, message) if isinstance(e, Exception) else e
    said.enqueued, said.unsure = list(enqueued), list(unsure)  # type: ignore[attr-defined]
    said.refused, said.withdrawn = list(refused), list(withdrawn)  # type: ignore[attr-defined]
    return said


class BulkEnqueue:
    """One enqueue_many call: each job given is checked (draft_of, links_of, its hooks), then
    gathered in the chunk, run here (eager mode), or written by a call of its own (linked());
    a full chunk is sent once the answers of the one before it came (settle(), send()), so
    that Redis runs one while the next is built, and a refusal stops the call before another
    is sent."""

    def __init__(self, app: TaskRunner, size: int, progress: Callable[[int], Any] | None) -> None:
        self.app = app
        self.size = size  # jobs per chunk
        self.progress = progress
        self.chunk = Chunk()
        self.flight: Flight | None = None
        self.tally = Tally()
        self.seen: dict[str, Job] = {}  # the jobs of this call by id, for depends_on
        self.callbacks: set[str] = set()  # ids of callbacks: they are not among the jobs answered
        self.failed: BaseException | None = None  # a job's own check or hook refused it (it was not sent)

    def run(self, jobs: Iterable[dict[str, Any]]) -> list[Job]:
        """The call: `jobs` read once, one at a time (a generator is never held whole), the
        last chunk sent once they ran out. Returns the Jobs Redis took, in the order given;
        whatever stops it is raised said and carrying the jobs so far (Tally.stopped()), the
        chunk in flight abandoned (Flight.unsure())."""
        n = 0  # the job given that the call is at
        try:
            for spec in jobs:
                n += 1
                self.take(spec)
            self.settle()
            if self.chunk:
                self.send()
                self.settle()
        except BaseException as e:
            in_flight = [] if self.flight is None else self.flight.unsure(self.callbacks)
            said, cause = self.tally.stopped(e, self.failed, n, in_flight)
            raise said from cause
        return self.tally.enqueued

    def take(self, spec: Any) -> None:
        """One job given: checked, then run, written alone, or gathered in the chunk."""
        try:
            draft, links, group = self.checked(spec)
        except Exception as e:  # its arguments, its links, a hook's own exception
            if isinstance(e, steps.REDIS_ERRORS):  # a lookup past the bound: for the call, run()
                raise
            self.failed = e
            self.settle()  # those sent are enqueued; say so: a run again would enqueue them twice
            raise
        if self.app.settings.eager:
            self.run_here(draft, links)
            return
        self.seen[draft.id] = Job(self.app, draft.id, draft.queue)
        if links is None:
            self.chunk.add(draft.queue, draft.id, draft.delay, draft.fields)
        else:
            self.linked(draft, links, group)
        if len(self.chunk) >= self.size:
            self.settle()
            self.send()

    def checked(self, spec: Any) -> tuple[steps.Draft, Links | None, list[steps.Draft]]:
        """A job given, checked, its links (None: it has none), and the drafts of it and its
        callbacks, hooked: none is hooked unless all of them passed their checks."""
        app = self.app
        draft = draft_of(app, spec)
        links = links_of(app, spec, self.seen)
        if links is not None and app.settings.eager:
            canvas.check_callbacks(app, links[1], links[2])
        if links is not None and links[0]:
            if draft.delay:
                raise ValueError(canvas.NO_DELAY)
            draft.fields += ["parents", " ".join(f"{q} {i}" for q, i in links[0])]
        group = steps.hooked(app, [draft] if links is None or app.settings.eager else [
            draft, *steps.ride(app, canvas.callbacks(app, draft, links[1], links[2]), "enqueueing")])
        return draft, links, group

    def run_here(self, draft: steps.Draft, links: Links | None) -> None:
        """Eager mode: the job runs now, in order, and its callbacks after it."""
        parents = None if links is None or not links[0] else [self.seen[i] for _, i in links[0]]
        ran: Job = eager.enqueue(self.app, draft.id, draft.fields, parents)
        if links is not None:
            ran = canvas.eager_callbacks(self.app, ran, links[1], links[2])
        self.tally.enqueued.append(ran)
        self.seen[draft.id] = ran
        if self.progress:
            self.progress(1)

    def linked(self, draft: steps.Draft, links: Links, group: list[steps.Draft]) -> None:
        """A job with depends_on or callbacks: in the chunk, or in a call of its own."""
        parents = links[0]
        queues = {q for q, _ in parents} - {draft.queue}
        # Callbacks in another queue, or on a cluster parents in another slot: written with
        # it, at once (across slots, canvas.across: after its parents, which attach.lua tells).
        if len({d.queue for d in group}) > 1 or (queues and is_cluster(self.app.redis)):
            self.settle()
            if self.chunk:
                self.send()
                self.settle()
            job = Job(self.app, draft.id, draft.queue)
            self.tally.alone.append(job)
            [created, *_] = steps.ride(self.app, canvas.written(self.app, group, "job", tuple(sorted(queues))),
                                        "enqueueing")
            self.tally.alone.clear()
            job.created = created == 1
            self.tally.enqueued.append(job)
            if self.progress:
                self.progress(1)
            return
        if self.chunk.holds_parent(parents, draft.queue):  # its parent goes first
            self.settle()
            self.send()
        for d in group:
            self.chunk.add(d.queue, d.id, d.delay, d.fields)
        self.callbacks.update(d.id for d in group[1:])
        self.chunk.parent_queues.setdefault(draft.queue, set()).update(queues)

    def send(self) -> None:
        """Send the chunk (its answers are read by settle()) and start the next."""
        flight = Flight(self.app, self.chunk, self.callbacks)
        self.flight = flight  # before it goes: stopped while it is sent (Ctrl-C), its jobs may be in Redis
        flight.send()
        self.chunk = Chunk()

    def settle(self) -> None:
        """Read the answers of the chunk sent: a refused job raises before another is sent."""
        if self.flight is None:
            return
        flight = self.flight
        answers = flight.answers()
        self.flight = None
        refusal = self.tally.settle(flight, answers, self.callbacks)
        if self.progress:
            self.progress(flight.count)
        if refusal is not None:
            raise refusal
