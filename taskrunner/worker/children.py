"""A worker's children: each a long-lived process (child.py) that runs the jobs sent to
it in order, and the worker's side of it (the pipe, what was sent, taking back what has
not begun, stopping it); and the one wait for whatever is ready among pipes, sentinels and
sockets."""

from __future__ import annotations

import gc
import multiprocessing
import os
import select
import signal
import time
from collections import deque
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from taskrunner.protocol.claims import Delivery
from taskrunner.worker import frames
from taskrunner.worker.child import child_main
from taskrunner.worker.loop_child import loop_child_main

if TYPE_CHECKING:
    from taskrunner.client.app import TaskRunner

_ctx = multiprocessing.get_context("fork")


class Child:
    """One long-lived child process and what the worker has sent it: a classic child
    (child.py) runs one job at a time; with `threads` > 1 or `async_slots`, a loop child
    (loop_child.py) runs up to that many at once, and says when it begins each."""

    def __init__(self, app: TaskRunner, siblings: list[Child], max_jobs: int | None = None, threads: int = 1,
                 async_slots: int = 0) -> None:
        self.conn, theirs = _ctx.Pipe()
        self.kill_flag = _ctx.Value("b", 0, lock=False)
        self.state = _ctx.RawArray("q", [0, 1, 0])  # seq it began last; taken-back range (child.py)
        self.lock = _ctx.Lock()
        # The child closes the pipe ends of ours it inherits (its siblings' and its own), so
        # that it sees EOF when we close ours.
        inherited = [c.conn for c in siblings] + [self.conn]
        self.concurrent = threads > 1 or async_slots > 0
        self.capacity = threads + async_slots if self.concurrent else 1  # jobs it runs at once, at most
        args = (theirs, app, self.kill_flag, self.state, self.lock, os.getpid(), inherited)
        self.proc = _ctx.Process(target=loop_child_main if self.concurrent else child_main, name="taskrunner-child",
                                 args=(*args, threads, async_slots) if self.concurrent else args)
        # Objects the fork shares stay out of the child's garbage collections, which would
        # otherwise write to (and so copy) every page holding one: 27-30% less memory (PSS)
        # per concurrent job at 256-way (docs/PERFORMANCE.md).
        gc.freeze()
        self.proc.start()
        theirs.close()
        # Ours never blocks: a child busy in a long job reads nothing, and jobs sent ahead with
        # big arguments must not stop our heartbeats until it is done (flush() keeps the rest).
        os.set_blocking(self.conn.fileno(), False)
        self.pid: int = self.proc.pid  # type: ignore[assignment]
        self.jobs: deque[Delivery] = deque()  # sent to it, in order; jobs[0] runs (a loop child: those begun)
        self.last_began: float | None = None  # a loop child: when it last said it began a job
        self.seq = 0
        self.outgoing = bytearray()  # frames for it that flush() could not write yet
        self.reader = frames.Reader(self.conn.fileno())
        self.kill_target: Delivery | None = None
        self.kill_reason: str | None = None
        self.kill_at: float | None = None
        self.done = 0  # jobs it answered
        self.max_jobs = max_jobs  # then it is replaced (recycling)
        self.retiring: str | None = None  # why it is being replaced (recycling): it takes no more jobs

    @property
    def open(self) -> bool:
        """Takes more jobs: not being stopped nor replaced."""
        return self.kill_reason is None and self.retiring is None

    @property
    def left(self) -> float:
        """Jobs it may still be sent: inf, unless it is replaced after max_jobs."""
        return float("inf") if self.max_jobs is None else self.max_jobs - self.done - len(self.jobs)

    def retire(self) -> None:
        """It has no jobs left and is being replaced: close our end; it exits on EOF
        (after its child_stop hooks), and its exit is handled as any."""
        self.conn.close()

    def send(self, d: Delivery, message: bytes, now: float) -> None:
        """Queue a job for the child (flush() writes what is queued, in one go)."""
        self.seq += 1
        d.seq = self.seq
        if not self.jobs and not self.concurrent:
            d.began = now
        self.jobs.append(d)
        self.outgoing += frames.frame(b"%d\0%s" % (d.seq, message))

    def flush(self) -> None:
        """Write what the pipe takes now; the rest waits for the next call."""
        try:
            while self.outgoing:
                del self.outgoing[:os.write(self.conn.fileno(), self.outgoing)]
        except BlockingIOError:
            pass  # the pipe is full: the child is busy
        except OSError:
            self.outgoing.clear()  # it died; its sentinel tells us

    def replies(self) -> list[bytes] | None:
        """The answers that have arrived whole (call when the pipe is readable); None once
        the child's end is closed."""
        try:
            return self.reader.read()
        except BlockingIOError:
            return []
        except OSError:
            return None

    def take_back(self) -> list[Delivery]:
        """The jobs sent ahead that the child has not begun: it will skip them, and they
        are ours to hand back. Works while the child is busy in a job."""
        if not self.lock.acquire(timeout=0.05):
            return []  # it was SIGKILLed holding the lock; its exit is handled next
        try:
            state = self.state
            rest = [d for d in self.jobs if d.seq > state[0]]
            if rest:
                # A range it has not skipped through yet stays in (it is contiguous with ours).
                state[1] = state[1] if state[2] > state[0] else rest[0].seq
                state[2] = rest[-1].seq
        finally:
            self.lock.release()
        for d in rest:
            self.jobs.remove(d)
        return rest

    def cancel(self, d: Delivery, reason: str, grace: float) -> None:
        """A loop child: stop one job (a coroutine is cancelled; one not begun is not run);
        if it has not answered by d.stop_at, the worker stops the child."""
        if d.stop_reason is None:
            d.stop_reason, d.stop_at = reason, time.monotonic() + grace
            self.outgoing += frames.frame(b"c%d\0%s" % (d.seq, reason.encode()))
            self.flush()

    def kill(self, target: Delivery, reason: str, grace: float) -> None:
        """SIGTERM now (the child honours it because the flag is set), SIGKILL at kill_at.
        The child is our unreaped child, so its PID cannot have been recycled."""
        if self.kill_reason is None:
            self.kill_target, self.kill_reason = target, reason
            self.kill_flag.value = 1
            self.kill_at = time.monotonic() + grace
            send_signal(self.pid, signal.SIGTERM)


def wait_ready(objects: list[Any], timeout: float, writers: Iterable[Any] = ()) -> list[Any]:
    """The objects (file descriptors, or with a fileno()) that are readable or closed, and
    the `writers` that can be written to, waiting up to timeout seconds: multiprocessing's
    wait() builds a selector each call."""
    fds: dict[int, Any] = {}
    masks: dict[int, int] = {}
    for o, mask in [*((o, select.POLLIN) for o in objects), *((o, select.POLLOUT) for o in writers)]:
        fd = o if isinstance(o, int) else o.fileno()
        fds[fd] = o
        masks[fd] = masks.get(fd, 0) | mask
    poll = select.poll()
    for fd, mask in masks.items():
        poll.register(fd, mask)
    return [fds[fd] for fd, _ in poll.poll(timeout * 1000)]


def send_signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass
