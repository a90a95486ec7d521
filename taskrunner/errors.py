"""Exceptions users see, each with a message that says what to do."""

from __future__ import annotations

import importlib.util

import click


class TaskRunnerError(Exception):
    """Base of every taskrunner error."""


def restated(e: BaseException, message: str) -> BaseException:
    """`e` said with `message` (what the caller must know besides: what was enqueued): one of
    the same type, or `e` itself for a type whose constructor takes other arguments than a
    message (a hook's own exception, redis-py's MovedError)."""
    try:
        return type(e)(message)
    except Exception:
        return e


class Misconfigured(click.ClickException):
    """A command-line error in what the command was given (a Redis URL, an app, a taken
    port): exit 2, as click's own usage errors."""

    exit_code = 2


class Unreachable(click.ClickException):
    """Redis could not be reached (down, restarting, failing over): exit 3, so that a
    script can tell "try again later" (what the command did is unknown) from a refusal (1)
    or a mistake in what it was given (2)."""

    exit_code = 3


class NotJSONError(TaskRunnerError, TypeError):
    """Arguments or a result that JSON cannot carry (taskrunner never pickles)."""


class BadArguments(TaskRunnerError, TypeError):
    """A job's arguments that do not fit its task's signature (missing, extra or unknown
    ones), refused where it is enqueued: a worker would fail it with BadArguments."""


class PayloadTooLarge(TaskRunnerError, ValueError):
    """Encoded arguments larger than the `max_payload` setting."""


class InvalidName(TaskRunnerError, ValueError):
    """A queue, task or job id that cannot be used as one."""


class NameInUse(TaskRunnerError):
    """A worker name that a live worker has (heartbeat younger than dead_after)."""


class BadURL(TaskRunnerError, ValueError):
    """A Redis URL that cannot be read: a wrong scheme, host, port, database or option."""


class AppNotFound(TaskRunnerError):
    """-A / TASKRUNNER_APP names no module, or no single TaskRunner in it."""


class JobNotFound(TaskRunnerError, LookupError):
    """No job with that id (never enqueued, or expired after its result TTL)."""


class JobFailed(TaskRunnerError):
    """Raised by Job.wait() when the job failed or was killed; carries its error."""

    def __init__(self, job_id: str, state: str, error_type: str, message: str, traceback: str = ""):
        super().__init__(f"job {job_id} {state}: {error_type}: {message}")
        self.job_id, self.state = job_id, state
        self.error_type, self.message, self.traceback = error_type, message, traceback


class Timeout(TaskRunnerError, TimeoutError):
    """Job.wait() gave up before the job ended."""


class MissingExtra(TaskRunnerError, ImportError):
    """A part that `pip install taskrunner` leaves out (the core is the client, worker,
    dispatcher and CLI) was used: says which extra brings it."""

    def __init__(self, what: str, extra: str):
        super().__init__(f"{what} needs the {extra!r} extra: pip install 'taskrunner[{extra}]'")
        self.extra = extra


def require_extra(extra: str, what: str, *modules: str) -> None:
    """Raise MissingExtra unless every module of `extra` can be imported (checked before
    importing, so that a user sees the extra to install, not a bare ModuleNotFoundError)."""
    if any(importlib.util.find_spec(m) is None for m in modules):
        raise MissingExtra(what, extra)


#: How many times a job may raise Retry before it fails with MaxRetriesExceeded, unless
#: its task says otherwise (max_retries; Celery's default too). finish.lua applies the
#: same default to a record without max_retries.
MAX_RETRIES = 3


class Retry(Exception):
    """Raise inside a task to run it again after `delay` seconds. No failure is counted
    (the task's `retries` are for exceptions), but the requests are: the job fails with
    MaxRetriesExceeded when it asks more than its task's max_retries times."""

    def __init__(self, delay: float = 0.0):
        super().__init__(f"retry in {delay}s")
        self.delay = float(delay)


class Reject(Exception):
    """Raise inside a task to fail the job now, without retries."""


class SoftTimeLimit(Exception):
    """Raised inside a task when its soft_limit passes, so that it can clean up before the
    hard kill at its max duration; unhandled, it fails the job (retried as any exception,
    per retry_on). An Exception, so `except Exception` in a task catches it too."""

    def __init__(self, message: str = "the task ran past its soft time limit") -> None:
        super().__init__(message)


class QueueFull(TaskRunnerError):
    """The queue's bound is reached and no room came within the block timeout."""


class QueueClosed(TaskRunnerError):
    """The queue was closed: it takes no new jobs (queued ones still run)."""


class QueueNotFound(TaskRunnerError, LookupError):
    """No queue of that name."""
