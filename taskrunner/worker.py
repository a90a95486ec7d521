"""The worker: one main process that claims jobs from Redis and runs each in one of N
long-lived child processes.

The main process never runs a job, so its heartbeats go on whatever a job does. It
waits on everything at once with one select: the children's pipes and exit sentinels,
and two connections each with a BRPOP outstanding: its control list (kill requests) and,
when a child is idle and the queues were found empty, the queues' wake lists. No threads
(the worker forks replacement children) and no polling."""

from __future__ import annotations

import logging
import multiprocessing
import os
import signal
import socket
import time
from dataclasses import dataclass
from multiprocessing.connection import wait
from typing import Any

import psutil
import redis

from . import codec, scripts
from .app import TaskRunner
from .child import child_main
from .consumer import claim_args
from .holders import lose_held, pid_namespace
from .listing import server_time

log = logging.getLogger("taskrunner.worker")
_ctx = multiprocessing.get_context("fork")
# Any Redis failure (down, OOM, READONLY after a failover, BUSY) means: back off, retry.
# Retrying is safe: finishes are idempotent and a claim without an answer is reconciled.
_REDIS_ERRORS = (redis.RedisError,)


@dataclass
class Delivery:
    """A job a child is running: what the claim handed us."""

    id: str
    attempt: str
    queue: str
    deadline: float  # monotonic
    policy: str
    stuck: bool = False


class Child:
    def __init__(self, worker: Worker) -> None:
        self.conn, theirs = _ctx.Pipe()
        self.kill_flag = _ctx.Value("b", 0, lock=False)
        # The child closes the pipe ends of ours it inherits (its siblings' and its own), so
        # that it sees EOF when we close ours.
        inherited = [c.conn for c in worker.children] + [self.conn]
        self.proc = _ctx.Process(target=child_main, name="taskrunner-child",
                                 args=(theirs, worker.app, self.kill_flag, os.getpid(), inherited))
        self.proc.start()
        theirs.close()
        self.pid: int = self.proc.pid  # type: ignore[assignment]
        self.job: Delivery | None = None
        self.kill_reason: str | None = None
        self.kill_at: float | None = None

    @property
    def idle(self) -> bool:
        return self.job is None and self.kill_reason is None

    def kill(self, reason: str, grace: float) -> None:
        """SIGTERM now (the child honours it because the flag is set), SIGKILL at kill_at.
        The child is our unreaped child, so its PID cannot have been recycled."""
        if self.kill_reason is None:
            self.kill_reason = reason
            self.kill_flag.value = 1
            self.kill_at = time.monotonic() + grace
            _signal(self.pid, signal.SIGTERM)


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


class Blocker:
    """One BRPOP outstanding on a connection of its own (kept across calls, outside the
    client's pool); select() tells when it answered."""

    def __init__(self, client: redis.Redis) -> None:
        self.pool = client.connection_pool
        self.conn: Any = None
        self.armed = False

    def arm(self, keys: list[str], timeout: float) -> None:
        if not self.armed:
            if self.conn is None:
                self.conn = self.pool.connection_class(**self.pool.connection_kwargs)
            self.conn.send_command("BRPOP", *keys, timeout)
            self.armed = True

    def fileno(self) -> int:
        return self.conn._sock.fileno()

    def read(self) -> Any:
        self.armed = False
        try:
            return self.conn.read_response()
        except BaseException:
            self.reset()
            raise

    def reset(self) -> None:
        """Cancel: closing the connection ends the BRPOP on the server."""
        self.armed = False
        if self.conn is not None:
            self.conn.disconnect()
            self.conn = None


def local_ip(client: redis.Redis) -> str:
    """The address this host uses to reach Redis (what others would see)."""
    kw = client.connection_pool.connection_kwargs
    host = kw.get("host")
    if not host:
        return "127.0.0.1"
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((host, int(kw.get("port", 6379))))
            return s.getsockname()[0]
    except OSError:
        return "127.0.0.1"


class Worker:
    def __init__(self, app: TaskRunner, queues: list[str], concurrency: int = 2, name: str | None = None):
        if concurrency < 1:
            raise ValueError("concurrency must be >= 1")
        self.app, self.s, self.keys = app, app.settings, app.keys
        self.queues = [codec.check_name("queue", q) for q in queues]
        self.prefixes = [self.keys.q(q) for q in self.queues]
        self.concurrency = concurrency
        self.host = socket.gethostname()
        self.name = codec.check_name("worker", name or f"{self.host}.{os.getpid()}")
        self.redis = app.redis
        self.ip = local_ip(self.redis)
        self.children: list[Child] = []
        self.outbox: dict[str, list[Any]] = {}  # queue -> finish.lua values
        self.stuck_marks: list[tuple[str, str, str]] = []  # (queue, id, attempt)
        self.may_claim = True
        self.stopping = False
        self.stop_at = 0.0
        self.reconcile = True  # release what Redis says we hold but we do not run
        self.next_beat = 0.0
        self.redis_ok_at = 0.0  # after a Redis error, talk to it again from this time
        self.backoff = 0.0
        self.wake = Blocker(self.redis)
        self.ctl = Blocker(self.redis)
        self.proc = psutil.Process()
        self.started_at = time.time()
        self.processed = 0

    # -- lifecycle ---------------------------------------------------------------------

    def run(self) -> int:
        self._check_name_free()
        # Signals interrupt our select through this socket (select itself is restarted).
        self._wakeup, wakeup_w = socket.socketpair()
        for s in (self._wakeup, wakeup_w):
            s.setblocking(False)
        self._wakeup_w = wakeup_w  # kept open for the process's life
        signal.set_wakeup_fd(wakeup_w.fileno(), warn_on_full_buffer=False)
        signal.signal(signal.SIGTERM, self._on_signal)
        signal.signal(signal.SIGINT, self._on_signal)
        self.children = [Child(self) for _ in range(self.concurrency)]
        log.info("worker %s: queues %s, %d children, pid %d", self.name, ",".join(self.queues),
                 self.concurrency, os.getpid())
        try:
            while not (self.stopping and self._drained()):
                if self.stopping and time.monotonic() > self.stop_at + self.s.kill_grace + 10:
                    log.error("worker %s: could not report every job before exiting; the dispatcher "
                              "will requeue what is left", self.name)
                    break
                self._step()
        finally:
            self._shutdown()
        return 0

    def _check_name_free(self) -> None:
        last = self.redis.zscore(self.keys.workers, self.name)
        now = server_time(self.app)
        if last is not None and now - last < self.s.dead_after:
            raise SystemExit(f"worker name {self.name!r} is in use by a live worker (heartbeat "
                             f"{now - last:.1f}s ago); pick another with -n")
        self.redis.sadd(self.keys.queues, *self.queues)

    def _on_signal(self, signum: int, frame: Any) -> None:
        now = time.monotonic()
        if self.stopping:
            log.warning("worker %s: second signal, requeueing running jobs now", self.name)
            self.stop_at = now
        else:
            log.info("worker %s: stopping; running jobs have %.0fs to finish", self.name, self.s.shutdown_grace)
            self.stopping = True
            self.stop_at = now + self.s.shutdown_grace

    def _give_back_wake(self) -> None:
        """We may have taken a wake token we will not use: leave one for others."""
        try:
            pipe = self.redis.pipeline(transaction=False)
            for p in self.prefixes:
                pipe.lpush(p + "wake", "1").ltrim(p + "wake", 0, 0)
            pipe.execute()
        except _REDIS_ERRORS:
            pass

    def _drained(self) -> bool:
        return not any(c.job for c in self.children) and not self.outbox

    def _shutdown(self) -> None:
        signal.set_wakeup_fd(-1)
        self.wake.reset()
        self.ctl.reset()
        for c in self.children:
            c.conn.close()  # the child exits on EOF
        for c in self.children:
            c.proc.join(2)
            if c.proc.is_alive():
                c.proc.kill()
                c.proc.join()
        try:
            self._sync()
            pipe = self.redis.pipeline(transaction=False)
            pipe.zrem(self.keys.workers, self.name).delete(self.keys.worker(self.name))
            pipe.delete(self.keys.control(self.name)).execute()
        except _REDIS_ERRORS as e:
            log.error("worker %s: could not say goodbye to Redis (%s); the dispatcher will requeue "
                      "anything left", self.name, e)
        log.info("worker %s: stopped after %d jobs", self.name, self.processed)

    # -- the loop ----------------------------------------------------------------------

    def _step(self) -> None:
        now = time.monotonic()
        if self.stopping and self.wake.armed:
            self.wake.reset()
            self._give_back_wake()
        if self.stopping and now >= self.stop_at:
            for c in self.children:
                if c.job:
                    c.kill("shutdown", self.s.kill_grace)
        self._enforce(now)
        if now >= self.redis_ok_at:
            try:
                if now >= self.next_beat:
                    self._heartbeat()
                self._sync()
                self._arm()
                self.backoff = 0.0
            except _REDIS_ERRORS as e:
                self.backoff = min(max(self.backoff * 2, 0.1), 5.0)
                self.redis_ok_at = time.monotonic() + self.backoff
                self.reconcile = True  # a claim may have gone through unanswered
                self.wake.reset()
                self.ctl.reset()
                log.warning("worker %s: Redis unavailable (%s); retrying in %.1fs", self.name, e, self.backoff)
        waitables: list[Any] = [self._wakeup]
        for c in self.children:
            waitables += [c.conn, c.proc.sentinel]
        for b in (self.ctl, self.wake):
            if b.armed:
                waitables.append(b)
        for ready in wait(waitables, self._timeout()):
            self._on_ready(ready)

    def _timeout(self) -> float:
        now = time.monotonic()
        t = [self.next_beat, self.redis_ok_at if self.backoff else now + 5]
        for c in self.children:
            if c.job:
                t.append(c.job.deadline)
            if c.kill_at:
                t.append(c.kill_at)
        if self.stopping:
            t.append(self.stop_at)
        work = self.outbox or self.stuck_marks or (self.may_claim and not self.stopping
                                                   and any(c.idle for c in self.children))
        if work and now >= self.redis_ok_at:
            return 0
        return max(0.0, min(t) - now)

    def _on_ready(self, ready: Any) -> None:
        if ready is self._wakeup:
            try:
                self._wakeup.recv(512)
            except BlockingIOError:
                pass
            return
        if ready is self.ctl or ready is self.wake:
            if not ready.armed:
                return
            try:
                reply = ready.read()
            except _REDIS_ERRORS:
                return  # re-armed by the next step
            if ready is self.wake:
                self.may_claim = True
            elif reply:
                self._on_control(reply[1])
            return
        for c in self.children:
            if ready is c.conn:
                return self._read(c)
            if ready == c.proc.sentinel:
                return self._on_exit(c)

    def _arm(self) -> None:
        self.ctl.arm([self.keys.control(self.name)], self.s.idle_block)
        if not self.stopping and not self.may_claim and any(c.idle for c in self.children):
            self.wake.arm([p + "wake" for p in self.prefixes], self.s.idle_block)

    # -- children ----------------------------------------------------------------------

    def _read(self, c: Child) -> None:
        try:
            outcome = codec.loads(c.conn.recv_bytes())
        except (EOFError, OSError, ValueError):
            return  # it died mid-reply; its sentinel tells us next
        job, c.job = c.job, None
        if job is not None:
            self._report(job, outcome)
            self.processed += 1

    def _report(self, job: Delivery, outcome: list[Any]) -> None:
        self.outbox.setdefault(job.queue, []).extend([job.id, job.attempt, *outcome])

    def _on_exit(self, c: Child) -> None:
        if c.conn.poll():
            self._read(c)
        c.proc.join()
        job = c.job
        if job is not None:
            code = c.proc.exitcode
            why = f"signal {signal.Signals(-code).name}" if code and code < 0 else f"exit code {code}"
            if c.kill_reason == "killed":
                self._report(job, ["killed", "", "killed on request", "", ""])
            elif c.kill_reason == "timeout":
                self._report(job, ["error", "TimeLimitExceeded", f"ran past its max duration; stopped by {why}",
                                   "", "1"])
            elif c.kill_reason == "shutdown":
                self._report(job, ["requeue", "0", "front", "", ""])
            elif c.kill_reason != "lost":
                log.warning("worker %s: child %d died (%s) running job %s", self.name, c.pid, why, job.id)
                self._report(job, ["lost", f"child process died ({why}) on {self.host}", "", "", ""])
        self.children.remove(c)
        c.conn.close()
        if not self.stopping:
            self.children.append(Child(self))

    def _enforce(self, now: float) -> None:
        for c in self.children:
            if c.kill_at is not None and now >= c.kill_at:
                _signal(c.pid, signal.SIGKILL)
                c.kill_at = None
            job = c.job
            if job is not None and now >= job.deadline and not job.stuck:
                job.stuck = True
                self.stuck_marks.append((job.queue, job.id, job.attempt))
                if job.policy == "kill":
                    log.warning("worker %s: job %s passed its max duration; stopping it", self.name, job.id)
                    c.kill("timeout", self.s.kill_grace)

    def _on_control(self, raw: str) -> None:
        try:
            msg = codec.loads(raw)
            job_id, attempt = str(msg["kill"]), str(msg["attempt"])
            reason = "timeout" if msg.get("reason") == "timeout" else "killed"
        except (ValueError, KeyError, TypeError):
            log.warning("worker %s: ignoring malformed control message %r", self.name, raw[:200])
            return
        for c in self.children:
            if c.job and c.job.id == job_id and c.job.attempt == attempt:
                log.info("worker %s: killing job %s in child %d (%s)", self.name, job_id, c.pid, reason)
                c.kill(reason, self.s.kill_grace)
                return
        if self._reported(job_id):
            return  # it just ended; its result is on its way
        # Not ours to run, yet Redis may say we hold it (a claim whose answer was lost):
        # release it, fenced by our name and its delivery.
        self.reconcile = True

    def _reported(self, job_id: str) -> bool:
        """Is the job's outcome waiting in the outbox?"""
        return any(job_id in values[::7] for values in self.outbox.values())

    # -- Redis -------------------------------------------------------------------------

    def _sync(self) -> None:
        """Report finished jobs, mark stuck ones and claim for idle children: one round trip."""
        batch = scripts.Batch(self.redis)
        outbox = self.outbox
        for q, values in outbox.items():
            batch.call(scripts.FINISH, [self.keys.q(q)], [self.s.result_ttl, self.s.retry_backoff_max, *values])
        marks = self.stuck_marks
        for q, job_id, attempt in marks:
            batch.call(scripts.STUCK, [self.keys.q(q)],
                       [job_id, attempt, time.time() + self.s.stuck_recheck, self.s.bucket_width])
        idle = [c for c in self.children if c.idle] if self.may_claim and not self.stopping else []
        if idle:
            batch.call(scripts.CLAIM, self.prefixes,
                       claim_args(self.app, self.name, self.host, self.ip, [c.pid for c in idle]))
        results = batch.execute()
        self.outbox, self.stuck_marks = {}, []
        for values, acks in zip(outbox.values(), results):
            for job_id, ack in zip(values[::7], acks):
                if ack == 0:
                    log.warning("worker %s: job %s was requeued and taken by another worker while it ran "
                                "here; this result was discarded", self.name, job_id)
        if idle:
            claimed = results[-1]
            self._start(idle, claimed)
            if len(claimed) < 8 * len(idle):
                self.may_claim = False
        if self.reconcile:
            self._release_orphans()

    def _start(self, idle: list[Child], claimed: list[Any]) -> None:
        now = time.monotonic()
        for i in range(0, len(claimed), 8):
            qi, job_id, attempt, task, args, kwargs, md, policy = claimed[i:i + 8]
            c = idle[i // 8]
            c.job = Delivery(job_id, str(attempt), self.queues[int(qi) - 1], now + float(md), policy)
            try:
                c.conn.send_bytes(b"\0".join(s.encode() for s in (job_id, str(attempt), task, args, kwargs)))
            except OSError:
                pass  # the child died; its sentinel reports the job lost

    def _release_orphans(self) -> None:
        """Deliveries the holding lists give to us that no child of ours runs (a claim whose
        answer never came, or a previous life under the same name): requeue them."""
        mine = {c.job.id for c in self.children if c.job}
        for values in self.outbox.values():
            mine.update(values[::7])
        acted = lose_held(self.app, self.queues, lambda w, job_id: w == self.name and job_id not in mine,
                          "worker {} no longer ran it")
        if acted:
            log.warning("worker %s: released %d orphaned deliveries: %s", self.name, len(acted), acted)
        self.reconcile = False

    def _heartbeat(self) -> None:
        busy = [c for c in self.children if c.job]
        batch = scripts.Batch(self.redis)
        batch.call(scripts.HEARTBEAT, [self.keys.g], [self.name, codec.dumps(self.info(len(busy))),
                                                      int(self.s.dead_after * 3 + 60)])
        for c in busy:
            job = c.job
            batch.pipe.hmget(self.keys.job(job.queue, job.id), "attempts", "kill_requested")
            batch.pipe.hexists(self.keys.q(job.queue) + "running", job.id)
        results = batch.execute()
        self.next_beat = time.monotonic() + self.s.heartbeat
        for i, c in enumerate(busy):
            (attempts, kill_requested), held = results[1 + 2 * i], results[2 + 2 * i]
            if c.job is None or c.kill_reason:
                continue
            if attempts != c.job.attempt or not held:
                log.warning("worker %s: job %s is no longer ours (requeued while we were unreachable); "
                            "stopping it", self.name, c.job.id)
                c.kill("lost", self.s.kill_grace)
            elif kill_requested:
                c.kill("killed", self.s.kill_grace)

    def info(self, busy: int) -> dict[str, Any]:
        rss, cpu = 0, 0.0
        for pid in set(_procs) - {c.pid for c in self.children}:
            del _procs[pid]
        for p in [self.proc, *(_proc(c.pid) for c in self.children)]:
            try:
                if p is not None:
                    rss += p.memory_info().rss
                    cpu += p.cpu_percent(None)
            except psutil.Error:
                pass
        return {"name": self.name, "host": self.host, "ip": self.ip, "pid": os.getpid(),
                "create_time": self.proc.create_time(), "pidns": pid_namespace(),
                "children": [c.pid for c in self.children],
                "queues": self.queues, "concurrency": self.concurrency, "busy": busy,
                "processed": self.processed, "rss": rss, "cpu": round(cpu, 1), "started_at": self.started_at}


_procs: dict[int, psutil.Process] = {}


def _proc(pid: int) -> psutil.Process | None:
    """psutil handles are cached so that cpu_percent measures since the last beat."""
    if pid not in _procs:
        try:
            _procs[pid] = psutil.Process(pid)
        except psutil.Error:
            return None
    return _procs[pid]
