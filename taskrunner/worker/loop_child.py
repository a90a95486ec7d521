"""A worker's child that runs several jobs at once (`taskrunner worker --threads T`, or an app
with `async def` tasks: `--async-slots M`): an event loop in the main thread runs
`async def` tasks as coroutines, up to M at once, and hands plain tasks to a pool of T
threads.

Protocol with the worker, beyond the classic child's (child.py): the child begins jobs in
the order sent, each as soon as a slot of its kind is free, and says so with a frame
{"began": seq} (the worker times its max duration from then); the worker may send
b"c<seq>\\0<reason>" to stop one job: a coroutine is cancelled (the child goes on and
answers it killed, or TimeLimitExceeded for reason "timeout"); a job that has not begun is
answered the same way without running. A thread cannot be stopped: for a kill or its max
duration the worker stops the whole child (SIGTERM with the kill flag set ends the process
at once), after handing back what it can; one requeued under it runs on, and the worker
does not report its answer (crew.Crew.stop)."""

from __future__ import annotations

import asyncio
import inspect
import os
import threading
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from taskrunner.protocol.outcome import Outcome
from taskrunner.worker import frames, precise_loop, spark_session
from taskrunner.worker.child import Call, Link, answer, begin_child, execute, prepare, run_async


def loop_child_main(conn: Any, app: Any, kill_flag: Any, state: Any, lock: Any, parent: int, inherited: list,
                    threads: int, async_slots: int) -> None:
    link = begin_child(conn, app, kill_flag, parent, inherited, hard=True)
    app.middleware.child_start()
    precise_loop.run(LoopChild(app, link, state, lock, threads, async_slots).serve())
    app.middleware.child_stop()
    spark_session.CHILD.stop()
    os._exit(0)


def stopped(reason: str, began: bool) -> Outcome:
    """How a job the worker stopped ends: TimeLimitExceeded (retried while retries last)
    for its max duration, else killed."""
    if reason == "timeout":
        return Outcome.error("TimeLimitExceeded", "ran past its max duration; cancelled")
    return Outcome.killed("killed on request" + ("" if began else " (before it began)"))


class LoopChild:
    def __init__(self, app: Any, link: Link, state: Any, lock: Any, threads: int, async_slots: int) -> None:
        self.app, self.link, self.state, self.lock = app, link, state, lock
        self.reader = frames.Reader(link.fd)
        self.pool = ThreadPoolExecutor(max(1, threads), thread_name_prefix="taskrunner-job")
        self.free = {False: max(1, threads), True: async_slots}  # slots free: threads, coroutines
        self.waiting: deque[tuple[int, bytes]] = deque()  # sent, not begun (the worker may send more than the slots)
        self.kinds: dict[bytes, bool] = {}  # task name -> kind()
        self.coroutines: dict[int, asyncio.Task] = {}  # seq -> running async job
        self.stop: dict[int, str] = {}  # seq -> why the worker asked to stop it
        self.closed: asyncio.Event | None = None
        # Jobs ended in threads, for the loop to answer: one wake-up of the loop for all
        # that end before it runs (a future per job and a wake-up each cost more than the
        # job's own bookkeeping at hundreds of jobs per second).
        self.finished: deque[tuple[int, bytes, float, Outcome]] = deque()
        self.finished_lock = threading.Lock()
        self.wake_pending = False

    async def serve(self) -> None:
        """Until the worker closes its end of the pipe."""
        self.loop = asyncio.get_running_loop()
        self.closed = asyncio.Event()
        self.loop.add_reader(self.link.fd, self.on_readable)
        await self.closed.wait()

    def on_readable(self) -> None:
        try:
            got = self.reader.read()
        except BlockingIOError:
            return
        except OSError:
            got = None
        if got is None:  # the worker closed its end
            self.loop.remove_reader(self.link.fd)
            self.closed.set()  # type: ignore[union-attr]
            return
        for f in got:
            if f[:1] == b"c":
                seq, reason = f[1:].split(b"\0", 1)
                self.on_stop(int(seq), reason.decode())
            else:
                seq, message = f.split(b"\0", 1)
                self.waiting.append((int(seq), message))
        out: list[bytes] = []
        self.admit(out)
        if out:
            self.link.send(*out)

    def on_stop(self, seq: int, reason: str) -> None:
        self.stop[seq] = reason
        task = self.coroutines.get(seq)
        if task is not None:
            task.cancel()
        # A job still waiting is answered by admit(); a thread's job runs on (the worker
        # stops the child if it must).

    def admit(self, out: list[bytes]) -> None:
        """Begin what was sent, in order, while slots of each job's kind are free; the
        frames for the worker go to `out`, for the caller to send in one write."""
        while self.waiting:
            seq, message = self.waiting[0]
            kind = self.kind(message)
            if kind is not None and seq not in self.stop and not self.free[kind]:
                return  # in order: the next job waits for a slot of its kind
            self.waiting.popleft()
            with self.lock:
                if self.state[1] <= seq <= self.state[2]:
                    continue  # taken back before it began
                self.state[0] = seq
            out.append(b'{"began":%d}' % seq)
            if seq in self.stop:
                out.append(answer(message, 0.0, stopped(self.stop.pop(seq), False)))
                continue
            call = prepare(self.app, message, self.link)  # here: its context's deadline counts from now
            if isinstance(call, Outcome):
                out.append(answer(message, 0.0, call))  # bad input
            else:
                self.begin(seq, message, call, call.is_async)

    def kind(self, message: bytes) -> bool | None:
        """The slot a job sent needs: True a coroutine's, False a thread's; None for one
        that will not run (an unknown task, a malformed message: prepare() says why).
        Asked each time the job is first in line without a slot (the worker sends spare
        jobs), so from the task's name, not by preparing the job each time."""
        parts = message.split(b"\0", 3)
        name = parts[2] if len(parts) == 4 else b""
        kind = self.kinds.get(name)
        if kind is None:
            task = self.app.tasks.get(name.decode("utf-8", "replace"))
            if task is None:
                return None
            kind = self.kinds[name] = inspect.iscoroutinefunction(task.fn)
        return kind

    def begin(self, seq: int, message: bytes, call: Call, is_async: bool) -> None:
        self.free[is_async] -= 1
        began = time.perf_counter()
        if is_async:
            task = self.coroutines[seq] = self.loop.create_task(run_async(call))
            task.add_done_callback(lambda f: self.ended(seq, message, began, f))
        else:
            self.pool.submit(self.in_thread, seq, message, call, began)

    def ended(self, seq: int, message: bytes, began: float, task: asyncio.Task) -> None:
        """A coroutine's job ended: answer it, begin what waits."""
        self.free[True] += 1
        self.coroutines.pop(seq, None)
        reason = self.stop.pop(seq, None)
        if task.cancelled():
            outcome = stopped(reason or "killed", True)
        elif (e := task.exception()) is not None:  # a BaseException the task let out (KeyboardInterrupt...)
            outcome = Outcome.failed(type(e).__qualname__, str(e))
        else:
            outcome = task.result()
        out = [answer(message, time.perf_counter() - began, outcome)]
        self.admit(out)
        self.link.send(*out)

    def in_thread(self, seq: int, message: bytes, call: Call, began: float) -> None:
        """Run a job in a pool thread; the loop answers it (threads_ended)."""
        try:
            outcome = execute(call)
        except BaseException as e:  # a BaseException the task let out (KeyboardInterrupt...)
            outcome = Outcome.failed(type(e).__qualname__, str(e))
        runtime = time.perf_counter() - began
        with self.finished_lock:
            self.finished.append((seq, message, runtime, outcome))
            if self.wake_pending:
                return
            self.wake_pending = True
        self.loop.call_soon_threadsafe(self.threads_ended)

    def threads_ended(self) -> None:
        """Jobs that ended in threads: answer them, begin what waits, in one write."""
        with self.finished_lock:
            done, self.finished = self.finished, deque()
            self.wake_pending = False
        out = []
        for seq, message, runtime, outcome in done:
            self.free[False] += 1
            self.stop.pop(seq, None)
            out.append(answer(message, runtime, outcome))
        self.admit(out)
        self.link.send(*out)
