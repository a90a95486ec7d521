"""Workflows: signatures, chains, groups and chords (docs/PROTOCOL.md, Workflows).

A chain is written by one enqueue.lua call: every step's record and the edges between them.
The first step is pending; each other step waits (state `waiting`) for its parent, and the
finish script that ends the parent makes it pending in the same call, its parent's result
first in its args (unless the step is immutable, `.si`). A step that fails for good ends the
steps after it `canceled`, in that same call. So a chain survives any kill with each step
made pending exactly once, with no process of its own to join the steps. A group is jobs
side by side, written by one call; a chord a group and a callback that waits for all of its
members, given the array of their results (read when the last one completes).
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from taskrunner.client import arguments, eager, flow, steps
from taskrunner.client.job import Job
from taskrunner.errors import QueueClosed, QueueFull, restated
from taskrunner.protocol import joins, scripts

if TYPE_CHECKING:
    from taskrunner.client.app import Task, TaskRunner

#: The options a signature may carry: those of Task.apply_async that belong to one job.
OPTIONS = frozenset(("queue", "max_duration", "retries", "max_retries", "job_id", "headers", "delay", "expires"))


@dataclass(frozen=True)
class Named:
    """A task known by its name alone (TaskRunner.signature of a task this app does not
    declare): its jobs get the settings its workers declared in Redis, as enqueue.lua fills
    them in, and the queue they declared."""

    app: TaskRunner
    name: str

    def job_spec(self, *_: Any) -> None:
        """No spec here: the options given are sent, the rest comes from the declaration."""
        return None

    def apply_async(self, args: Any = (), kwargs: dict | None = None, *, delay: float | None = None,
                    job_id: str | None = None, headers: dict[str, Any] | None = None, **options: Any) -> Job:
        return self.app.enqueue(self.name, args, kwargs, delay=delay, job_id=job_id, headers=headers, **options)


@dataclass(frozen=True)
class Signature:
    """A task with its arguments and options, to be enqueued later (a step of a chain).
    `immutable`: the step does not receive its parent's result."""

    task: Task | Named
    args: tuple[Any, ...] = ()
    kwargs: dict[str, Any] = field(default_factory=dict)
    options: dict[str, Any] = field(default_factory=dict)
    immutable: bool = False

    def set(self, **options: Any) -> Signature:
        """A copy with these options (queue, max_duration, retries, max_retries, job_id,
        headers, delay, expires) set."""
        unknown = set(options) - OPTIONS
        if unknown:
            raise TypeError(f"unknown signature options {sorted(unknown)}; known: {sorted(OPTIONS)}")
        return replace(self, options={**self.options, **options})

    def __or__(self, other: Signature | Chain) -> Chain:
        return chain(self, other)

    def delay(self) -> Job:
        return self.apply_async()

    def apply_async(self) -> Job:
        """Enqueue the task alone, with its arguments and options."""
        return self.task.apply_async(self.args, self.kwargs, **self.options)

    def __repr__(self) -> str:
        return f"{self.task.name}.{'si' if self.immutable else 's'}{self.args!r}"


class Chain:
    """Steps run one after the other, each given its parent's result as its first argument
    (unless immutable). delay() enqueues them all in one call and returns the last step's
    Job: its wait() gives the chain's result, or raises JobFailed naming the step that
    failed."""

    def __init__(self, *parts: Signature | Chain) -> None:
        flat: list[Signature] = []
        for s in parts:
            if isinstance(s, Chain):
                flat += s.steps
            elif isinstance(s, Signature):
                flat.append(s)
            else:
                raise TypeError(f"a chain takes signatures (task.s(...), task.si(...)), not {type(s).__name__}")
        if not flat:
            raise ValueError("a chain needs at least one step")
        self.steps: list[Signature] = flat

    def __or__(self, other: Signature | Chain) -> Chain:
        return Chain(self, other)

    def __repr__(self) -> str:
        return " | ".join(map(repr, self.steps))

    def delay(self) -> Job:
        return self.apply_async()

    def apply_async(self) -> Job:
        """Enqueue every step in one enqueue.lua call; the last step's Job. In eager mode the
        steps run here, in order. QueueClosed or QueueFull when the first step's queue
        refused it (then no step was enqueued)."""
        app = self.steps[0].task.app
        if app.settings.eager:
            drafts = steps.run(app, make_drafts(app, self.steps, 1))
            return eager.chain(app, [(d.id, d.fields) for d in drafts], [s.immutable for s in self.steps])
        return steps.ride(app, self.enqueued(), "enqueueing a chain")[-1]

    def enqueued(self) -> steps.Steps[list[Job]]:
        """Enqueue every step, as an operation (steps.py: apply_async runs it, and so does
        AsyncClient.apply); every step's Job, in order."""
        app = self.steps[0].task.app
        drafts = yield from make_drafts(app, self.steps, 1)
        for parent, child, sig in zip(drafts, drafts[1:], self.steps[1:]):
            child.fields += ["parents", f"{parent.queue} {parent.id}", *(() if sig.immutable else ("takes", "result"))]
        return (yield from _write(app, drafts, "chain"))


class Group:
    """Jobs that run side by side: delay() enqueues them all in one call and returns a
    GroupJob, whose wait() gives their results in the group's order."""

    def __init__(self, *parts: Signature | Iterable[Signature]) -> None:
        sigs: list[Signature] = []
        for part in parts:
            sigs += [part] if isinstance(part, Signature) else list(part)
        bad = [s for s in sigs if not isinstance(s, Signature)]
        if bad:
            raise TypeError(f"a group takes signatures (task.s(...)), not {type(bad[0]).__name__}")
        if not sigs:
            raise ValueError("a group needs at least one member")
        self.members = sigs

    def __repr__(self) -> str:
        return f"group({', '.join(map(repr, self.members))})"

    def delay(self) -> GroupJob:
        return self.apply_async()

    def apply_async(self) -> GroupJob:
        """Enqueue every member in one enqueue.lua call (in eager mode: run each here)."""
        app = self.members[0].task.app
        if app.settings.eager:
            drafts = steps.run(app, make_drafts(app, self.members))
            return GroupJob([eager.enqueue(app, d.id, d.fields) for d in drafts])
        return GroupJob(steps.ride(app, self.enqueued(), "enqueueing a group"))

    def enqueued(self) -> steps.Steps[list[Job]]:
        """Enqueue every member, as an operation (as Chain.enqueued); their Jobs, in order."""
        app = self.members[0].task.app
        return (yield from _write(app, (yield from make_drafts(app, self.members)), "group"))


class GroupJob:
    """The jobs of a group, in order."""

    def __init__(self, jobs: list[Job]) -> None:
        self.jobs = jobs

    @property
    def ids(self) -> list[str]:
        return [j.id for j in self.jobs]

    def wait(self, timeout: float | None = None) -> list[Any]:
        """Every member's result, in order, once all ended; JobFailed for the first member
        (in order) that did not complete; Timeout after `timeout` seconds in all."""
        deadline = None if timeout is None else time.monotonic() + timeout
        return [j.wait(None if deadline is None else max(0.0, deadline - time.monotonic())) for j in self.jobs]

    def __repr__(self) -> str:
        return f"GroupJob({self.ids})"


class Chord:
    """A group and a callback run once all members ended, given the array of their results
    (in the group's order) first in its args, unless immutable. A member that does not
    complete cancels the callback, or with on_member_failure="continue" gives it null
    (None) in its place."""

    def __init__(self, header: Group | Iterable[Signature], body: Signature, on_member_failure: str = "cancel") -> None:
        if on_member_failure not in ("cancel", "continue"):
            raise ValueError("on_member_failure must be 'cancel' or 'continue'")
        if not isinstance(body, Signature):
            raise TypeError(f"a chord's callback is a signature (task.s(...)), not {type(body).__name__}")
        self.header = header if isinstance(header, Group) else Group(header)
        self.body, self.on_member_failure = body, on_member_failure

    def delay(self) -> Job:
        return self.apply_async()

    def apply_async(self) -> Job:
        """Enqueue the members and the callback in one enqueue.lua call; the callback's Job
        (its wait() gives the chord's result)."""
        app = self.body.task.app
        if app.settings.eager:
            *members, callback = steps.run(app, make_drafts(app, [*self.header.members, self.body],
                                                            len(self.header.members)))
            done: list[Job] = [eager.enqueue(app, d.id, d.fields) for d in members]
            return eager.chord(app, (callback.id, callback.fields), done, self.body.immutable,
                               self.on_member_failure == "continue")
        return steps.ride(app, self.enqueued(), "enqueueing a chord")[-1]

    def enqueued(self) -> steps.Steps[list[Job]]:
        """Enqueue the members and the callback, as an operation (as Chain.enqueued); their
        Jobs, the callback's last."""
        app = self.body.task.app
        drafts = yield from make_drafts(app, [*self.header.members, self.body], len(self.header.members))
        *members, callback = drafts
        callback.fields += ["parents", " ".join(f"{d.queue} {d.id}" for d in members)]
        if not self.body.immutable:
            callback.fields += ["takes", "results"]
        if self.on_member_failure == "continue":
            callback.fields += ["on_parent_failure", "continue"]
        return (yield from _write(app, drafts, "chord"))


def make_drafts(app: TaskRunner, sigs: list[Signature], fed: int | None = None,
                hooks: bool = True) -> steps.Steps[list[steps.Draft]]:
    """Each signature's job as enqueue.lua takes it (ids made here). A task known by name
    only sends the options given; its declaration in Redis gives the rest. The signatures
    from index `fed` on are given their parent's value first unless immutable (a chain's
    steps after the first: 1; a chord's callback: the members' count; a callback alone: 0;
    None: none, a group's members). Their before_enqueue hooks run once all are checked
    (a workflow refused for one step's arguments runs none); `hooks` False: not here (a
    job's callbacks, hooked with it)."""
    out = []
    for n, sig in enumerate(sigs):
        o = sig.options
        settings = {k: o.get(k) for k in ("queue", "max_duration", "retries", "max_retries")}
        spec = sig.task.job_spec(*settings.values())
        out.append((yield from steps.draft(app, sig.task.name, sig.args, sig.kwargs, spec,
                                           {} if spec is not None else settings, o.get("delay"), o.get("job_id"),
                                           o.get("headers"), flow.expiry(o.get("expires")),
                                           fed=fed is not None and n >= fed and not sig.immutable)))
    return steps.hooked(app, out) if hooks else out


#: A job with parents becomes pending when they completed: a delay has nothing to count from.
NO_DELAY = "a job with depends_on cannot have a delay (it runs once its parents completed)"


def refuse_bad_links(flow_fields: list[Any], delay: float | None, depends_on: Any, on_success: Any,
                     on_failure: Any) -> None:
    """What enqueue.lua refuses of a job's links, said in the caller's words before anything
    is sent (the script's refusal names a job id the caller never saw): a unique job
    (`flow_fields`, flow.fields()) in a workflow, a delay with depends_on."""
    if "unique_key" in flow_fields and (depends_on is not None or on_success is not None or on_failure is not None):
        raise ValueError("a unique job cannot be part of a workflow (depends_on, on_success, on_failure)")
    if depends_on is not None and delay:
        raise ValueError(NO_DELAY)


def linked(app: TaskRunner, draft: steps.Draft, depends_on: Any, on_success: Signature | None,
           on_failure: Signature | None, block_timeout: float | None) -> steps.Steps[int | str]:
    """Enqueue a drafted job after the jobs of `depends_on` (Job objects or ids), with its
    callbacks, in one enqueue.lua call (TaskRunner.enqueue says what each means); what the
    script answered for the job (1 created, 0 it existed; a unique job's duplicate: the id of
    the job that holds its key). A job without callbacks waits up
    to `block_timeout` for room in a full bounded queue; one with callbacks does not. The
    before_enqueue hooks of the job and its callbacks run once its parents are found and
    all of them are checked."""
    others: tuple[str, ...] = ()
    if depends_on is not None:
        parents = yield from steps.parents(app, depends_on)
        draft.fields += ["parents", " ".join(f"{q} {i}" for q, i in parents)]
        others = tuple(sorted({q for q, _ in parents} - {draft.queue}))
    drafts = steps.hooked(app, [draft, *(yield from callbacks(app, draft, on_success, on_failure))])
    if on_success is None and on_failure is None and not (others and (yield steps.Clustered())):
        return (yield from steps.enqueue(app, draft, block_timeout, others))
    return (yield from written(app, drafts, "job", others))[0]


def callbacks(app: TaskRunner, draft: steps.Draft, on_success: Signature | None,
              on_failure: Signature | None) -> steps.Steps[list[steps.Draft]]:
    """The drafts of a job's callbacks, each waiting for it: on_success given its result,
    on_failure how it failed (unless immutable); their hooks not run yet (steps.hooked, with
    the job's)."""
    out = []
    # (callback, how it waits for the job, what it takes unless immutable)
    for sig, edge, takes in ((on_success, (), ("takes", "result")),
                             (on_failure, ("on_parent_failure", "only"), ("takes", "error"))):
        if sig is None:
            continue
        if not isinstance(sig, Signature):
            raise TypeError(f"a callback is a signature (task.s(...)), not {type(sig).__name__}")
        [callback] = yield from make_drafts(app, [sig], 0, hooks=False)
        callback.fields += ["parents", f"{draft.queue} {draft.id}", *edge, *(() if sig.immutable else takes)]
        out.append(callback)
    return out


def check_callbacks(app: TaskRunner, on_success: Signature | None, on_failure: Signature | None) -> None:
    """Eager mode: the callbacks' arguments checked before the job runs, as callbacks()
    checks them where they are enqueued beside it: a call refused with Redis is refused in
    eager mode too, and before the job ran, not after."""
    for sig in (on_success, on_failure):
        if isinstance(sig, Signature):
            name = sig.task.name
            arguments.check(name, app._shape_of(name), list(sig.args), sig.kwargs, not sig.immutable)


def eager_callbacks(app: TaskRunner, job: Job, on_success: Signature | None, on_failure: Signature | None) -> Job:
    """Eager mode: run the callback that applies, after the job ran."""
    completed = job.data.get("state") == "completed"
    sig = on_success if completed else on_failure
    if sig is not None:
        arg = job.result if completed else {k: job.data.get(k) for k in ("id", "task", "state", "error_type", "error")}
        (sig if sig.immutable else Signature(sig.task, (arg, *sig.args), sig.kwargs, sig.options)).apply_async()
    return job


def written(app: TaskRunner, drafts: list[steps.Draft], what: str,
            also: tuple[str, ...] = ()) -> steps.Steps[list[int]]:
    """Enqueue the drafts in one call (the first one's queue; `also`: other queues their
    parents are in); the script's answers. Nothing is written when a queue refuses one
    (QueueClosed, QueueFull of the first queue). On a Redis Cluster, drafts over several
    queues in several calls (across())."""
    first = drafts[0].queue
    others = tuple(sorted(({d.queue for d in drafts} | set(also)) - {first}))
    jobs = [(d.id, d.delay, d.fields) for d in drafts]
    if others and (yield steps.Clustered()):
        return (yield from across(app, jobs, first))
    answers = yield steps.Enqueue(first, jobs, others)
    if -2 in answers:
        raise QueueClosed(f"queue {drafts[answers.index(-2)].queue} is closed: the {what} was not enqueued")
    if -1 in answers:
        raise QueueFull(f"queue {first} is full (its bound is reached): the {what} was not enqueued")
    return answers


def _write(app: TaskRunner, drafts: list[steps.Draft], what: str) -> steps.Steps[list[Job]]:
    """Enqueue the drafts in one call (written); their Jobs."""
    jobs = []
    for d, answer in zip(drafts, (yield from written(app, drafts, what))):
        job = Job(app, d.id, d.queue)
        job.created = answer == 1
        jobs.append(job)
    return jobs


def across(app: TaskRunner, jobs: list[tuple[str, float, list[Any]]], queue: str) -> steps.Steps[list[int]]:
    """Enqueue a workflow's jobs ((id, delay, fields) each; their queue in their fields, else
    `queue`) that are in several slots of a Redis Cluster, as enqueue.lua answers one call
    for them all (docs/PROTOCOL.md, Workflows: *Across slots*). Parents go before their
    children, so that a producer that dies midway never leaves a child waiting for a parent
    that does not know it: an edge between queues is a cross-slot one, the parent written
    with `cross_children` naming the child and the child with `cross_slot` 1, and an existing
    parent of another slot (depends_on) learns of its child by attach.lua first. The jobs go
    in levels, a level's jobs of one queue in one enqueue.lua call: a job's level is one more
    than that of its parents in other queues and as high as that of those in its own, then
    as late as its children allow (_as_late_as_may_be), so a chain over 3 queues is 3
    calls. The jobs are in an order where each one's parents among them come before it (a
    chain's, a chord's, a job's and its callbacks'). Each call is a request of its own (a
    producer's riding() sends it again through an outage, up to the bound: the calls before
    it are not sent again). A call that fails for good — a refusal (QueueClosed, QueueFull),
    a Redis error past the bound or one no wait ends — stops there, and the jobs of the
    workflow this call wrote before it are killed (a worker may have begun one: the kill stops
    it; one that ended stays as it ended); its error says so, or, when the kill failed too,
    names them. Jobs whose id existed already (answered 0) are named, not killed (_withdrawn).
    An operation (steps.py) of written()'s, on a cluster."""
    drafts = []
    for job_id, delay, fields in jobs:
        named = dict(zip(fields[0::2], fields[1::2]))
        # A copy: the fields added below must not reach the caller's, which may send the same
        # jobs again (a workflow given again, its ids the same).
        drafts.append(steps.Draft(job_id, str(named.get("queue", queue)), delay, list(fields)))
    mine = {(d.queue, d.id) for d in drafts}
    level: dict[tuple[str, str], int] = {}
    cross: dict[tuple[str, str], list[str]] = {}  # parent -> its children in other queues, "<queue> <id> <takes>"
    attach: dict[tuple[str, str, str, str], list[str]] = {}  # (parent queue, child queue, id, takes) -> parents
    children: dict[tuple[str, str], list[tuple[str, str]]] = {}  # parent -> its children among these
    for d in drafts:
        named = dict(zip(d.fields[0::2], d.fields[1::2]))
        words = str(named.get("parents", "")).split()
        lv, far = 0, False
        for q, pid in zip(words[0::2], words[1::2]):
            if (q, pid) in mine:
                children.setdefault((q, pid), []).append((d.queue, d.id))
            if q == d.queue:
                lv = max(lv, level.get((q, pid), 0))
                continue
            far, takes = True, str(named.get("takes", "-"))
            if (q, pid) in mine:
                lv = max(lv, level[(q, pid)] + 1)
                cross.setdefault((q, pid), []).append(f"{d.queue} {d.id} {takes}")
            else:
                attach.setdefault((q, d.queue, d.id, takes), []).append(pid)
        level[(d.queue, d.id)] = lv
        if far:
            d.fields += ["cross_slot", "1"]
    _as_late_as_may_be(drafts, level, children)
    for d in drafts:
        if (d.queue, d.id) in cross:
            d.fields += ["cross_children", " ".join(cross[(d.queue, d.id)])]
    news: list[joins.Entry] = []  # what attach.lua left for children of parents that completed
    for (pq, cq, cid, takes), pids in attach.items():
        answer = yield steps.Script(scripts.ATTACH, [app.keys.q(pq)], [cq, cid, takes, *pids])
        news += joins.split(answer, len(pids))[1]
    calls: dict[tuple[int, str], list[steps.Draft]] = {}
    for d in drafts:
        calls.setdefault((level[(d.queue, d.id)], d.queue), []).append(d)
    answers: dict[tuple[str, str], int] = {}
    for (_, q), part in sorted(calls.items(), key=lambda kv: kv[0][0]):
        try:
            got = yield steps.Enqueue(q, [(d.id, d.delay, d.fields) for d in part])
        except Exception as e:  # for good: riding() gave up, or it is not to be ridden out
            said = yield from _withdrawn(app, drafts, answers, e, f"could not be written to queue {q}")
            raise said from (None if said is e else e)
        answers.update(((d.queue, d.id), a) for d, a in zip(part, got))
        if min(got) < 0:
            refusal = QueueClosed(f"queue {q} is closed: the workflow was not enqueued") if -2 in got else \
                QueueFull(f"queue {q} is full (its bound is reached): the workflow was not enqueued")
            raise (yield from _withdrawn(app, drafts, answers, refusal, f"was refused by queue {q}"))
    if news:
        yield from steps.carry(app, news)
    return [answers[(d.queue, d.id)] for d in drafts]


def _withdrawn(app: TaskRunner, drafts: list[steps.Draft], answers: dict[tuple[str, str], int],
               error: BaseException, why: str) -> steps.Steps[BaseException]:
    """`error`, which stopped across() midway, once the jobs of the workflow this call wrote
    before it (`answers` 1) are killed, saying so, with those the kill stopped (killed, or
    running: told to stop) as its `withdrawn` ((queue, id) each; enqueue_many reads it, and
    `kept`: the jobs of the workflow there still, not withdrawn); or, the kill failing too,
    naming them for the caller to kill. Those answered 0 are named, not
    killed: the id existed before the call answered — a try of this call whose answer was
    lost, or a job enqueued before (the same workflow submitted again with its ids, or
    another's ids), which is not this call's to kill (nor its children to cancel)."""
    written = [(d.queue, d.id) for d in drafts if answers.get((d.queue, d.id)) == 1]
    existed = [(d.queue, d.id) for d in drafts if answers.get((d.queue, d.id)) == 0]
    said: list[str] = []
    withdrawn: list[tuple[str, str]] = []
    if written:
        try:
            states = yield from steps.kills(app, written, f"taskrunner: its workflow {why}")
            withdrawn = [j for j, state in zip(written, states) if state in ("killed", "running")]
            said.append(f"the jobs of it written before were killed: {len(written)}; to enqueue it again, "
                        "give them new ids (a killed job's id exists: given again, it adds nothing)")
        except Exception as e:
            said.append(f"the jobs of it written before could not be killed ({type(e).__name__}: {e}) and may run: "
                        f"{_named(written)}; kill them (taskrunner kill ID)")
    if existed:
        said.append("already existed (this call's earlier try whose answer was lost, or enqueued before): "
                    f"not killed: {_named(existed)}")
    stopped = restated(error, f"{error} ({'; '.join(said)})") if said else error
    stopped.withdrawn = withdrawn  # type: ignore[attr-defined]
    stopped.kept = [j for j in written + existed if j not in withdrawn]  # type: ignore[attr-defined]
    return stopped


def _named(jobs: list[tuple[str, str]]) -> str:
    return ", ".join(f"{q} {i}" for q, i in jobs)


def _as_late_as_may_be(drafts: list[steps.Draft], level: dict[tuple[str, str], int],
                       children: dict[tuple[str, str], list[tuple[str, str]]]) -> None:
    """Move each job to the latest level its children allow (as late as its own queue's
    children, one before its children's in other queues; a job without children among
    these keeps its level): a parent in its child's queue is then written in the child's
    call, not a call before it, where a worker could run it and see it fail before the child
    exists (enqueue.lua refuses a child whose parent failed, unless it goes on after a
    failure). `drafts` are in an order where parents come first; `children`: each one's
    children among them."""
    for d in reversed(drafts):
        me = (d.queue, d.id)
        if me in children:
            level[me] = min(level[c] - (c[0] != d.queue) for c in children[me])


def chain(*parts: Signature | Chain) -> Chain:
    """`chain(add.s(1, 2), mul.s(10))`, the same as `add.s(1, 2) | mul.s(10)`."""
    return Chain(*parts)


def group(*parts: Signature | Iterable[Signature]) -> Group:
    """`group(add.s(i, i) for i in range(10))` or `group(add.s(1, 1), add.s(2, 2))`."""
    return Group(*parts)


def chord(header: Group | Iterable[Signature], body: Signature, on_member_failure: str = "cancel") -> Chord:
    """`chord(group(add.s(i, i) for i in range(10)), tsum.s())`: tsum gets [0, 2, ..., 18]."""
    return Chord(header, body, on_member_failure)
