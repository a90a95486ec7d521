"""Every setting and its default, in one place. Each is read from the environment
(12-factor) and can be overridden by keyword or CLI flag."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, fields, replace
from typing import Any


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
        # finish.lua refuses these (a record kept 0 s is gone as it finishes): say so at start,
        # not at every finish of every job
        for name in ("result_ttl", "failed_ttl"):
            if getattr(self, name) < 1:
                raise ValueError(f"TASKRUNNER_{name.upper()}={getattr(self, name)!r} must be at least 1 (seconds)")

    @classmethod
    def from_env(cls, **overrides: Any) -> Settings:
        values: dict[str, Any] = {}
        for f in fields(cls):
            env = "REDIS_URL" if f.name == "redis_url" else "TASKRUNNER_" + f.name.upper()
            raw = os.environ.get(env)
            if raw not in (None, ""):
                kind: Callable[[str], Any] = (_flag if isinstance(f.default, bool) else
                                              str if f.default is None else type(f.default))
                try:
                    values[f.name] = kind(raw)
                except ValueError:
                    what = ("yes/no (1, true, yes, on / 0, false, no, off)" if kind is _flag
                            else getattr(kind, "__name__", "value"))
                    raise ValueError(f"{env}={raw!r} is not a valid {what}") from None
        values.update({k: v for k, v in overrides.items() if v is not None})
        return replace(cls(), **values)


def _flag(raw: str) -> bool:
    """A yes/no setting: bool("0") is True, so the words are read here."""
    word = raw.strip().lower()
    if word not in ("1", "true", "yes", "on", "0", "false", "no", "off"):
        raise ValueError(raw)
    return word in ("1", "true", "yes", "on")
