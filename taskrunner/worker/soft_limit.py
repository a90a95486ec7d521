"""Soft time limits: `@app.task(soft_limit=S)` raises SoftTimeLimit inside the task S
seconds after it began, so that it can clean up before the hard kill at its max duration
(which stays as it is). How it gets in depends on where the task runs:

- A classic child (one job at a time, in its main thread): SIGALRM from an interval timer;
  its handler raises in the task wherever it is, blocking calls included (time.sleep,
  socket reads: they fail with SoftTimeLimit). One raised in a finalizer (a `__del__`,
  where Python swallows exceptions) is raised again at the task's next line (child.py,
  Link.unraisable), as a kill is (a task in a thread's too). A handler that comes while the
  job is
  writing a frame to the worker (a progress or log line) waits for the frame to be whole
  (Link.send raises it then): a frame cut short would break the pipe. One that comes while
  a spark=True task waits on the JVM (a Spark action) cancels the job's Spark job group and
  is raised as that call returns (spark_session.py): py4j's exchange cut short would be
  lost, the Spark job running on.
- A thread of a loop child (`--threads`): a timer thread sets SoftTimeLimit as the job
  thread's asynchronous exception (PyThreadState_SetAsyncExc). Python raises it at the
  thread's next bytecode: a thread blocked in C (time.sleep, a socket read) gets it only
  when that call returns.
- A coroutine (run_async, with asyncio.timeout): the coroutine is cancelled at its current
  await (CancelledError inside it: `finally` and `except CancelledError` blocks run, as with
  asyncio's own timeouts), and the job then ends with SoftTimeLimit, unless the coroutine
  swallowed the cancellation and returned.

Eager mode enforces no soft limit (nor a max duration): a test should not get signals."""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import signal
import threading
from collections.abc import AsyncIterator, Iterator
from typing import Any

from taskrunner.errors import SoftTimeLimit
from taskrunner.worker import spark_session


def message(seconds: float) -> str:
    return f"the task ran past its soft time limit ({seconds:g}s)"


#: A job without a soft limit: nothing to arm (one object for all: no cost per job).
_NONE = contextlib.nullcontext()


def applied(seconds: float | None, link: Any) -> contextlib.AbstractContextManager[None]:
    """The block runs under the soft limit (None: none); `link`, the child's Link, is
    where a SIGALRM that comes while a frame is being written waits."""
    if seconds is None:
        return _NONE
    if threading.current_thread() is threading.main_thread():
        return _alarm(seconds, link)
    return _async_exc(seconds)


@contextlib.contextmanager
def _alarm(seconds: float, link: Any) -> Iterator[None]:
    armed = True

    def on_alarm(signum: int, frame: Any) -> None:
        if not armed:
            return  # it came as the block ended
        exc = SoftTimeLimit(message(seconds))
        if link is not None and link.sending:
            link.interrupt = exc
        elif not spark_session.CHILD.defer(exc):  # in a call to the JVM: raised as it returns
            raise exc

    previous = signal.signal(signal.SIGALRM, on_alarm)
    if link is not None:
        link.soft_armed = True  # one raised in a finalizer is raised again (Link.unraisable)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        if link is not None:
            link.soft_armed = False
        armed = False
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        spark_session.CHILD.forget()
        if link is not None:
            link.interrupt = None


class _Posted:
    """A job thread's soft limit while its block runs: whether it fired (SoftTimeLimit posted
    to the thread), under a lock shared with its timer."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.active, self.fired = True, False


#: Thread id -> its soft limit, while the block runs (thread_due()).
_threads: dict[int, _Posted] = {}


@contextlib.contextmanager
def _async_exc(seconds: float) -> Iterator[None]:
    ident, state = threading.get_ident(), _Posted()

    def fire() -> None:
        with state.lock:
            if state.active:
                state.fired = True
                _set_async_exc(ident, SoftTimeLimit)

    _threads[ident] = state
    timer = threading.Timer(seconds, fire)
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()
        with state.lock:
            state.active = False
            if state.fired:
                _set_async_exc(ident, None)  # one not raised yet must not hit what runs next
        del _threads[ident]


def thread_due() -> bool:
    """Whether this thread's soft limit (a task in a thread) fired and its block still runs:
    a SoftTimeLimit that a finalizer swallowed is then raised again (child.py,
    Link.unraisable). Posting it again from there would raise it in the hook itself."""
    state = _threads.get(threading.get_ident())
    return state is not None and state.active and state.fired


def _set_async_exc(ident: int, exc: type[BaseException] | None) -> None:
    ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(ident), ctypes.py_object(exc) if exc else None)


def applied_async(seconds: float | None) -> contextlib.AbstractAsyncContextManager[None]:
    """The block (in a coroutine) runs under the soft limit (None: none): cancelled at
    its end, then SoftTimeLimit raised here."""
    return _NONE if seconds is None else _timeout(seconds)


@contextlib.asynccontextmanager
async def _timeout(seconds: float) -> AsyncIterator[None]:
    timeout = asyncio.timeout(seconds)
    try:
        async with timeout:
            yield
    except TimeoutError:
        if timeout.expired():
            raise SoftTimeLimit(message(seconds)) from None
        raise
