"""Middleware (Dramatiq's model): objects an app registers with `app.add_middleware(obj)`,
each defining any of the hooks below, called in registration order. This module keeps the
registry and calls the hooks safely; where each hook is called from is listed with it.

- `before_enqueue(job)`: in the producer (`delay`, `apply_async`, `enqueue`,
  `enqueue_many`, the asyncio client, the dispatcher's cron ticks), once the job is checked
  (its arguments against the task's parameters, as JSON, their size: a job refused for them
  runs no hook, as Celery checks arguments before its publish signals) and before anything
  is written; a workflow's (a chain, group or chord, a job with its callbacks or
  `depends_on`) once every job of it is checked and its parents found, so that one refused
  for any job runs none. What only Redis refuses (a full or closed queue) comes after it.
  `job` is an `Enqueued` (task, args, kwargs, queue, headers, id); a hook may change
  `job.headers` (add, modify, or replace the dict), which travel with the job and are then
  checked (JSON, and counted in the payload's size). One that raises refuses the enqueue:
  its exception reaches the caller, nothing is written.
- `child_start()`, `child_stop()`: in each worker child, after the fork before its first
  job (reset database pools, reconnect clients here), and when it exits gracefully (the
  worker stops, or replaces it: recycling). A child killed with its job, or dying, runs no
  `child_stop`; the worker waits 2 s for a stopping child.
- `before_run(job)`, `after_run(job, outcome)`, `on_retry(job, exc)`,
  `on_failure(job, exc)`: in the child, around each job (eager mode: in the caller);
  `job` is `current_job()`, `outcome` the `Outcome` of the run. `on_retry` when the task
  raised and the job will run again (an exception while retries are left, a `Retry`
  within max_retries), `on_failure` when it raised and will not; both before `after_run`
  (the child reads the job's record to know; with Redis unreachable then, neither runs,
  which is logged). A job stopped by a kill or its max duration runs no hook after
  `before_run` (its process may be killed).

A hook that raises is logged with the job id (and, in a job, into the job's log lines) and
never loses the job nor runs it twice: `before_enqueue` refuses the enqueue (above);
`before_run` fails the delivery as if the task had raised that exception, without running
the task, because a hook that sets up what the task relies on (a tenant from the headers,
a database session) must not let it run without it; the retry policy applies to it as to
any exception, and the after hooks still run, so that middleware whose `before_run` ran
can clean up. A raising `after_run`, `on_retry`, `on_failure`, `child_start` or
`child_stop` is logged and ignored: the job's outcome stands."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from taskrunner.logs import job_fields

if TYPE_CHECKING:
    from taskrunner.protocol.outcome import Outcome
    from taskrunner.worker.context import JobContext

log = logging.getLogger("taskrunner")

HOOKS = ("before_enqueue", "child_start", "child_stop", "before_run", "after_run", "on_retry", "on_failure")


@dataclass
class Enqueued:
    """A job about to be enqueued, as before_enqueue hooks see it: only `headers` is read
    back (the other fields say what is enqueued)."""

    task: str
    args: list
    kwargs: dict
    queue: str
    id: str
    headers: dict[str, Any] = field(default_factory=dict)

    @property
    def attempt(self) -> int:
        """0: not delivered yet (as the record's `attempts` at enqueue), in its log fields."""
        return 0


class Middleware:
    """An app's registered middleware, with each hook's bound methods listed once (a job
    with no middleware registered costs one empty loop per hook)."""

    def __init__(self) -> None:
        self.hooks: dict[str, list[Callable[..., Any]]] = {name: [] for name in HOOKS}

    def add(self, obj: Any) -> None:
        """Register `obj`; it must define at least one hook (a typo in every name would
        otherwise be silently ignored)."""
        found = [name for name in HOOKS if callable(getattr(obj, name, None))]
        if not found:
            raise TypeError(f"{obj!r} defines none of the middleware hooks {', '.join(HOOKS)}")
        for name in found:
            self.hooks[name].append(getattr(obj, name))

    def before_enqueue(self, job: Enqueued) -> dict[str, Any]:
        """The headers the job is enqueued with, after every hook; a hook's exception is
        logged and raised (the enqueue is refused)."""
        self._all_or_raise("before_enqueue", job, "not enqueued")
        if not isinstance(job.headers, dict):
            raise TypeError(f"headers must be a dict, not {type(job.headers).__name__} (job {job.id})")
        return job.headers

    def child_start(self) -> None:
        self._each("child_start", None)

    def child_stop(self) -> None:
        self._each("child_stop", None)

    def before_run(self, job: JobContext) -> None:
        """Every before_run hook, until one raises: that exception is logged and raised, to
        fail the delivery as the task's own would (the task does not run)."""
        self._all_or_raise("before_run", job, "the task does not run")

    def after_run(self, job: JobContext, outcome: Outcome, error: BaseException | None) -> Outcome:
        """The hooks after a run: on_retry or on_failure when the task raised `error`, then
        after_run; returns `outcome` (it stands, whatever they do)."""
        if error is not None and (self.hooks["on_retry"] or self.hooks["on_failure"]):  # else no record read
            try:
                retry = job.will_retry(outcome)
            except Exception:  # Redis unreachable: which is unknown, and the outcome must still go
                log.exception("middleware: could not read job %s's record to tell on_retry from on_failure; "
                              "neither runs", job.id, extra=job_fields(job))
            else:
                self._each("on_retry" if retry else "on_failure", job, error)
        self._each("after_run", job, outcome)
        return outcome

    def _all_or_raise(self, name: str, job: Enqueued | JobContext, then: str) -> None:
        """Call the hooks `name` with `job` until one raises: log that (saying `then`) and raise."""
        for hook in self.hooks[name]:
            try:
                hook(job)
            except Exception:
                log.exception("middleware %s raised for job %s; %s", _name(hook), job.id, then,
                              extra=job_fields(job))
                raise

    def _each(self, name: str, job: JobContext | None, *args: Any) -> None:
        for hook in self.hooks[name]:
            try:
                hook(*args) if job is None else hook(job, *args)
            except Exception:
                if job is None:
                    log.exception("middleware %s raised; ignored", _name(hook))
                else:
                    log.exception("middleware %s raised for job %s; ignored", _name(hook), job.id,
                                  extra=job_fields(job))


def _name(hook: Callable[..., Any]) -> str:
    """Class.method of a bound hook, for the log."""
    owner = getattr(hook, "__self__", None)
    return f"{type(owner).__name__}.{hook.__name__}" if owner is not None else getattr(hook, "__qualname__", "?")
