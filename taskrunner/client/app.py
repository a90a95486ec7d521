"""The application object: task registry, schedules, enqueueing and job lookup."""

from __future__ import annotations

import functools
import logging
import os
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from datetime import datetime
from typing import Any

import redis

from taskrunner.client import arguments, bulk, canvas, declarations, eager, flow, steps
from taskrunner.client.canvas import Signature
from taskrunner.client.job import Job
from taskrunner.client.middleware import Enqueued, Middleware
from taskrunner.config import Settings
from taskrunner.errors import MAX_RETRIES, PayloadTooLarge, TaskRunnerError
from taskrunner.protocol import codec, scripts, shards
from taskrunner.protocol.codec import count, seconds
from taskrunner.protocol.connection import Client, connect, is_cluster
from taskrunner.protocol.keys import Keys
from taskrunner.protocol.links import Direct
from taskrunner.protocol.outages import Outage

TIMEOUT_POLICIES = ("kill", "flag")
log = logging.getLogger("taskrunner")


@dataclass(frozen=True)
class JobSpec:
    """What a job needs besides its arguments; task defaults, overridable per call."""

    queue: str = "default"
    max_duration: float | None = None
    retries: int = 0
    retry_backoff: float = 1.0
    timeout_policy: str = "kill"
    max_lost: int | None = None
    max_retries: int = MAX_RETRIES
    #: None: the consumer's settings (retry_backoff_max, result_ttl, failed_ttl).
    retry_backoff_max: float | None = None
    result_ttl: int | None = None
    failed_ttl: int | None = None
    soft_limit: float | None = None
    #: Flow control (docs/PROTOCOL.md): the task's rate limit ("20/s"), the most of its jobs
    #: running at once per concurrency key, and this job's key (None: the task's name).
    rate_limit: str | None = None
    max_concurrency: int | None = None
    concurrency_key: str | None = None

    def __post_init__(self) -> None:
        """Each value checked: one of the wrong type or range is refused here, by name,
        rather than stored for a worker to trip on."""
        codec.check_queue(self.queue)
        if self.timeout_policy not in TIMEOUT_POLICIES:
            raise ValueError(f"timeout_policy must be one of {TIMEOUT_POLICIES}, not {self.timeout_policy!r}")
        if self.max_duration is not None:
            seconds("max_duration", self.max_duration, positive=True)
        seconds("retry_backoff", self.retry_backoff)
        count("retries", self.retries)
        if self.max_lost is not None:
            count("max_lost", self.max_lost, minimum=1)
        count("max_retries", self.max_retries)
        if self.retry_backoff_max is not None:
            seconds("retry_backoff_max", self.retry_backoff_max)
        for name in ("result_ttl", "failed_ttl"):
            if getattr(self, name) is not None:
                count(name, getattr(self, name), minimum=1)
        if self.soft_limit is not None:
            seconds("soft_limit", self.soft_limit, positive=True)
            if self.max_duration is not None and self.soft_limit >= self.max_duration:
                raise ValueError(f"soft_limit ({self.soft_limit:g}s) must be less than max_duration "
                                 f"({self.max_duration:g}s): the hard kill comes at max_duration")
        if self.rate_limit is not None:
            codec.rate("rate_limit", self.rate_limit)
        if self.max_concurrency is not None:
            count("max_concurrency", self.max_concurrency, minimum=1)
        if self.concurrency_key is not None:
            codec.check_name("concurrency key", self.concurrency_key)

    def merged(self, **changes: Any) -> JobSpec:
        """This spec with the changes that are not None."""
        values = {k: v for k, v in changes.items() if v is not None}
        return replace(self, **values) if values else self


#: Fields of a job that a producer may leave to the task's declaration (enqueue.lua).
DECLARED = ("max_duration", "retries", "retry_backoff", "timeout_policy", "max_lost", "max_retries",
            "retry_backoff_max", "result_ttl", "failed_ttl", "soft_limit", "rate_limit", "max_concurrency")
#: Those a producer that knows the task sends only when they differ from the default
#: (a record without them gets the default): most jobs then cost what they did before.
OPTIONAL = (("max_retries", MAX_RETRIES), ("retry_backoff_max", None), ("result_ttl", None), ("failed_ttl", None),
            ("rate_limit", None), ("max_concurrency", None), ("concurrency_key", None))


def _enqueue_args(jobs: list[tuple[str, float, list[Any]]], limit: int | None = None) -> list[Any]:
    """ARGV of enqueue.lua: N, then per job id, delay, K and K field/value pairs, then the
    payload limit (bytes; the script's default when None)."""
    args: list[Any] = [len(jobs)]
    for job_id, delay, fields in jobs:
        args += [job_id, delay, len(fields) // 2, *fields]
    return args if limit is None else [*args, limit]


@dataclass
class Schedule:
    """A schedule that enqueues a task at each tick: a cron (in UTC, or in `tz`) or an
    interval (`every` seconds); fired by the dispatcher (taskrunner/ops/schedules.py)."""

    name: str
    cron: str  # "" for an interval
    task: str
    args: list = field(default_factory=list)
    kwargs: dict = field(default_factory=dict)
    queue: str = "default"
    missed: str = "once"  # after downtime: "once" fires the latest missed tick, "skip" none
    every: int | None = None  # seconds, instead of a cron
    tz: str | None = None  # IANA time zone of the cron (None: UTC)
    jitter: float = 0.0  # each tick's job is delayed by up to this many seconds
    overlap: str = "allow"  # "skip": no tick while the previous tick's job has not ended
    expires: float | None = None  # each tick's job expires this many seconds after it is fired
    source: str = "code"  # or "runtime": added with `taskrunner schedule add`


def check_schedule_options(tz: str | None, missed: str, overlap: str, jitter: float,
                           expires: float | None = None) -> None:
    """A schedule's options, checked where it is declared or added (the dispatcher must
    never meet a bad one): tz an IANA name (or None: UTC); `expires` seconds > 0, and more
    than the jitter, which delays a tick's job after it is fired: else a tick's job could
    expire before its delay ends, and never run."""
    if tz is not None:
        from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

        try:
            ZoneInfo(tz)
        except (ZoneInfoNotFoundError, ValueError):
            raise ValueError(f"unknown time zone {tz!r} (an IANA name, e.g. Europe/Berlin or UTC)") from None
    if missed not in ("once", "skip"):
        raise ValueError("missed must be 'once' or 'skip'")
    if overlap not in ("allow", "skip"):
        raise ValueError("overlap must be 'allow' or 'skip'")
    if not 0 <= jitter < 86400:
        raise ValueError("jitter must be seconds >= 0 and < 86400")
    if expires is not None:
        seconds("expires", expires, positive=True)
        if expires <= jitter:
            raise ValueError(f"expires ({expires} s) must be more than the jitter ({jitter} s): a tick's job is "
                             "delayed by up to the jitter after it is fired, and would expire before it could run")


def check_cron(cron: Any) -> str:
    """A cron expression with ticks both ways: croniter accepts e.g. "0 0 31 2 *" (February
    31st) but then finds no tick, which the dispatcher, looking for the last and next
    tick at each pass, must never meet. croniter is imported here, by apps that declare
    schedules: it is 3.6 MB and 0.1 s of every worker's and producer's start otherwise."""
    from croniter import croniter

    if not isinstance(cron, str) or not croniter.is_valid(cron):
        raise ValueError(f"invalid cron expression {cron!r} (expected e.g. '*/5 * * * *')")
    try:
        croniter(cron).get_prev(float)
        croniter(cron).get_next(float)
    except ValueError as e:
        raise ValueError(f"cron expression {cron!r} has no tick: {e}") from None
    return cron


def cron_job_id(schedule: str, tick: float) -> str:
    """The job id of a schedule's tick: the same for every dispatcher that fires it."""
    return f"cron.{schedule}.{int(tick)}"


def _module_name(module: str) -> str:
    """A task's module as a worker's `-A` imports it: a script run as `python shop.py` (or
    `python -m shop`) is `__main__` here, which is no task name, and `shop` there."""
    if module != "__main__":
        return module
    main = sys.modules["__main__"]
    spec = getattr(main, "__spec__", None)
    if spec is not None and spec.name:
        return spec.name
    path = getattr(main, "__file__", None)
    return os.path.splitext(os.path.basename(path))[0] if path else module


def _exception_classes(what: str, value: Any) -> tuple[type[BaseException], ...]:
    """An exception class or a tuple of them, as `except` takes it, checked at declaration
    (a typo would otherwise surface only when a job fails)."""
    classes = value if isinstance(value, tuple) else (value,)
    for c in classes:
        if not (isinstance(c, type) and issubclass(c, BaseException)):
            raise TypeError(f"{what} takes exception classes (one, or a tuple), not {c!r}")
    return classes


class Task:
    """A function that can run as a job. Calling it runs it here and now."""

    def __init__(self, app: TaskRunner, fn: Callable, name: str, spec: JobSpec,
                 retry_on: tuple[type[BaseException], ...] | None = None,
                 no_retry_on: tuple[type[BaseException], ...] = (), ignore_result: bool = False,
                 spark: bool = False, check_args: bool = True):
        # First: it copies fn's __dict__ in, which for a Task wrapped again (app.task(task,
        # name=...)) holds that Task's app, name and settings; ours go over them.
        functools.update_wrapper(self, fn)
        self.app, self.fn, self.name, self.spec = app, fn, name, spec
        self.retry_on, self.no_retry_on = retry_on, no_retry_on
        #: The return value is dropped where the job runs (child.returned): it is neither
        #: encoded (a value that is not JSON does not fail the job) nor sent nor stored.
        self.ignore_result = ignore_result
        #: Its jobs get current_job().spark, the child's SparkSession (worker/spark_session.py).
        #: Worker-side only, as retry_on: not declared in Redis.
        self.spark = spark
        #: Whether producers check a job's arguments against the function's signature.
        self.check_args = check_args
        self._shape: tuple[arguments.Shape | None] | None = None  # read on first use (a 1-tuple: None is a value)

    @property
    def shape(self) -> arguments.Shape | None:
        """The signature a job's arguments must bind to (None: not checked: check_args=False,
        or a callable whose signature Python cannot read); read once, on first use."""
        if self._shape is None:
            self._shape = (arguments.shape_of(self.fn) if self.check_args else None,)
        return self._shape[0]

    def retryable(self, error: BaseException) -> bool:
        """May a job that raised `error` run again (while its retries last)? Not for a
        class of no_retry_on; with retry_on, only for its classes; else for any."""
        if isinstance(error, self.no_retry_on):
            return False
        return self.retry_on is None or isinstance(error, self.retry_on)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.fn(*args, **kwargs)

    def __repr__(self) -> str:
        return f"<Task {self.name} queue={self.spec.queue}>"

    def delay(self, *args: Any, **kwargs: Any) -> Job:
        return self.apply_async(args, kwargs)

    def s(self, *args: Any, **kwargs: Any) -> Signature:
        """A signature of this task: a step of a chain (`add.s(1, 2) | mul.s(10)`), given its
        parent's result as its first argument."""
        return Signature(self, args, kwargs)

    def si(self, *args: Any, **kwargs: Any) -> Signature:
        """An immutable signature: a step that does not receive its parent's result."""
        return Signature(self, args, kwargs, immutable=True)

    def apply_async(self, args: Iterable = (), kwargs: dict | None = None, *, queue: str | None = None,
                    delay: float | None = None, max_duration: float | None = None, job_id: str | None = None,
                    retries: int | None = None, max_retries: int | None = None,
                    block_timeout: float | None = None, headers: dict[str, Any] | None = None,
                    depends_on: Iterable[Job | str] | None = None, on_success: Signature | None = None,
                    on_failure: Signature | None = None, concurrency_key: str | None = None,
                    priority: int | None = None, unique_for: int | None = None, unique_key: str | None = None,
                    unique_until: str | None = None, expires: float | datetime | None = None) -> Job:
        """Enqueue with options; `headers`, a dict of JSON values, travel with the job
        (current_job().headers; counted in its payload size). `depends_on`: jobs (Job
        objects or ids, of any queue) that must complete first; `on_success`, `on_failure`:
        callbacks (TaskRunner.enqueue). `concurrency_key`: for a task with max_concurrency,
        the key whose running jobs it counts against (default: the task's name). `priority`
        (0-9), the unique lock (`unique_for`, `unique_key`, `unique_until`) and `expires`
        (seconds from now, or an aware datetime, by which it must have started):
        TaskRunner.enqueue."""
        spec = self.job_spec(queue, max_duration, retries, max_retries, concurrency_key)
        return self.app.enqueue(self.name, args, kwargs, spec=spec,
                                delay=delay, job_id=job_id, block_timeout=block_timeout, headers=headers,
                                depends_on=depends_on, on_success=on_success, on_failure=on_failure,
                                priority=priority, unique_for=unique_for, unique_key=unique_key,
                                unique_until=unique_until, expires=expires)

    def job_spec(self, queue: str | None = None, max_duration: float | None = None, retries: int | None = None,
                 max_retries: int | None = None, concurrency_key: str | None = None) -> JobSpec:
        """This task's spec with the options of one job (None: the task's)."""
        return self.spec.merged(queue=queue, max_duration=max_duration, retries=retries, max_retries=max_retries,
                                concurrency_key=concurrency_key)


class TaskRunner:
    def __init__(self, name: str = "taskrunner", redis_url: str | None = None, prefix: str | None = None,
                 **settings: Any):
        self.name = name
        self.settings = Settings.from_env(redis_url=redis_url, prefix=prefix, **settings)
        self.keys = Keys(self.settings.prefix)
        self.tasks: dict[str, Task] = {}
        self.schedules: dict[str, Schedule] = {}
        self.middleware = Middleware()
        self._redis: Client | None = None
        self._direct: Direct | None = None  # the lone enqueue's fast path (None: not available)
        self._redis_pid = 0
        self._known_queues: set[str] = set()
        self._declared = declarations.Cache()
        self._spread = shards.Spreader()
        self._producer = f"{socket.gethostname()}:{os.getpid()}"
        if self.settings.analyze_cron:
            self._schedule_analysis(self.settings.analyze_cron)

    def __repr__(self) -> str:
        return f"<TaskRunner {self.name} prefix={self.settings.prefix}>"

    @property
    def redis(self) -> Client:
        """The client, made on first use (and again in a forked child). Bytes that are not
        UTF-8 (never written by taskrunner, whose wire format is JSON text) are read as U+FFFD:
        a record corrupted by another client then fails as bad JSON instead of raising
        UnicodeDecodeError in whichever process reads it."""
        if self._redis is None or self._redis_pid != os.getpid():
            self._redis = connect(self.settings.redis_url, encoding_errors="replace")
            self._direct = Direct.of(self._redis, self.settings.enqueue_spin)
            self._redis_pid = os.getpid()
            self._known_queues = set()
            self._declared = declarations.Cache()
            self._spread = shards.Spreader()
        return self._redis

    def wait_for_redis(self, who: str) -> Client:
        """The client, once it can be made: a Redis Cluster client asks a node for the
        slots layout at once, and a worker or dispatcher started before its Redis (a host
        booting) must wait for it, not exit. Backs off up to 5 s between tries."""
        pause, outage = 0.0, Outage(who)
        while True:
            try:
                client = self.redis
                outage.ok()
                return client
            except (redis.RedisError, redis.exceptions.RedisClusterException) as e:
                pause = min(max(pause * 2, 0.2), 5.0)
                outage.failed(e, pause)
                time.sleep(pause)

    def configure(self, **overrides: Any) -> None:
        """Change settings (e.g. redis_url from a CLI flag) before first use."""
        self.settings = replace(self.settings, **{k: v for k, v in overrides.items() if v is not None})
        self.keys = Keys(self.settings.prefix)
        self._redis = None

    def _schedule_analysis(self, cron: str) -> None:
        """The product runs its own pipeline: `taskrunner analyze` as a periodic job."""
        from taskrunner.ops.analyze import run_as_job

        self.periodic(cron, name="taskrunner.analyze", max_duration=3600)(
            self.task(functools.partial(run_as_job, self), name="taskrunner.analyze"))

    def add_middleware(self, obj: Any) -> None:
        """Register middleware: an object with any of the hooks before_enqueue(job),
        child_start(), child_stop(), before_run(job), after_run(job, outcome),
        on_retry(job, exc), on_failure(job, exc); see taskrunner/middleware.py for where
        each runs and what a raising one does. Register it where the tasks are declared
        (the app module), so that producers and workers alike have it."""
        self.middleware.add(obj)

    # -- declaring -------------------------------------------------------------------

    def task(self, fn: Callable | None = None, *, name: str | None = None, queue: str = "default",
             max_duration: float | None = None, retries: int = 0, retry_backoff: float = 1.0,
             timeout_policy: str = "kill", max_lost: int | None = None, max_retries: int = MAX_RETRIES,
             retry_backoff_max: float | None = None, result_ttl: int | None = None, failed_ttl: int | None = None,
             ignore_result: bool = False, soft_limit: float | None = None,
             rate_limit: str | None = None, max_concurrency: int | None = None, spark: bool = False,
             check_args: bool = True, retry_on: type[BaseException] | tuple[type[BaseException], ...] | None = None,
             no_retry_on: type[BaseException] | tuple[type[BaseException], ...] = ()) -> Any:
        """Declare a task: `@app.task` or `@app.task(queue=..., max_duration=..., retries=...)`.
        The name defaults to module.function. timeout_policy: "kill" ends a job that passes
        its max duration (failed, TimeLimitExceeded); "flag" only flags it stuck. A job that
        raises is retried while `retries` last, unless the exception is of a class in
        `no_retry_on`, or `retry_on` is given and it is of none of its classes: then it
        fails at once (a ValueError from bad input will not pass on a second try).
        A job may `raise Retry(...)` max_retries times; once more fails it with
        MaxRetriesExceeded. retry_backoff_max caps this task's backoff; result_ttl and
        failed_ttl (seconds) keep its completed, and failed or killed, jobs that long,
        instead of the settings of the same names. ignore_result: the return value is
        dropped (the job still ends completed; wait() returns None).
        soft_limit: seconds (< max_duration) after which SoftTimeLimit is raised inside the
        task, so that it can clean up before the hard kill (taskrunner/soft_limit.py).
        rate_limit: "N/s", "N/m" or "N/h": at most that many of its jobs start, across all
        workers (evenly spaced; per queue); max_concurrency: at most that many run at once
        per concurrency key (apply_async(concurrency_key=...), default the task's name).
        Both are enforced by the claim in Redis (docs/PROTOCOL.md, Flow control).
        spark: the task gets `current_job().spark`, a SparkSession its child makes on first
        use and keeps for its next jobs; a kill or its max duration cancels its Spark jobs
        (taskrunner/worker/spark_session.py). Give such tasks a queue of their own, served by
        workers meant for them: each child that runs one starts a JVM.
        check_args: a job's arguments are checked against the function's signature where
        it is enqueued (BadArguments; taskrunner/client/arguments.py); False turns that off,
        as Celery's typing=False, e.g. for a decorator that changes the arguments without
        saying so in a __signature__."""
        for flag, value in (("ignore_result", ignore_result), ("spark", spark), ("check_args", check_args)):
            if not isinstance(value, bool):
                raise ValueError(f"{flag} must be True or False, not {value!r}")
        retry_classes = None if retry_on is None else _exception_classes("retry_on", retry_on)
        no_retry_classes = _exception_classes("no_retry_on", no_retry_on)

        def register(f: Callable) -> Task:
            spec = JobSpec().merged(queue=queue, max_duration=max_duration, retries=retries,
                                    retry_backoff=retry_backoff, timeout_policy=timeout_policy, max_lost=max_lost,
                                    max_retries=max_retries, retry_backoff_max=retry_backoff_max,
                                    result_ttl=result_ttl, failed_ttl=failed_ttl, soft_limit=soft_limit,
                                    rate_limit=rate_limit, max_concurrency=max_concurrency)
            task_name = codec.check_name("task", name or f"{_module_name(f.__module__)}.{f.__qualname__}")
            if task_name in self.tasks and self.tasks[task_name].fn is not f:
                raise TaskRunnerError(f"two tasks named {task_name!r}: pass name= to one of them")
            t = self.tasks[task_name] = Task(self, f, task_name, spec, retry_classes, no_retry_classes,
                                             ignore_result, spark, check_args)
            return t

        return register(fn) if fn is not None else register

    def periodic(self, cron: str, *, name: str | None = None, args: Iterable = (), kwargs: dict | None = None,
                 missed: str = "once", tz: str | None = None, jitter: float = 0.0, overlap: str = "allow",
                 expires: float | None = None, **task_options: Any) -> Callable[[Callable], Task]:
        """Declare a task and run it on a cron schedule, e.g. "*/5 * * * *", in UTC or in
        `tz` (see taskrunner/ops/schedules.py for daylight-saving changes, `jitter`,
        `overlap` and `expires`). Each tick is enqueued exactly once, however many
        dispatchers run."""
        check_cron(cron)
        check_schedule_options(tz, missed, overlap, jitter, expires)

        def register(f: Callable) -> Task:
            t = f if isinstance(f, Task) else self.task(f, **task_options)
            sname = codec.check_name("schedule", name or t.name)
            # What the dispatcher will enqueue at each tick, checked now rather than there.
            codec.check_id(cron_job_id(sname, 2**40))
            self._fields(t.name, args, kwargs, t.spec, None)
            self.schedules[sname] = Schedule(sname, cron, t.name, list(args), dict(kwargs or {}),
                                             t.spec.queue, missed, tz=tz, jitter=jitter, overlap=overlap,
                                             expires=expires)
            return t

        return register

    # -- enqueueing ------------------------------------------------------------------

    def _fields(self, task: str, args: Iterable, kwargs: dict | None, spec: JobSpec,
                sent: list[str] | None, headers: dict[str, Any] | None = None, fed: bool = False) -> list[Any]:
        """The fields of a job for enqueue.lua (_checked), its headers as given: no hook runs
        (a schedule's check when it is declared)."""
        return self._checked(task, args, kwargs, spec, sent, headers, fed)[0]

    def _checked(self, task: str, args: Iterable, kwargs: dict | None, spec: JobSpec, sent: list[str] | None,
                 headers: dict[str, Any] | None = None, fed: bool = False,
                 job_id: str | None = None) -> tuple[list[Any], Enqueued | None]:
        """The fields of a job for enqueue.lua: with `sent` None (a task declared here) all
        of the spec's settings (those of OPTIONAL when not their default), else only those
        named (the script fills in the rest from the task's declaration in Redis). Headers
        go only when there are some: a job without costs no field. The arguments must fit
        the task's signature, where it is known (arguments.check; `fed`: the job is given
        its parent's result or error first). With `job_id`, also the job as its
        before_enqueue hooks are to see it (None: the app has none, and a job pays nothing
        for them): they run once every job of the call is checked (steps.hooked, _hook), so
        that a job or workflow refused for its arguments or settings runs none (a hook that
        counts or logs enqueues would count one never enqueued)."""
        codec.check_name("task", task)
        if isinstance(args, (str, bytes, dict)) or not isinstance(args, Iterable):
            raise TypeError(f"args must be a list or tuple of arguments, not {type(args).__name__}")
        if not isinstance(kwargs or {}, dict):
            raise TypeError(f"kwargs must be a dict, not {type(kwargs).__name__}")
        if not isinstance(headers or {}, dict):
            raise TypeError(f"headers must be a dict, not {type(headers).__name__}")
        args = list(args)
        a = codec.dumps(args, "args")
        k = codec.dumps(kwargs or {}, "kwargs")
        h = codec.dumps(headers, "headers") if headers else b""
        self._fit(task, a, k, h)
        arguments.check(task, self._shape_of(task), args, kwargs or {}, fed)
        fields: list[Any] = ["task", task, "queue", spec.queue, "args", a, "kwargs", k,
                             *(("headers", h) if h else ())]
        if sent is None:
            max_duration = spec.max_duration or self.settings.max_duration
            fields += ["max_duration", max_duration, "retries", spec.retries,
                       "retry_backoff", spec.retry_backoff, "timeout_policy", spec.timeout_policy,
                       "max_lost", spec.max_lost or self.settings.max_lost]
            for name, default in OPTIONAL:
                value = getattr(spec, name)
                if value != default:
                    fields += [name, value]
            if spec.soft_limit is not None:  # none: no field, no cost
                if spec.soft_limit >= max_duration:
                    raise ValueError(f"soft_limit ({spec.soft_limit:g}s) of {task} must be less than its max "
                                     f"duration ({max_duration:g}s)")
                fields += ["soft_limit", spec.soft_limit]
            if spec.concurrency_key is not None and spec.max_concurrency is None:
                raise ValueError(f"concurrency_key needs max_concurrency: {task} sets none")
        else:
            for name in sent:
                fields += [name, getattr(spec, name)]
        unhooked = None
        if job_id is not None and self.middleware.hooks["before_enqueue"]:
            unhooked = Enqueued(task, args, dict(kwargs or {}), spec.queue, job_id, dict(headers or {}))
        return [*fields, "producer", f"{self._producer}:{threading.get_ident()}"], unhooked

    def _fit(self, task: str, a: bytes, k: bytes, h: bytes) -> None:
        """PayloadTooLarge unless a job's args, kwargs and headers (JSON) fit the limit."""
        size = len(a) + len(k) + len(h)
        if size > self.settings.max_payload:
            raise PayloadTooLarge(f"arguments {'and headers ' if h else ''}of {task} take {size} bytes; the "
                                  f"limit is {self.settings.max_payload} (TASKRUNNER_MAX_PAYLOAD)")

    def _hook(self, fields: list[Any], job: Enqueued) -> None:
        """Run the before_enqueue hooks on a checked job (_checked's `fields` and `job`); one
        that raises refuses it. The headers they leave replace those in `fields`, checked
        (JSON) and counted in the payload."""
        headers = self.middleware.before_enqueue(job)
        h = codec.dumps(headers, "headers") if headers else b""
        names = fields[0::2]
        self._fit(job.task, fields[2 * names.index("args") + 1], fields[2 * names.index("kwargs") + 1], h)
        if "headers" in names:
            at = 2 * names.index("headers")
            del fields[at:at + 2]
        if h:
            fields += ["headers", h]

    def _shape_of(self, task: str, look_up: bool = False) -> arguments.Shape | None:
        """What a job's arguments must bind to (None: nothing is checked): the signature of
        a task declared here, else the one its workers declared (`params`), as far as that
        was looked up already: an enqueue by name looks it up anyway when no queue is given
        (once every few seconds per task), so a job costs Redis no command for the check.
        `look_up`: ask Redis if it was not (for a one-off such as adding a schedule)."""
        t = self.tasks.get(task)
        if t is not None:
            return t.shape
        return arguments.from_declaration(self.declared(task) if look_up else self._declared.get(task)[1])

    def _job_spec(self, task: str, options: dict[str, Any]) -> tuple[JobSpec, list[str] | None]:
        """The spec of a job of `task` with `options` (JobSpec fields; None: not set) and
        the settings to send (_fields' `sent`). A task declared here: its spec, all sent.
        Else only the options set are sent, and the queue, unless set, is the one workers
        declared for the task (else "default")."""
        return steps.ride(self, steps.job_spec(self, task, options), "enqueueing")

    def _spec_of(self, task: str, options: dict[str, Any]) -> tuple[JobSpec, list[str] | None]:
        """_job_spec() once the queue of a task not declared here is known (in options;
        else "default")."""
        t = self.tasks.get(task)
        if t is not None:
            return t.spec.merged(**options), None
        sent = [k for k in (*DECLARED, "concurrency_key") if options.get(k) is not None]
        return JobSpec(queue=options.get("queue") or "default").merged(**options), sent

    def declared(self, task: str) -> dict[str, Any] | None:
        """The task's declaration as workers published it (None: no worker declared it),
        looked up in Redis at most once every few seconds per task. In eager mode, None:
        only this app's tasks run, and Redis is never asked."""
        return steps.run(self, steps.declared(self, task))

    def enqueue(self, task: str, args: Iterable = (), kwargs: dict | None = None, *, spec: JobSpec | None = None,
                delay: float | None = None, job_id: str | None = None, block_timeout: float | None = None,
                headers: dict[str, Any] | None = None, depends_on: Iterable[Job | str] | None = None,
                on_success: Signature | None = None, on_failure: Signature | None = None,
                priority: int | None = None, unique_for: int | None = None, unique_key: str | None = None,
                unique_until: str | None = None, expires: float | datetime | None = None, **options: Any) -> Job:
        """Enqueue by task name (the task need not be importable here). Options are those
        of JobSpec (queue, max_duration, retries, ...); for a task not declared in this app,
        those not given (the queue too) are the ones its workers declared in Redis, as the
        enqueue script fills them in. With a job_id that exists already
        nothing is enqueued and the existing job is returned, with .created False.
        Into a full bounded queue it waits up to `block_timeout` seconds (default: the
        block_timeout setting; 0: not at all) for room, then raises QueueFull.
        `headers` (a dict of JSON values) travel with the job: current_job().headers.
        `depends_on`: jobs (Job objects, or ids) that must complete first; the job waits
        (state `waiting`) until they have, and ends `canceled` if one fails (docs/PROTOCOL.md,
        Workflows). Jobs of other queues are allowed (on a Redis Cluster, other slots: it then
        takes a few calls, docs/PROTOCOL.md, Workflows).
        `on_success`, `on_failure`: signatures (task.s(...)) enqueued with the job, in the same
        call, waiting for it: on_success runs once it completed (its result first in its args,
        unless .si), on_failure once it ended otherwise (failed for good, killed, canceled;
        given {"id", "task", "state", "error_type", "error"} first, unless .si); the other is
        canceled. Durable: they are records in Redis, settled by the script that ends the job.
        `priority` (0-9): higher is claimed first within the queue (FIFO within one priority);
        0, the default, is a job without one. `unique_key`: while a job of this queue holding
        that key has not ended (`unique_until="finish"`, the default: completed, failed for
        good, killed, deleted; a retry keeps it) or started (`"start"`), enqueueing another
        with it adds nothing and returns the holder (its id, .created False); the duplicate is
        counted per task (`queue info`: duplicates). `unique_for`: seconds the lock lasts at
        most; alone, the key is made from the task and its arguments (flow.unique_key_of).
        A unique job is no workflow's part (depends_on, callbacks).
        `expires`: seconds from now (> 0), or an aware datetime, by which the job must have
        started: a worker's claim at or after it does not run it, it ends killed with
        error_type Expired (its unique lock released, its workflow's next steps canceled, its
        on_failure callback run). Counted on Redis's clock (a datetime is turned into seconds
        here); a retry keeps it; checked only when a worker claims the job, so one in a queue
        no worker serves stays pending past it (docs/PROTOCOL.md, Expiry).
        In eager mode the job runs here before this returns (taskrunner/eager.py; `delay` and
        `expires` are ignored)."""
        if unique_for is not None and unique_key is None and not isinstance(args, (list, tuple)) \
                and isinstance(args, Iterable) and not isinstance(args, (str, bytes, dict)):
            args = list(args)  # read twice: for the key, then for the job
        flow_fields = flow.fields(task, args, kwargs, priority, unique_for, unique_key, unique_until, expires)
        canvas.refuse_bad_links(flow_fields, delay, depends_on, on_success, on_failure)
        what = f"enqueueing {task}"
        draft = steps.ride(self, steps.draft(self, task, args, kwargs, spec, options, delay, job_id, headers,
                                             flow_fields), what)
        if self.settings.eager:
            canvas.check_callbacks(self, on_success, on_failure)
            parents = eager.parents_of(depends_on)  # refused before any hook ran, as the job's own checks
            steps.hooked(self, [draft])
            ran = eager.enqueue(self, draft.id, draft.fields, parents)
            return canvas.eager_callbacks(self, ran, on_success, on_failure)
        created = steps.ride(self, canvas.linked(self, draft, depends_on, on_success, on_failure, block_timeout), what)
        if isinstance(created, str):  # a unique job's duplicate: the job that holds its key
            job = Job(self, created, draft.queue)
            job.created = False
            return job
        job = Job(self, draft.id, draft.queue)
        job.created = created == 1
        return job

    def signature(self, task: str, args: Iterable = (), kwargs: dict | None = None, *, immutable: bool = False,
                  **options: Any) -> Signature:
        """A signature of a task by name, `app.signature("shop.send", ["a@b.c"])`: a step,
        callback or chord member for a producer that does not import the task. A task this
        app declares is that Task's; any other gets the queue and settings its workers
        declared in Redis (enqueue.lua fills them in), but for the options given (queue,
        max_duration, retries, max_retries, job_id, headers, delay)."""
        codec.check_name("task", task)
        if isinstance(args, (str, bytes, dict)) or not isinstance(args, Iterable):
            raise TypeError(f"args must be a list or tuple of arguments, not {type(args).__name__}")
        if not isinstance(kwargs or {}, dict):
            raise TypeError(f"kwargs must be a dict, not {type(kwargs).__name__}")
        t = self.tasks.get(task) or canvas.Named(self, task)
        return Signature(t, tuple(args), dict(kwargs or {}), immutable=immutable).set(**options)

    def enqueue_many(self, jobs: Iterable[dict[str, Any]], chunk: int = 1000,
                     progress: Callable[[int], Any] | None = None) -> list[Job]:
        """Enqueue many jobs, one round trip per `chunk`. Each job is a dict with `task`
        and optionally args, kwargs, queue, delay, max_duration, retries, max_retries, id, headers,
        priority, unique_key, unique_for, unique_until (a unique job's duplicate: the Job of the
        one holding its key), expires, and the links of TaskRunner.enqueue: `depends_on` (ids, of this
        call's earlier jobs or of existing ones, or Job objects), `on_success`, `on_failure`
        (signatures, or objects as callback_of() reads them). Never blocks: jobs refused by a
        full or closed queue raise QueueFull/QueueClosed after their chunk, and those a script
        refuses (a shard not the queue's: InvalidName) its error; a job refused before it is
        sent (its arguments, a hook) raises its error, and Redis unavailable past the
        enqueue_retry bound its Redis error. Any error raised once a job was sent says how many
        jobs were enqueued, and carries, each in the order given: `enqueued`, the Jobs of those
        Redis took (created, there already, or a unique duplicate's holder: what the call
        returns) — after refused ones too, as a chunk may span queues; `refused`, those Redis
        refused (not enqueued); `unsure`, those sent whose answer did not come (each may be
        enqueued: give them their ids again, an id that exists adds nothing); and `withdrawn`,
        those a call of their own wrote and then killed, as a later part of it failed for good
        (canvas.across: enqueue them again with NEW ids, their own are taken by the killed
        records). A job given before where it stopped that is in none of these was not sent
        (it waited for the next chunk), nor were those after, so a caller that sends again
        every job not in `enqueued` or `refused` (those of `unsure` with their ids) enqueues
        none twice. While Redis runs a chunk, the next one is built; it is sent once the
        answers came. A job whose parent is in this chunk in another queue goes in the next
        chunk (its parent is written first); one whose callbacks are in another queue than its
        own is written with them by a call of its own. On a Redis Cluster, so is one whose
        parents are in other queues (other slots), after the jobs before it: parents first, as
        canvas.across writes a workflow there. In eager mode each job runs here, in order.
        Returns one Job per job given (not its callbacks). How, part by part: client/bulk.py."""
        return bulk.BulkEnqueue(self, chunk, progress).run(jobs)

    def callback_of(self, value: Any, what: str) -> Signature | None:
        """A callback as enqueue_many and `taskrunner enqueue` take it: a Signature, a task
        name, or an object {"task", and optionally "args", "kwargs", "queue", "max_duration",
        "retries", "max_retries", "id", "headers", "immutable" (true: it is not given the
        job's result or error)}."""
        if value is None or isinstance(value, Signature):
            return value
        if isinstance(value, str):
            return self.signature(value)
        if not isinstance(value, dict) or "task" not in value:
            raise ValueError(f"{what} must be a signature or an object with a 'task' field")
        unknown = set(value) - {"task", "args", "kwargs", "queue", "max_duration", "retries", "max_retries", "id",
                                "headers", "immutable"}
        if unknown:
            raise ValueError(f"unknown fields {sorted(unknown)} in {what}")
        if not isinstance(value.get("immutable", False), bool):
            raise TypeError(f"immutable in {what} must be true or false")
        options = {k: value[k] for k in ("queue", "max_duration", "retries", "max_retries", "headers")
                   if value.get(k) is not None}
        if value.get("id") is not None:
            options["job_id"] = value["id"]
        return self.signature(value["task"], value.get("args") or [], value.get("kwargs"),
                              immutable=value.get("immutable", False), **options)

    def enqueue_keys(self, queue: str, others: Iterable[str] = ()) -> list[str]:
        """KEYS of enqueue.lua: the queue's prefix, and the global queue set where one script
        may touch both (not on a Redis Cluster: there the producer registers the queue), then
        the prefixes of `others`, the other queues of a workflow (refused on a cluster:
        one script touches one slot; there canvas.written() writes such a workflow in several
        calls, canvas.across())."""
        q = self.keys.q(queue)
        others = list(others)
        if is_cluster(self.redis):
            if others:
                raise ValueError(f"a workflow over queues {', '.join([queue, *others])} spans slots: on a Redis "
                                 "Cluster it is written in several calls (canvas.across), not one")
            return [q]
        return [q, self.keys.queues, *(self.keys.q(o) for o in others)]

    def _queue_enqueue(self, batch: scripts.Batch, queue: str, jobs: list[tuple[str, float, list[Any]]],
                       others: Iterable[str] = ()) -> None:
        batch.call(scripts.ENQUEUE, self.enqueue_keys(queue, others), _enqueue_args(jobs, self.settings.max_payload))

    def _enqueue_batch(self, queue: str, jobs: list[tuple[str, float, list[Any]]],
                       others: Iterable[str] = ()) -> list[int]:
        """enqueue.lua's answers for `jobs` (a workflow's, of `queue` and `others`, in one call:
        not on a Redis Cluster, enqueue_keys())."""
        client = self.redis  # first: a new client (new process or settings) knows no queue yet
        keys = self.enqueue_keys(queue, others)
        if len(keys) == 1 and queue not in self._known_queues:  # a cluster: once per process and queue
            client.sadd(self.keys.queues, queue)
            self._known_queues.add(queue)
        return scripts.ENQUEUE(self._direct or client, keys, _enqueue_args(jobs, self.settings.max_payload))

    # -- looking up ------------------------------------------------------------------

    def queue_names(self) -> list[str]:
        """Every queue ever enqueued into or served, sorted."""
        return sorted(self.redis.smembers(self.keys.queues))

    def job(self, job_id: str, queue: str | None = None) -> Job:
        """The job with that id (its queue is looked up when not given)."""
        return Job(self, job_id, *steps.run(self, steps.find(self, job_id, queue)))

    def purge(self, queue: str, progress: Callable[[int], Any] | None = None) -> int:
        """Delete every pending job of a queue (of each of its shards), a thousand per call;
        returns how many."""
        total = 0
        codec.check_queue(queue)
        count = 1 if shards.is_shard(queue) else shards.count(self.redis.hget(self.keys.q(queue) + "meta", "shards"))
        for shard in shards.names(queue, count):
            while True:
                deleted, left = scripts.PURGE(self.redis, [self.keys.q(shard)], [1000, self.settings.failed_ttl])
                total += deleted
                if progress:
                    progress(deleted)
                if not left or not deleted:
                    break
        return total

    def send_control(self, worker: str, message: dict) -> None:
        """Put a message on a worker's control list (it BRPOPs it at once)."""
        steps.run(self, steps.send_control(self, worker, message))
