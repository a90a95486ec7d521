"""Every setting and its default, in one place. Each is read from the environment
(12-factor) and can be overridden by keyword or CLI flag."""

from __future__ import annotations

import math
import os
import re
from collections.abc import Callable
from dataclasses import dataclass, fields, replace
from typing import Any

from taskrunner.protocol.codec import SECONDS_MAX as _SECONDS_MAX


@dataclass(frozen=True)
class Settings:
    #: Redis to use (redis://, rediss://, unix://, redis+sentinel://). None: `taskrunner up` starts its own.
    redis_url: str | None = None  # REDIS_URL
    #: First part of every key; lets several apps share one Redis.
    prefix: str = "tr"  # TASKRUNNER_PREFIX
    #: Seconds between worker heartbeats.
    heartbeat: float = 2.0  # TASKRUNNER_HEARTBEAT
    #: A worker silent this long is dead: its jobs are requeued.
    dead_after: float = 10.0  # TASKRUNNER_DEAD_AFTER
    #: Seconds a completed job (its record and result) is kept and listed.
    result_ttl: int = 86400  # TASKRUNNER_RESULT_TTL
    #: Seconds a job that failed for good or was killed is kept, listed (`taskrunner
    #: failed`, the dashboard) and retryable: the dead letters, kept longer than results
    #: so that a failure over a weekend is still there on Monday.
    failed_ttl: int = 7 * 86400  # TASKRUNNER_FAILED_TTL
    #: Max duration of a job whose task sets none.
    max_duration: float = 300.0  # TASKRUNNER_MAX_DURATION
    #: Seconds between SIGTERM and SIGKILL when a job is killed or timed out.
    kill_grace: float = 5.0  # TASKRUNNER_KILL_GRACE
    #: On SIGTERM, seconds a worker lets running jobs finish before requeueing them
    #: (Heroku sends SIGKILL 30 s after SIGTERM).
    shutdown_grace: float = 20.0  # TASKRUNNER_SHUTDOWN_GRACE
    #: Seconds between dispatcher passes.
    dispatch_interval: float = 0.5  # TASKRUNNER_DISPATCH_INTERVAL
    #: Width of a deadline bucket, seconds.
    bucket_width: int = 1  # TASKRUNNER_BUCKET_WIDTH
    #: Seconds between the dispatcher's checks of a stuck job.
    stuck_recheck: float = 10.0  # TASKRUNNER_STUCK_RECHECK
    #: Largest encoded args + kwargs of one job, bytes.
    max_payload: int = 1 << 20  # TASKRUNNER_MAX_PAYLOAD
    #: A job whose process died this many times ends failed with WorkerLost.
    max_lost: int = 5  # TASKRUNNER_MAX_LOST
    #: Cap of the exponential retry backoff, seconds.
    retry_backoff_max: float = 600.0  # TASKRUNNER_RETRY_BACKOFF_MAX
    #: Seconds an enqueue waits for room in a full bounded queue before QueueFull.
    block_timeout: float = 10.0  # TASKRUNNER_BLOCK_TIMEOUT
    #: Seconds a producer's enqueue (a job, a batch, a workflow) keeps trying while Redis
    #: is unreachable or failing over (connection errors, READONLY, CLUSTERDOWN...), from
    #: the first error of each outage, before it raises it; 0: it raises at once. Safe,
    #: as job ids are made before the first try and an id that exists is not added twice.
    enqueue_retry: float = 15.0  # TASKRUNNER_ENQUEUE_RETRY
    #: Seconds between the dispatcher's archiving of job history to Parquet (0: it does not
    #: archive; `taskrunner history archive` does it by hand). Where: TASKRUNNER_HISTORY_DIR.
    history_interval: float = 5.0  # TASKRUNNER_HISTORY_INTERVAL
    #: Cron schedule (UTC) of `taskrunner analyze` as a taskrunner job of every app, e.g.
    #: "0 * * * *"; empty: not scheduled. Its workers need PySpark and Java.
    analyze_cron: str = ""  # TASKRUNNER_ANALYZE_CRON
    #: Most jobs a worker sends ahead to one child process, so that short jobs run back to
    #: back; fewer when jobs are long (100 ms of work ahead), 1 turns it off. Jobs held back
    #: by a job running over 1 s go back to the queue.
    prefetch: int = 128  # TASKRUNNER_PREFETCH
    #: Seconds an idle worker blocks in Redis before it looks again anyway.
    idle_block: float = 5.0  # TASKRUNNER_IDLE_BLOCK
    #: Seconds a lone enqueue polls for Redis's answer before it sleeps on the socket, when
    #: Redis is on this machine (unix socket, loopback): waking a sleeping process can take
    #: longer than Redis's work, on VMs most. Costs up to this much CPU per enqueue; 0 turns
    #: it off. Never with a remote Redis or a single CPU.
    enqueue_spin: float = 0.0001  # TASKRUNNER_ENQUEUE_SPIN
    #: For tests of users' own tasks: enqueue runs the task in the calling process, at
    #: once, and never connects to Redis (taskrunner/client/eager.py says what differs).
    eager: bool = False  # TASKRUNNER_EAGER

    def __post_init__(self) -> None:
        """Each setting checked against what the code and the scripts take, at start: a bad
        one is refused here in one line naming its variable, not by every enqueue (in words
        about a job id the user never saw), or by a worker that spins, never runs a job or
        kills them all at once."""
        for name, (check, what) in _RANGES.items():
            value = getattr(self, name)
            if isinstance(self.__dataclass_fields__[name].default, int) and isinstance(value, float) \
                    and value.is_integer():  # a count given as 86400.0 (timedelta(days=1).total_seconds())
                value = int(value)
                object.__setattr__(self, name, value)
            if not check(value):
                raise ValueError(f"{_env(name)}={value!r} must be {what}")
        if self.heartbeat >= self.dead_after:
            raise ValueError(f"TASKRUNNER_HEARTBEAT={self.heartbeat!r} must be less than TASKRUNNER_DEAD_AFTER="
                             f"{self.dead_after!r}: a worker beating that seldom is taken for dead between beats")

    @classmethod
    def from_env(cls, **overrides: Any) -> Settings:
        values: dict[str, Any] = {}
        for f in fields(cls):
            env = _env(f.name)
            raw = os.environ.get(env)
            if raw not in (None, ""):
                kind: Callable[[str], Any] = (_flag if isinstance(f.default, bool) else
                                              str if f.default is None else type(f.default))
                try:
                    values[f.name] = kind(raw)
                except ValueError:
                    what = ("yes/no (1, true, yes, on / 0, false, no, off)" if kind is _flag
                            else "whole number" if kind is int else "number" if kind is float else "value")
                    raise ValueError(f"{env}={raw!r} is not a valid {what}") from None
        values.update({k: v for k, v in overrides.items() if v is not None})
        return replace(cls(), **values)


def _flag(raw: str) -> bool:
    """A yes/no setting: bool("0") is True, so the words are read here."""
    word = raw.strip().lower()
    if word not in ("1", "true", "yes", "on", "0", "false", "no", "off"):
        raise ValueError(raw)
    return word in ("1", "true", "yes", "on")


def _env(name: str) -> str:
    """The environment variable of setting `name`."""
    return "REDIS_URL" if name == "redis_url" else "TASKRUNNER_" + name.upper()


#: Counts the scripts keep (codec.count): larger ones would be stored as text no reader takes.
_COUNT_MAX = 2**31 - 1
#: Seconds a process waits at most: a poll's timeout is milliseconds in a C int
#: (worker/children.py), a thread's wait at most threading.TIMEOUT_MAX (a dispatcher with
#: TASKRUNNER_DISPATCH_INTERVAL=1e12 died of OverflowError). About 24 days.
_WAIT_MAX = _COUNT_MAX // 1000
#: No glob characters: deleting a queue SCANs "<prefix>:{<queue>}:*", which would match other
#: apps' keys. Any other character as before (an existing deployment's "/", a space, braces:
#: on a Redis Cluster those make every key's hash tag the prefix's, one slot for all).
_PREFIX = re.compile(r"[^*?\[\]\\]{1,200}\Z")


def _seconds(least: float, most: float = _SECONDS_MAX, above: bool = False) -> Callable[[Any], bool]:
    """A duration from `least` (or above it) to below `most`: a finite number, not a bool."""
    def ok(value: Any) -> bool:
        return (isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
                and (value > least if above else value >= least) and value < most)
    return ok


def _count(value: Any) -> bool:
    """A whole number from 1 to _COUNT_MAX, an int as the field says (and codec.count takes a
    task's result_ttl, max_lost, ...): not a float, even 3600.0."""
    return isinstance(value, int) and not isinstance(value, bool) and 1 <= value <= _COUNT_MAX


_POSITIVE = f"a finite number of seconds > 0 and < {_WAIT_MAX}"
_ANY = f"a finite number of seconds >= 0 and < {_WAIT_MAX}"
_WHOLE = f"a whole number from 1 to {_COUNT_MAX}"
#: Setting -> (its check, what it must be). A duration a process waits on stays below
#: _WAIT_MAX; one the scripts keep below 2^53.
_RANGES: dict[str, tuple[Callable[[Any], bool], str]] = {
    "redis_url": (lambda v: v is None or isinstance(v, str), "a URL"),
    "prefix": (lambda v: isinstance(v, str) and _PREFIX.match(v) is not None,
               "1 to 200 characters, none of *?[]\\ (deleting a queue scans keys by a pattern that starts "
               "with it: it would match other apps' keys)"),
    "heartbeat": (_seconds(0, _WAIT_MAX, above=True), _POSITIVE),
    "dead_after": (_seconds(0, _WAIT_MAX, above=True), _POSITIVE),
    "result_ttl": (_count, _WHOLE + " (seconds)"),
    "failed_ttl": (_count, _WHOLE + " (seconds)"),
    # claim.lua takes it written as a plain decimal ("300", "0.5"): a float below 1e-4 is
    # written "1e-05"
    "max_duration": (_seconds(0.0001), "a finite number of seconds from 0.0001 to below 2^53"),
    "kill_grace": (_seconds(0, _WAIT_MAX), _ANY),
    "shutdown_grace": (_seconds(0, _WAIT_MAX), _ANY),
    "dispatch_interval": (_seconds(0, _WAIT_MAX, above=True), _POSITIVE),
    "bucket_width": (_count, _WHOLE + " (seconds)"),
    "stuck_recheck": (_seconds(0, above=True), "a finite number of seconds > 0 and < 2^53"),
    "max_payload": (_count, _WHOLE + " (bytes)"),
    "max_lost": (_count, _WHOLE),
    "retry_backoff_max": (_seconds(0), "a finite number of seconds >= 0 and < 2^53"),
    "block_timeout": (_seconds(0), "a finite number of seconds >= 0 and < 2^53"),
    "enqueue_retry": (_seconds(0, _WAIT_MAX), _ANY),
    "history_interval": (_seconds(0, _WAIT_MAX), _ANY),
    "analyze_cron": (lambda v: isinstance(v, str), "a cron schedule or empty"),
    "prefetch": (_count, _WHOLE),
    "idle_block": (_seconds(0, _WAIT_MAX, above=True), _POSITIVE),
    "enqueue_spin": (_seconds(0, _WAIT_MAX), _ANY),
    "eager": (lambda v: isinstance(v, bool), "yes or no"),
}
