"""A worker's crew: its child processes and what it does with them — start and replace
them, send them the jobs it claimed, read their answers and reports, stop a job (cancel a
coroutine, or stop the child after handing its other jobs back), enforce max durations
and the shutdown grace, recycle them. What comes of each job goes into the worker's
outbox; the worker does the talking to Redis."""

from __future__ import annotations

import inspect
import logging
import signal
import time
from typing import Any

import psutil

from taskrunner.client.app import TaskRunner
from taskrunner.logs import job_fields
from taskrunner.protocol import codec
from taskrunner.protocol.claims import Delivery
from taskrunner.protocol.outcome import Outcome
from taskrunner.worker import child, policy
from taskrunner.worker.children import Child, send_signal
from taskrunner.worker.loop_child import stopped
from taskrunner.worker.outbox import Outbox

log = logging.getLogger("taskrunner.worker")


class Crew:
    def __init__(self, app: TaskRunner, outbox: Outbox, name: str, host: str, concurrency: int, threads: int = 1,
                 async_slots: int = 0, max_jobs_per_child: int | None = None,
                 max_memory_per_child: float | None = None) -> None:
        self.app, self.outbox, self.name, self.host = app, outbox, name, host
        self.concurrency, self.threads, self.async_slots = concurrency, threads, async_slots
        self.max_jobs_per_child, self.max_memory_per_child = max_jobs_per_child, max_memory_per_child
        self.kill_grace = app.settings.kill_grace
        self.children: list[Child] = []
        self.runtime: float | None = None  # moving average of job runtimes, s
        # Jobs that ended here as ours, their outcome reported (the heartbeat's `processed`):
        # not one that ended here no longer ours (stop()), which counts where it ran again
        # (counted here too, one job counted twice in the workers' totals). Its child's `done`
        # counts it: the child ran it (recycling).
        self.processed = 0

    # -- lifecycle ---------------------------------------------------------------------

    def start(self) -> None:
        for _ in range(self.concurrency):  # one by one: each closes its elder siblings' pipe ends
            self.children.append(self._spawn())

    def close(self) -> None:
        """Let each child exit (it does on EOF), killing one that will not within 2 s."""
        for c in self.children:
            c.conn.close()
        for c in self.children:
            c.proc.join(2)
            if c.proc.is_alive():
                c.proc.kill()
                c.proc.join()

    def _spawn(self) -> Child:
        return Child(self.app, self.children, self.max_jobs_per_child, self.threads, self.async_slots)

    # -- what it holds -----------------------------------------------------------------

    def held(self) -> list[tuple[Child, Delivery]]:
        return [(c, d) for c in self.children for d in c.jobs]

    def deliveries(self) -> set[tuple[str, str]]:
        """The deliveries (id, attempt) we run, for reconciling: not one that runs on here no
        longer ours (stop()); and by attempt, as a delivery Redis gives us of a job a child
        runs an earlier attempt of (a claim whose answer never came, before the heartbeat
        found the earlier one lost) is none of ours."""
        return {(d.id, d.attempt) for c in self.children for d in c.jobs if d.stop_reason != "lost"}

    def busy(self) -> int:
        """Children with jobs, one that runs on here no longer ours (stop()) included: the
        child is not idle, nor the worker drained (a shutdown waits for it, up to the grace).
        The heartbeat's `running` lists the deliveries we hold, which leaves that one out:
        its job's record names where it runs again."""
        return sum(1 for c in self.children if c.jobs)

    def usage(self) -> tuple[int, float, dict[int, int]]:
        """RSS (bytes) and CPU (%) of the children, and each child's RSS by PID, for
        heartbeats (the dashboard's worker page)."""
        for pid in set(_procs) - {c.pid for c in self.children}:
            del _procs[pid]
        rss, cpu, each = 0, 0.0, {}
        for c in self.children:
            p = _proc(c.pid)
            try:
                if p is not None:
                    each[c.pid] = p.memory_info().rss
                    rss += each[c.pid]
                    cpu += p.cpu_percent(None)
            except psutil.Error:
                pass
        return rss, cpu, each

    # -- jobs in -----------------------------------------------------------------------

    def deliver(self, slots: list[tuple[Child, float]], claimed: list[Delivery]) -> None:
        """Send claimed jobs to the children they were claimed for; a child that died while
        the claim was in flight never got its jobs, so they go back, next in line."""
        now = time.monotonic()
        alive = set(self.children)
        for (c, _), d in zip(slots, claimed):
            if c in alive:
                c.send(d, child.message(d.id, d.attempt, d.task, d.queue, str(d.max_duration), d.args_json,
                                        d.kwargs_json, d.headers_json, d.soft_limit), now)
            else:
                self.outbox.report(d, Outcome.returned(f"its process died on {self.host} before it got it"))
        for c in {c for c, _ in slots}:
            c.flush()

    # -- answers out -------------------------------------------------------------------

    def read(self, c: Child) -> bool:
        """Every answer the child has written (it may have run several jobs meanwhile);
        False once its pipe is closed."""
        replies = c.replies()
        if replies is None:
            return False
        now = time.monotonic()
        for raw in replies:
            try:
                reply = codec.loads(raw)
                if isinstance(reply, dict):  # a running job's progress or log line
                    self._note(c, reply, now)
                    continue
                job_id, attempt = str(reply[0]), str(reply[1])
                runtime, outcome = float(reply[2]), Outcome.from_wire(reply[3:])
            except (ValueError, TypeError, IndexError, KeyError):
                log.warning("worker %s: child %d wrote a malformed answer: %r", self.name, c.pid, raw[:200])
                continue
            head = c.jobs[0] if c.jobs else None
            d = head if head is not None and head.id == job_id and head.attempt == attempt else next(
                (d for d in c.jobs if d.id == job_id and d.attempt == attempt), None)
            if d is None:
                log.warning("worker %s: child %d answered for a job it was not given: %r", self.name, c.pid,
                            reply[:4])
                continue
            c.jobs.remove(d)
            if d.stop_reason == "lost":
                # Requeued while it ran (stop(): a thread that ran on, a coroutine cancelled):
                # not ours to report (Redis would refuse it: the fence). Its slot is free again.
                log.info("worker %s: job %s, no longer ours, ended here; its outcome (%s) was not reported",
                         self.name, d.id, outcome.kind, extra=job_fields(d, self.name))
                c.done += 1
                continue
            if d is c.kill_target and outcome.kind == "killed" and not c.concurrent:
                # A job we were stopping canceled its Spark job group and ended (a classic
                # child says so; spark_session.py): it ends as what we stopped it for, and its
                # child goes on.
                reason, c.kill_target, c.kill_reason, c.kill_at = c.kill_reason, None, None, None
                c.kill_flag.value = 0
                stop = _stopped(reason or "killed", "its Spark job group was canceled")
                if stop is None:
                    continue  # no longer ours to report
                outcome = stop
            if outcome.kind in ("failed", "error"):
                self._raised(d, outcome)
            self.runtime = runtime if self.runtime is None else 0.8 * self.runtime + 0.2 * runtime
            self.outbox.report(d, outcome, now - runtime, now)
            self.processed += 1
            c.done += 1
            if c.jobs and c.jobs[0].began is None and not c.concurrent:
                c.jobs[0].began = now
        if replies and (self.max_jobs_per_child or self.max_memory_per_child):
            self._recycle(c)
        return True

    def _raised(self, d: Delivery, outcome: Outcome) -> None:
        """Log a run that ended in an exception (the job's record keeps its traceback; in
        JSON logs it is the `exc` field too): an error when nothing retries it (outcome
        failed: Reject, retry_on, ...), a warning when its job is retried while retries last
        (outcome error: finish.lua decides, later, from the record's failures, which the
        worker does not read; the run that spends the last retry is a warning too)."""
        failed = outcome.kind == "failed"
        log.log(logging.ERROR if failed else logging.WARNING, "worker %s: job %s (%s) %s %s: %s", self.name, d.id,
                d.task, "failed:" if failed else "raised", outcome.error_type, outcome.message,
                extra={**job_fields(d, self.name), **({"exc": outcome.v3} if outcome.v3 else {})})

    def _note(self, c: Child, message: dict[str, Any], now: float) -> None:
        """Keep a report about a job the child runs, for the next sync; a loop child's
        word that it began one."""
        if "began" in message:
            seq = message["began"]  # from the newest: fewer wait behind it than run before it
            d = next((d for d in reversed(c.jobs) if d.seq <= seq), None)
            d = d if d is not None and d.seq == seq else None
            if d is not None:
                d.began = c.last_began = now
                if d.stop_reason == "lost" and not self._is_async(d):
                    # Found no longer ours before its "began" was read (stop() sent a cancel):
                    # a thread's job runs on, as stop() leaves one it knew begun; its cancel's
                    # grace stopped the child, the jobs beside it requeued.
                    d.stop_at = None
            return
        job_id, attempt = next(iter(message.values()))[:2]
        d = next((d for d in c.jobs if d.id == job_id and d.attempt == attempt), None)
        if d is None or not self.outbox.note(d, message, now):
            log.warning("worker %s: child %d wrote a malformed report: %.200r", self.name, c.pid, message)

    def _recycle(self, c: Child) -> None:
        """A child past --max-jobs-per-child or --max-memory-per-child (RSS, measured after
        its jobs) takes no more jobs, finishes those it has, and is then replaced: nothing
        is lost, handed back or counted."""
        if c.open:
            rss = None
            if self.max_memory_per_child is not None:
                try:
                    rss = _proc(c.pid).memory_info().rss  # type: ignore[union-attr]
                except (psutil.Error, AttributeError):
                    pass
            c.retiring = policy.retire_reason(c.done, rss, self.max_jobs_per_child, self.max_memory_per_child)
            if c.retiring:
                log.info("worker %s: replacing child %d: %s", self.name, c.pid, c.retiring)
        if c.retiring is not None and not c.jobs and not c.conn.closed:
            c.retire()

    def exited(self, c: Child, replace: bool) -> None:
        """A child is gone: report each of its jobs as what it was (not begun: returned; one
        we stopped: as why we did; a sibling of it: requeued; one no longer ours: nothing;
        else lost), and put a new child in its place unless the worker stops."""
        while not c.conn.closed and c.conn.poll() and self.read(c):  # what it wrote before it died (poll: a process
            pass  # it forked may hold its end of the pipe open)
        c.proc.join()
        code = c.proc.exitcode
        why = ended_by(code, c.kill_reason is not None)  # signalled by the worker (a loop child's cancel is a message)
        began = c.state[0]  # it is gone: no lock needed
        report, now = self.outbox.report, time.monotonic()  # what ran ended by now
        for d in c.jobs:
            if d.stop_reason == "lost":
                continue  # no longer ours (stop()): not ours to report, whatever stopped it
            if d.seq > began:
                report(d, Outcome.returned(f"its process died ({why}) on {self.host}"))
            elif (reason := c.kill_reason if d is c.kill_target else d.stop_reason) is not None:
                if (stop := _stopped(reason, f"stopped by {why}")) is not None:
                    report(d, stop, d.began, now)
            elif c.kill_reason is not None:
                # It ran beside (a loop child) or after the job we stopped: requeued, nothing counted.
                report(d, Outcome.requeue(front=True, why=f"its process was stopped ({c.kill_reason}) on "
                                                          f"{self.host}"), d.began, now)
            else:
                log.warning("worker %s: child %d died (%s) running job %s", self.name, c.pid, why, d.id,
                            extra=job_fields(d, self.name))
                report(d, Outcome.lost(f"child process died ({why}) on {self.host}"), d.began, now)
        c.jobs.clear()
        self.children.remove(c)
        c.conn.close()
        if replace:
            self.children.append(self._spawn())

    # -- stopping jobs -----------------------------------------------------------------

    def enforce(self, now: float, stopping: bool, stop_at: float) -> None:
        """Time limits, the shutdown grace, retiring children, hand-backs: what is due now."""
        for c in self.children:
            if c.retiring is not None and not c.jobs and not c.conn.closed:
                c.retire()  # what it had left was handed back
            if c.kill_at is not None and now >= c.kill_at:
                send_signal(c.pid, signal.SIGKILL)
                c.kill_at = None
            if not c.jobs:
                continue
            head = c.jobs[0]
            if stopping and now >= stop_at:
                if c.kill_reason is None:  # said once per child: kill() acts once
                    for d in policy.running(c):
                        if d.began is not None:
                            log.warning("worker %s: job %s still running when the shutdown grace ended: stopping it; "
                                        + ("it is no longer ours (requeued while it ran here): nothing "
                                           "is reported for it" if d.stop_reason == "lost" else
                                           "it goes back in line (a requeue, not a failure)"), self.name, d.id,
                                        extra=job_fields(d, self.name))
                c.kill(head, "shutdown", self.kill_grace)
            for d in policy.running(c):
                if d.began is None:
                    continue
                if now >= d.deadline and not d.stuck:
                    d.stuck = True
                    lost = d.stop_reason == "lost"
                    if not lost:  # one no longer ours: stuck.lua is fenced, and its record is another run's
                        self.outbox.mark_stuck(d)
                    if d.timeout_policy == "kill":
                        log.warning("worker %s: job %s passed its max duration; stopping it", self.name, d.id,
                                    extra=job_fields(d, self.name))
                        self.stop(c, d, "timeout")
                    else:
                        # One no longer ours too: stopping its child would stop the jobs beside it,
                        # which count, for one that does not; it holds its thread as it would have.
                        log.warning("worker %s: job %s passed its max duration; %s left running (timeout_policy "
                                    "flag)", self.name, d.id, "no longer ours, not flagged:" if lost else
                                    "flagged stuck and", extra=job_fields(d, self.name))
                if d.stop_at is not None and now >= d.stop_at:
                    log.warning("worker %s: job %s did not stop within kill_grace; stopping child %d", self.name,
                                d.id, c.pid, extra=job_fields(d, self.name))
                    d.stop_at = None
                    self.stop(c, d, d.stop_reason or "killed", whole=True)
            if now >= policy.hand_back_due(c, stopping):
                self._hand_back(c, "worker shutting down" if stopping else
                                f"the jobs ahead of it in child {c.pid} ran long" if c.concurrent else
                                f"job {head.id} ahead of it ran long")

    def kill_request(self, job_id: str, attempt: str, reason: str) -> bool:
        """Stop the delivery (job, attempt) if one of ours runs it; False if none does."""
        for c in self.children:
            for d in list(c.jobs):
                if d.id == job_id and d.attempt == attempt:
                    if d.stop_reason == "lost":
                        # A request naming a delivery the heartbeat found requeued: nothing to
                        # stop (a thread's job runs on: stop()), and stopping its child for it
                        # stopped the jobs beside it.
                        log.info("worker %s: not killing job %s (%s): no longer ours", self.name, job_id, reason,
                                 extra=job_fields(d, self.name))
                        return True
                    log.info("worker %s: killing job %s in child %d (%s)", self.name, job_id, c.pid, reason,
                             extra=job_fields(d, self.name))
                    self.stop(c, d, reason)
                    return True
        return False

    def stop(self, c: Child, d: Delivery, reason: str, whole: bool = False) -> bool:
        """Stop a job (reason: killed, timeout, or lost: no longer ours). A loop child
        cancels a coroutine, or a job not begun, and goes on; otherwise (a thread, a classic
        child, or `whole`) the child is stopped, after what it has not begun is handed back.
        Except a thread's job that is no longer ours (requeued while it ran): a thread cannot
        be stopped, and stopping its child for it stopped the jobs running beside it, which
        then ran again. It runs on, its outcome not reported (read()), and its slot comes back
        when it ends; at its max duration it is stopped as any thread's job (enforce()).
        False for that one, left running; True when the job is being stopped (or, for one
        whose "began" we had not read, cancelled: a thread's job runs on all the same, _note())."""
        if c.concurrent and not whole and (d.began is None or self._is_async(d)):
            c.cancel(d, reason, self.kill_grace)
            return True
        if c.concurrent and not whole and reason == "lost":
            d.stop_reason = reason
            return False
        self._hand_back(c, f"job {d.id} sent with it was " + ("lost" if reason == "lost" else "killed"),
                        killed=None if reason == "lost" else d, lost=d if reason == "lost" else None)
        if d in c.jobs:  # it had begun
            c.kill(d, reason, self.kill_grace)
        return True

    def _hand_back(self, c: Child, why: str, killed: Delivery | None = None, lost: Delivery | None = None) -> None:
        """Take back what the child has not begun: to the queue, next in line (a job to
        kill ends killed, as does one a loop child was asked to stop and had not answered
        for yet; one no longer ours is not ours to report)."""
        for d in c.take_back():
            reason = "killed" if d is killed else d.stop_reason
            if d is lost or reason == "lost":
                continue
            self.outbox.report(d, Outcome.returned(why) if reason is None else stopped(reason, False))

    def _is_async(self, d: Delivery) -> bool:
        task = self.app.tasks.get(d.task)
        return task is not None and inspect.iscoroutinefunction(task.fn)


def ended_by(code: int | None, stopped: bool = False) -> str:
    """What ended a child of exit status `code`, for a job's error and the log: the signal
    that killed it (a negative code); for a child the worker `stopped`, the signal 128 + N
    names (it exits 143 after its SIGTERM's finally blocks ran: "exit code 143" hid that a
    SIGTERM stopped it); else the exit code — a child's own os._exit(137) is not a SIGKILL
    (the OOM killer's, as it read)."""
    if code is not None and (code < 0 or stopped and 128 < code < 128 + signal.NSIG):
        try:
            return f"signal {signal.Signals(abs(code) if code < 0 else code - 128).name}"
        except ValueError:  # no signal of that number here
            pass
    return f"exit code {code}"


def _stopped(reason: str, how: str) -> Outcome | None:
    """How a job we stopped for `reason` ends (`how`: what stopped it); None for "lost": no
    longer ours to report."""
    if reason == "killed":
        return Outcome.killed("killed on request")
    if reason == "timeout":
        return Outcome.error("TimeLimitExceeded", f"ran past its max duration; {how}")
    if reason == "shutdown":
        return Outcome.requeue(front=True)
    return None


_procs: dict[int, psutil.Process] = {}


def _proc(pid: int) -> psutil.Process | None:
    """psutil handles are cached so that cpu_percent measures since the last beat."""
    if pid not in _procs:
        try:
            _procs[pid] = psutil.Process(pid)
        except psutil.Error:
            return None
    return _procs[pid]
