"""A handle on one job: its state, result, and the actions on it."""

from __future__ import annotations

import os
import socket
from typing import TYPE_CHECKING, Any

from redis.exceptions import ResponseError

from taskrunner.client import steps
from taskrunner.errors import JobFailed, JobNotFound, TaskRunnerError
from taskrunner.protocol import codec, scripts
from taskrunner.protocol.connection import is_cluster

if TYPE_CHECKING:
    from taskrunner.client.app import TaskRunner

STATES = ("waiting", "pending", "delayed", "running", "completed", "failed", "killed", "canceled")
# Fields holding numbers; everything else in the record is text.
_FLOATS = ("enqueued_at", "started_at", "finished_at", "due_at", "stuck_at", "kill_requested",
           "last_requeued_at", "max_duration", "retry_backoff", "retry_backoff_max", "soft_limit", "progress",
           "progress_at", "expires")
_INTS = ("attempts", "requeues", "failures", "lost", "retries", "max_lost", "pid", "logs_dropped", "max_retries",
         "retry_requests", "result_ttl", "failed_ttl", "waiting_on")


class Job:
    def __init__(self, app: TaskRunner, job_id: str, queue: str, data: dict[str, str] | None = None):
        self.app, self.id, self.queue = app, job_id, queue
        self.data: dict[str, str] = data or {}
        self.created = True

    def __repr__(self) -> str:
        return f"<Job {self.id} {self.queue} {self.data.get('state', '?')}>"

    @property
    def _prefix(self) -> str:
        return self.app.keys.q(self.queue)

    def refresh(self) -> Job:
        """Reload every field; JobNotFound if it expired or never existed."""
        data = self.app.redis.hgetall(self.app.keys.job(self.queue, self.id))
        if not data:
            raise JobNotFound(f"no job {self.id} in queue {self.queue} (never enqueued, or expired)")
        self.data = data
        return self

    @property
    def state(self) -> str:
        """The current state, read from Redis."""
        state = self.app.redis.hget(self.app.keys.job(self.queue, self.id), "state")
        if state is None:
            raise JobNotFound(f"no job {self.id} in queue {self.queue}")
        self.data["state"] = state
        return state

    @property
    def result(self) -> Any:
        raw = self.data.get("result")
        return None if raw is None else codec.loads(raw)

    def _failure(self) -> JobFailed:
        d = self.data
        return JobFailed(self.id, d.get("state", "failed"), d.get("error_type", "Error"),
                         d.get("error", ""), d.get("traceback", ""))

    def wait(self, timeout: float | None = None) -> Any:
        """Block until the job ends; return its result, or raise JobFailed (failed, killed,
        or a workflow step canceled) or Timeout. Blocks in Redis, no polling, and rides out a Redis restart or
        failover (steps.wait says how)."""
        self.data = steps.run(self.app, steps.wait(self.app, self.id, self.queue, timeout))
        if self.data.get("state") == "completed":
            return self.result
        raise self._failure()

    def kill(self, who: str | None = None) -> str:
        """Kill the job: pending, delayed or waiting ones at once; a running one is stopped
        by the worker that holds it (SIGTERM, then SIGKILL). Returns "killed" (killed by
        this call), "running" (the worker acts on the request), or, for a job that had
        already ended, "already " + its state ("already killed", "already completed",
        "already failed", "already canceled"): nothing was done, which a bare state could
        not tell from a kill now. JobNotFound when there is no such job."""
        return steps.run(self.app, steps.kill(self.app, self.id, self.queue, who or _me()))

    def timeline(self) -> list[dict[str, Any]]:
        """What happened to the job, oldest first: enqueued, each delivery (where it ran)
        and how it ended, stuck, kill requests, operators' actions."""
        d = self.data
        events: list[dict[str, Any]] = []

        def add(at: Any, event: str, **more: Any) -> None:
            t = _num(at, float) if at is not None else None
            events.append({"at": t if isinstance(t, float) else None, "event": event, **more})

        add(d.get("enqueued_at"), "enqueued")
        for k, v in d.items():
            if k.startswith("run:"):
                try:
                    run = codec.loads(v)
                except ValueError:
                    continue
                if not isinstance(run, dict):
                    continue
                add(run.get("started_at"), f"delivery {k[4:]} started", worker=run.get("worker"),
                    host=run.get("host"), ip=run.get("ip"), pid=run.get("pid"))
            elif k.startswith("end:"):
                at, _, what = v.partition(" ")
                add(at, f"delivery {k[4:]} {what}")
            elif k.startswith("action:"):
                add(k[7:], v)
        if d.get("stuck_at"):
            add(d["stuck_at"], "passed its max duration (stuck)")
        if d.get("kill_requested"):
            add(d["kill_requested"], f"kill requested by {d.get('killed_by', '?')}")
        return sorted(events, key=lambda e: (e["at"] is None, e["at"] or 0))

    def _act(self, script: scripts.Script, who: str | None, *more: str) -> str:
        before = script(self.app.redis, [self._prefix], [self.id, who or _me(), *more])
        if not before:
            raise JobNotFound(f"no job {self.id} in queue {self.queue}")
        return before

    def retry(self, who: str | None = None) -> bool:
        """Run a failed or killed job again; False when it is in another state. A workflow
        step brings back the steps its end canceled: they wait for it again (retry.lua; on a
        Redis Cluster only those of its own queue). TaskRunnerError for a step killed while
        it waited whose parent then failed (it could never run)."""
        try:
            before = self._act(scripts.RETRY, who, "" if is_cluster(self.app.redis) else "1")
        except ResponseError as e:
            if str(e).startswith("retry: "):
                raise TaskRunnerError(str(e).removeprefix("retry: ")) from None
            raise
        return before in ("failed", "killed")

    def why_not_retried(self) -> str:
        """Why retry() refused the job, read from its record now: its state, and for a
        canceled workflow step the step whose end canceled it, which can be retried and
        brings it back."""
        d = self.refresh().data
        by = (d.get("canceled_by") or "").split()
        hint = (f"; the step whose end canceled it can be (taskrunner retry {by[1]}; queue {by[0]}), which brings "
                "back the steps it canceled" if d.get("state") == "canceled" and len(by) == 2 else "")
        return f"{d.get('state')}: only failed or killed jobs can be retried{hint}"

    def requeue(self, who: str | None = None) -> bool:
        """Put a delayed or running job back in line now; False in another state."""
        return self._act(scripts.REQUEUE, who) in ("delayed", "running")

    def enqueue_now(self, who: str | None = None) -> str:
        """Make a delayed job pending now, next in line, instead of at its due time; the
        state it was in (done only when "delayed"). Atomic in requeue.lua: a job the
        dispatcher promoted meanwhile (pending), or a worker then claimed (running), is left
        as it is, so it is never put in line twice nor its run cut short."""
        return self._act(scripts.REQUEUE, who, "delayed")

    def delete(self) -> bool:
        """Delete the job unless it runs (kill it first); False when it runs. The jobs
        waiting for it, unless it had completed, end canceled."""
        return scripts.DELETE(self.app.redis, [self._prefix], [self.id, self.app.settings.failed_ttl]) not in (
            "", "running")

    def _claimed_at(self) -> float | None:
        """When a worker took the current (or last) delivery from the queue: its holding
        entry's `started_at` (run:<attempts>). The record's `started_at` is that time until
        the delivery ends, then when its child began running it (later, when the job waited
        in the worker's prefetch)."""
        try:
            run = codec.loads(self.data.get(f"run:{self.data.get('attempts')}") or "null")
            return float(run["started_at"]) if isinstance(run, dict) else None
        except (ValueError, TypeError, KeyError):
            return None

    def to_dict(self) -> dict[str, Any]:
        """Every recorded field, typed: numbers as numbers, JSON fields decoded, the
        timeline as a list."""
        out: dict[str, Any] = {"id": self.id, "queue": self.queue}
        for k, v in self.data.items():
            if k.startswith(("run:", "end:", "action:")):
                continue
            if k in ("args", "kwargs", "result", "headers"):
                try:
                    out[k] = codec.loads(v)
                except ValueError:
                    out[k] = v
            else:
                out[k] = typed(k, v)
        out["stuck"] = self.data.get("stuck") == "1"
        for k in ("parents", "children"):  # workflows: "<queue> <id> ..." as [{"queue", "id"}]
            words = self.data.get(k, "").split()
            out[k] = [{"queue": q, "id": i} for q, i in zip(words[::2], words[1::2])]
        out["claimed_at"] = self._claimed_at()
        out["logs"] = log_lines(self.data.get("logs"))
        out.setdefault("attempts", 0)
        out.setdefault("headers", {})
        out.setdefault("progress", None)
        out.setdefault("progress_note", None)
        for k in ("result", "error", "error_type", "worker", "host", "pid", "started_at", "finished_at"):
            out.setdefault(k, None)
        out.pop("bucket", None)
        out.pop("waiters", None)
        out.pop("opt", None)  # the claim's own: which optional fields to read
        out["timeline"] = self.timeline()
        return out


def log_lines(text: str | None) -> list[dict[str, Any]]:
    """The record's `logs` field as [{"t": time, "attempt": n, "line": text}], oldest first;
    a line another client wrote badly is shown as it is."""
    out = []
    for raw in (text or "").split("\n"):
        if not raw:
            continue
        try:
            t, attempt, line = codec.loads(raw)
            out.append({"t": t, "attempt": attempt, "line": line})
        except (ValueError, TypeError):
            out.append({"t": None, "attempt": None, "line": raw})
    return out


def typed(field: str, value: str | None) -> Any:
    """A record's text value as what it means: numbers for number fields."""
    if value is None:
        return None
    if field in _FLOATS:
        return _num(value, float)
    if field in _INTS:
        return _num(value, int)
    return value


def _me() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


def _num(v: str, kind: type) -> Any:
    """v as a number of that kind; v itself when it is not one (a corrupt record)."""
    try:
        return kind(float(v)) if kind is int else kind(v)
    except (ValueError, TypeError, OverflowError):
        return v
