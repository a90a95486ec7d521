"""The long-lived child process that runs a worker's jobs, one at a time, in the order
they were sent.

Protocol with the worker (one pipe; the worker may send several jobs ahead, its prefetch):
it sends b"seq\\0" + message(...) (id, attempt, task, queue, max_duration, args, kwargs,
headers, soft limit; args, kwargs, headers: the JSON text stored in Redis; seq counts the
jobs sent to this child; the rest is what current_job() tells the task); the child answers each job it ran with a
JSON list [id, attempt, runtime, outcome, v1, v2, v3, v4] (outcome, v1..v4 as finish.lua takes them; the
attempt tells two deliveries of one job apart: a loop child may run a job requeued under it
again beside its first delivery).
A job the worker stops (SIGTERM with the kill flag set) ends the child, unless it runs Spark
jobs: then they are canceled, and the child answers the job "killed" and goes on (the
worker makes that what it stopped the job for; spark_session.py).

Jobs sent ahead can be taken back while the child is busy, without its help: under a lock
shared with the worker, the child records the seq of each job as it begins it (state[0]),
and skips a job whose seq the worker put in the taken-back range (state[1]..state[2])."""

from __future__ import annotations

import asyncio
import ctypes
import inspect
import logging
import os
import random
import signal
import sys
import threading
import time
import traceback
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import orjson

from taskrunner import logs
from taskrunner.client import arguments
from taskrunner.errors import BadArguments, NotJSONError, Reject, Retry, SoftTimeLimit
from taskrunner.protocol import codec
from taskrunner.protocol.outcome import Outcome
from taskrunner.worker import frames, soft_limit, spark_session
from taskrunner.worker.context import JobContext, JobLogHandler, Reporter, _current, log_line, running_job_fields


class _Killed(BaseException):
    """Raised in the job by SIGTERM when the worker asked for it (kill or time limit)."""


def die_with_parent(sig: int = signal.SIGKILL) -> None:
    """Linux: the kernel sends us `sig` when our parent dies (the thread that forked us):
    a job child gets SIGKILL when its worker dies, so no orphan runs a job twice; the
    processes of `taskrunner up` get SIGTERM when it dies, so none is left running."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, sig)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def dies_with_us(sig: int = signal.SIGTERM) -> Callable[[], None]:
    """A preexec_fn for subprocess.Popen: the new process gets `sig` when we die (Linux),
    and exits at once if we died before it could ask."""
    parent = os.getpid()

    def arm() -> None:
        die_with_parent(sig)
        if os.getppid() != parent:
            os._exit(1)

    return arm


class Link:
    """Our end of the pipe to the worker, written in whole frames only (by any thread: a
    lock orders them): a kill (SIGTERM with the kill flag set) that arrives while a frame
    is being written waits for it, as a job's answer cut short would be lost. The kill
    raises _Killed in the job (a child running one job at a time: its finally blocks run),
    or with `hard` (a child running several: a thread cannot be interrupted) ends the
    process."""

    def __init__(self, fd: int, kill_flag: Any, app: Any, hard: bool = False) -> None:
        self.fd, self.kill_flag, self.app, self.hard = fd, kill_flag, app, hard
        self.sending = self.killed = False
        self.interrupt: BaseException | None = None  # raised once a frame is whole (soft_limit.py)
        self.soft_armed = False  # a soft limit's alarm may come now (soft_limit.py): unraisable() raises it again
        self.killing = False  # a kill swallowed by a finalizer waits to be raised again (unraisable())
        self.previous_hook = sys.unraisablehook
        self.lock = threading.Lock()

    def on_term(self, signum: int, frame: Any) -> None:
        # SIGTERM from anyone but our worker (e.g. a platform stopping every process) is
        # ignored: the worker decides when a job stops. A job running Spark jobs has them
        # canceled instead, and ends as stopped (spark_session.py).
        if self.kill_flag.value:
            if not self.hard and spark_session.CHILD.cancel():
                return
            if self.sending:
                self.killed = True
            else:
                self._die()

    def _die(self) -> None:
        if self.hard:
            os._exit(143)
        raise _Killed()

    def unraisable(self, info: Any) -> None:
        """sys.unraisablehook: a kill that landed where Python swallows exceptions (a
        __del__, a weakref callback, the garbage collector) did not stop the job, and would
        have printed "Exception ignored in ..." with a traceback. It is raised again at the
        next line the job's own frames run (those on the stack now; a finalizer runs in a
        new frame, which is not traced), as a debugger stops a program. Not as a frame
        returns: a generator or coroutine suspended by an exception raised there would skip
        its finally blocks for good; its caller's next line raises it. Any other exception
        goes to the hook there was before (an app's, e.g. an error reporter's).
        A soft limit's SoftTimeLimit swallowed so is raised again the same way (SIGALRM's in
        the main thread, the timer's in a job's thread: sys.settrace is the thread's own), if
        the job's soft limit still applies when that next line runs (its block may have
        ended: the exception must not land in the child's own code after the job). A kill
        waiting to be raised again wins over it."""
        exc = info.exc_value
        if isinstance(exc, SoftTimeLimit):
            if self.killing:
                return  # the job stops anyway
            if threading.current_thread() is threading.main_thread():
                def due() -> bool:
                    return self.soft_armed
            else:
                due = soft_limit.thread_due
            if not due():
                self.previous_hook(info)
                return
        elif isinstance(exc, _Killed):
            self.killing = True
        else:
            self.previous_hook(info)
            return
        frames: list[Any] = []

        def again(frame: Any, event: str, arg: Any) -> Any:
            if event == "return":
                return None
            sys.settrace(None)
            for f in frames:
                f.f_trace = None
            if isinstance(exc, _Killed):
                self.killing = False
            elif not due():
                return None
            raise exc.with_traceback(None)

        frame: Any = sys._getframe(0).f_back  # None when no Python code runs (the interpreter's exit)
        while frame is not None:
            frame.f_trace = again
            frames.append(frame)
            frame = frame.f_back
        if frames:
            sys.settrace(lambda frame, event, arg: None)

    def send(self, *payloads: bytes) -> None:
        """Each payload a frame, all in one write (a loop child sends a job's answer and
        the next one's "began" together: one system call, one wake-up of the worker)."""
        data = b"".join(frames.frame(p) for p in payloads)
        with self.lock:
            self.sending = True
            try:
                while data:  # a signal may cut a big write short
                    data = data[os.write(self.fd, data):]
            finally:
                self.sending = False
        if self.killed:
            self._die()
        if self.interrupt is not None:
            e, self.interrupt = self.interrupt, None
            raise e

    # A job's progress and log lines (context.Reporter): one frame each, a JSON object,
    # where a job's answer is a JSON array; the worker batches them into its syncs.
    def progress(self, job: JobContext, fraction: float, note: str) -> None:
        self.send(orjson.dumps({"progress": [job.id, str(job.attempt), fraction, note]}))

    def log(self, job: JobContext, line: str) -> None:
        self.send(b'{"log":[%s,"%d",%s]}' % (orjson.dumps(job.id), job.attempt, log_line(job, line)))

    def record(self, job: JobContext, fields: tuple[str, ...]) -> list[str | None]:
        return self.app.redis.hmget(self.app.keys.job(job.queue, job.id), fields)


def begin_child(conn: Any, app: Any, kill_flag: Any, parent: int, inherited: list, hard: bool = False) -> Link:
    """What every child does first: close the pipe ends that are not ours, leave signals
    to the worker, die with it, capture `logging` in jobs; its link to the worker."""
    for other in inherited:
        other.close()
    signal.set_wakeup_fd(-1)  # the worker's, inherited: our signals are not its business
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C (and Ctrl-\) are for the worker to handle
    signal.signal(signal.SIGQUIT, signal.SIG_IGN)
    link = Link(conn.fileno(), kill_flag, app, hard)
    signal.signal(signal.SIGTERM, link.on_term)
    sys.unraisablehook = link.unraisable
    die_with_parent()
    if os.getppid() != parent:
        os._exit(1)
    logs.add_fields(running_job_fields)  # on the handlers inherited from the worker: a task's records name its job
    logging.getLogger().addHandler(JobLogHandler())
    return link


def answer(message: bytes, runtime: float, outcome: Outcome) -> bytes:
    """The answer to the worker for the job `message` (its id and attempt come first)."""
    job_id, attempt = message.split(b"\0", 2)[:2]
    return orjson.dumps([job_id.decode(), attempt.decode(), runtime, *outcome.wire()])


def child_main(conn: Any, app: Any, kill_flag: Any, state: Any, lock: Any, parent: int, inherited: list) -> None:
    """One job at a time, in the order sent (the worker's classic child)."""
    link = begin_child(conn, app, kill_flag, parent, inherited)
    app.middleware.child_start()
    fd = conn.fileno()
    reader, jobs = frames.Reader(fd), deque[bytes]()
    try:
        while True:
            try:
                while not jobs:
                    got = reader.read()
                    if got is None:
                        break  # the worker closed its end
                    jobs.extend(got)
            except OSError:
                pass
            if not jobs:
                app.middleware.child_stop()
                spark_session.CHILD.stop()
                os._exit(0)
            seq, message = jobs.popleft().split(b"\0", 1)
            n = int(seq)
            with lock:
                if state[1] <= n <= state[2]:
                    continue  # taken back before it began
                state[0] = n
            began = time.perf_counter()
            outcome = run(app, message, link)
            # A job that completed stays completed: the cancel may have come as it returned.
            if spark_session.CHILD.group is not None and spark_session.CHILD.end() and outcome.kind != "completed":
                outcome = Outcome.killed("its Spark job group was canceled")  # the worker says why
            link.send(answer(message, time.perf_counter() - began, outcome))
    except _Killed:
        spark_session.CHILD.abandon()
        os._exit(143)  # the job's finally blocks have run


def _error(e: BaseException, task: Any) -> Outcome:
    """The outcome of a task that raised: "error" (retried while retries last, after a
    backoff with this jitter factor), or "failed" at once when the task's retry_on /
    no_retry_on say that this exception is not worth another try."""
    kind = type(e).__qualname__
    if type(e).__module__ != "builtins":
        kind = f"{type(e).__module__}.{kind}"
    if not task.retryable(e):
        return Outcome.failed(kind, str(e), traceback.format_exc())
    return Outcome.error(kind, str(e), traceback.format_exc(), random.uniform(0.5, 1.0))


def _mismatch(call: Call) -> str | None:
    """Why the arguments do not fit the task's signature, as a producer that knows it says
    it (client/arguments.py, check_args=False or not), or None: then a TypeError came from
    inside the task. Asked only after a TypeError: binding costs on every job."""
    shape = arguments.shape_of(call.task.fn)
    try:
        arguments.check(call.context.task, shape, call.args, call.kwargs, False)
    except BadArguments as e:
        return str(e)
    return None


@dataclass
class Call:
    """A job ready to run: its task, its decoded arguments and the context current_job()
    gives it."""

    task: Any
    args: list
    kwargs: dict
    context: JobContext
    soft_limit: float | None = None  # seconds (soft_limit.py)

    @property
    def is_async(self) -> bool:
        return inspect.iscoroutinefunction(self.task.fn)


def message(job_id: str, attempt: str, task: str, queue: str, max_duration: str, args: str, kwargs: str,
            headers: str, soft_limit: str) -> bytes:
    """A job as the worker (or eager mode) sends it to be run: its fields, NUL-separated
    (prepare() refuses a job whose record held a NUL); soft_limit "": none."""
    return "\0".join((job_id, attempt, task, queue, max_duration, args, kwargs, headers, soft_limit)).encode()


def prepare(app: Any, message: bytes, reporter: Reporter | None = None) -> Call | Outcome:
    """The job a worker sent (message()), ready to run; or, for bad input, the outcome
    that ends it. Its progress and log lines will go to `reporter`."""
    parts = message.split(b"\0")
    if len(parts) != 9:
        return Outcome.failed("CorruptJob", "job record has a malformed field (NUL byte)")
    job_id, attempt, raw_name, queue, max_duration, raw_args, raw_kwargs, raw_headers, soft = parts
    name = raw_name.decode("utf-8", "replace")
    task = app.tasks.get(name)
    if task is None:
        return Outcome.failed("NotRegistered", f"unknown task {name!r}: no task of that name in app {app.name!r}")
    try:
        args, kwargs = codec.loads(raw_args), codec.loads(raw_kwargs)  # UTF-8 checked there
        headers = codec.loads(raw_headers) if raw_headers else {}
    except ValueError as e:
        return Outcome.failed("BadArguments", f"args/kwargs/headers are not valid JSON: {e}")
    if not isinstance(args, list) or not isinstance(kwargs, dict) or not isinstance(headers, dict):
        return Outcome.failed("BadArguments", "args must be a JSON array, kwargs and headers JSON objects")
    context = JobContext(job_id.decode(), name, queue.decode(), int(attempt), time.time() + float(max_duration),
                         headers, reporter=reporter, uses_spark=task.spark)
    return Call(task, args, kwargs, context, _soft_limit(soft))


def _soft_limit(text: bytes) -> float | None:
    """The soft limit a worker sent: None when none (or not a number of seconds > 0: the
    claim copies the record's field as it is)."""
    try:
        s = float(text) if text else 0.0
    except ValueError:
        return None
    return s if 0 < s < float("inf") else None


def raised(e: BaseException, call: Call) -> Outcome:
    """The outcome of a task that raised `e` (call it in the except block: the traceback
    is the one being handled)."""
    if isinstance(e, Retry):
        return Outcome.retry(e.delay)
    if isinstance(e, Reject):
        return Outcome.failed("Rejected", str(e))
    if isinstance(e, TypeError):
        mismatch = _mismatch(call)
        if mismatch:
            return Outcome.failed("BadArguments", mismatch)
    return _error(e, call.task)


def returned(result: Any, call: Call) -> Outcome:
    if call.task.ignore_result:
        return Outcome.completed("null")
    try:
        return Outcome.completed(codec.dumps(result, "result").decode())
    except NotJSONError as e:
        return Outcome.failed("NotJSONError", str(e))


def run(app: Any, message: bytes, reporter: Reporter | None = None) -> Outcome:
    """Run one job here and now; every outcome, including bad input, becomes a reply. An
    `async def` task runs to its end on an event loop of its own (eager mode)."""
    call = prepare(app, message, reporter)
    return call if isinstance(call, Outcome) else execute(call)


def execute(call: Call) -> Outcome:
    """Run a prepared job in this thread, between its middleware's hooks (middleware.py:
    a raising before_run fails the delivery as the task's own exception would)."""
    token = _current.set(call.context)
    hooks = call.task.app.middleware
    try:
        try:
            hooks.before_run(call.context)
            with soft_limit.applied(call.soft_limit, call.context.reporter):
                result = call.task.fn(*call.args, **call.kwargs)
                if inspect.iscoroutine(result):  # eager mode, or a worker without --async-slots
                    result = asyncio.run(result)
        except (Exception, SystemExit) as e:
            return hooks.after_run(call.context, raised(e, call), e)
        return hooks.after_run(call.context, returned(result, call), None)
    finally:
        _current.reset(token)


async def run_async(call: Call) -> Outcome:
    """Run an `async def` task's job as a coroutine of the running loop, between its
    middleware's hooks (as execute()). Cancelling it (a kill, its max duration) raises
    CancelledError out of here: the caller knows why."""
    token = _current.set(call.context)
    hooks = call.task.app.middleware
    try:
        try:
            hooks.before_run(call.context)
            async with soft_limit.applied_async(call.soft_limit):
                result = await call.task.fn(*call.args, **call.kwargs)
        except (Exception, SystemExit) as e:
            return hooks.after_run(call.context, raised(e, call), e)
        return hooks.after_run(call.context, returned(result, call), None)
    finally:
        _current.reset(token)
