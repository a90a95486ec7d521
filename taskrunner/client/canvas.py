"""Workflows: signatures and chains (docs/PROTOCOL.md, Workflows).

A chain is written by one enqueue.lua call: every step's record and the edges between them.
The first step is pending; each other step waits (state `waiting`) for its parent, and the
finish script that ends the parent makes it pending in the same call, its parent's result
first in its args (unless the step is immutable, `.si`). A step that fails for good ends the
steps after it `canceled`, in that same call. So a chain survives any kill with each step
made pending exactly once, with no process of its own to join the steps.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from taskrunner.client import eager, steps
from taskrunner.client.job import Job
from taskrunner.errors import QueueClosed, QueueFull

if TYPE_CHECKING:
    from taskrunner.client.app import Task

#: The options a signature may carry: those of Task.apply_async that belong to one job.
OPTIONS = frozenset(("queue", "max_duration", "retries", "max_retries", "job_id", "headers", "delay"))


@dataclass(frozen=True)
class Signature:
    """A task with its arguments and options, to be enqueued later (a step of a chain).
    `immutable`: the step does not receive its parent's result."""

    task: Task
    args: tuple[Any, ...] = ()
    kwargs: dict[str, Any] = field(default_factory=dict)
    options: dict[str, Any] = field(default_factory=dict)
    immutable: bool = False

    def set(self, **options: Any) -> Signature:
        """A copy with these options (queue, max_duration, retries, max_retries, job_id,
        headers, delay) set."""
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
        drafts, immutable = [], []
        for sig in self.steps:
            o = sig.options
            spec = sig.task.job_spec(o.get("queue"), o.get("max_duration"), o.get("retries"), o.get("max_retries"))
            drafts.append(steps.run(app, steps.draft(app, sig.task.name, sig.args, sig.kwargs, spec, {},
                                                     o.get("delay"), o.get("job_id"), o.get("headers"))))
            immutable.append(sig.immutable)
        if app.settings.eager:
            return eager.chain(app, [(d.id, d.fields) for d in drafts], immutable)
        for parent, child, fixed in zip(drafts, drafts[1:], immutable[1:]):
            child.fields += ["parents", f"{parent.queue} {parent.id}", *(() if fixed else ("takes", "result"))]
        first = drafts[0].queue
        others = tuple(sorted({d.queue for d in drafts} - {first}))
        answers = steps.run(app, _enqueue(first, [(d.id, d.delay, d.fields) for d in drafts], others))
        if -2 in answers:
            raise QueueClosed(f"queue {drafts[answers.index(-2)].queue} is closed: the chain was not enqueued")
        if -1 in answers:
            raise QueueFull(f"queue {first} is full (its bound is reached): the chain was not enqueued")
        last = drafts[-1]
        job = Job(app, last.id, last.queue)
        job.created = answers[-1] == 1
        return job


def _enqueue(queue: str, jobs: list[tuple[str, float, list[Any]]], others: tuple[str, ...]) -> steps.Steps[list[int]]:
    return (yield steps.Enqueue(queue, jobs, others))


def chain(*parts: Signature | Chain) -> Chain:
    """`chain(add.s(1, 2), mul.s(10))`, the same as `add.s(1, 2) | mul.s(10)`."""
    return Chain(*parts)
