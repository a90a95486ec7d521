"""current_job(): what a running task may know about the delivery it runs in (its id,
attempt, queue and deadline), without taking it as an argument. A context variable, so it
is right in threads and coroutines as well as in a plain child process."""

from __future__ import annotations

from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

from .errors import TaskRunnerError


@dataclass(frozen=True)
class JobContext:
    """The delivery a task runs in. `attempt` counts deliveries (1 the first; the fencing
    token of its finish); `deadline` is when its max duration ends (epoch seconds)."""

    id: str
    task: str
    queue: str
    attempt: int
    deadline: float
    headers: dict[str, Any] = field(default_factory=dict)


_current: ContextVar[JobContext | None] = ContextVar("taskrunner_job", default=None)


def current_job() -> JobContext:
    """The job the calling task runs in; TaskRunnerError outside a task."""
    job = _current.get()
    if job is None:
        raise TaskRunnerError("current_job() is only available inside a task that a worker runs")
    return job
