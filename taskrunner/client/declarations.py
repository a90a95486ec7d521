"""Task declarations in Redis: each task's queue and job settings, published by every
worker for the tasks of its app, so that a producer that does not import the app (the CLI
without -A, a program in another language) still gets them: the enqueue script fills in
every setting a producer did not send from the declaration.

Layout (docs/PROTOCOL.md, "Task declarations"): `P:{Q}:tasks`, a hash task -> JSON, in the
slot of every queue a declaring worker serves and of the task's own queue (enqueue.lua
reads it there, in the queue's slot), and the global index `P:{_}:tasks`, the same JSON,
for listing tasks and finding a task's queue. A worker writes its declarations when it
starts (HSET: the worker started last wins, as in a rolling deploy) and puts back the ones
that went missing every REFRESH seconds (HSETNX: it never undoes a newer worker's)."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from taskrunner.client import arguments
from taskrunner.protocol import codec

if TYPE_CHECKING:
    from taskrunner.client.app import Task, TaskRunner

#: Seconds between a worker's checks that its declarations are still there.
REFRESH = 60.0
#: Seconds a producer keeps a declaration it looked up.
KEEP = 10.0


def declaration(app: TaskRunner, task: Task, worker: str, at: float) -> dict[str, Any]:
    """What a worker publishes for one task: its settings with this worker's defaults
    filled in (the ones its jobs would get from it), who published it and when. The
    retry backoff cap and the TTLs only when the task sets them (null: the settings of
    whichever process ends the job, as for a job of a producer that knows the task).
    `params`, the function's parameters, for producers to check a job's arguments
    (arguments.params), unless the task has check_args=False or no readable signature."""
    s = task.spec
    shape = task.shape
    return {"task": task.name, "queue": s.queue, "max_duration": s.max_duration or app.settings.max_duration,
            "retries": s.retries, "retry_backoff": s.retry_backoff, "timeout_policy": s.timeout_policy,
            "max_lost": s.max_lost or app.settings.max_lost, "max_retries": s.max_retries,
            "retry_backoff_max": s.retry_backoff_max, "result_ttl": s.result_ttl, "failed_ttl": s.failed_ttl,
            "soft_limit": s.soft_limit, "rate_limit": s.rate_limit, "max_concurrency": s.max_concurrency,
            "worker": worker, "declared_at": at,
            **({"params": arguments.params(shape.signature)} if shape is not None else {})}


def publish(app: TaskRunner, queues: list[str], worker: str, at: float, overwrite: bool = True) -> None:
    """Write the declarations of the app's tasks: into the global index and the tasks hash
    of each queue served and of each task's queue. Without `overwrite`, only those missing."""
    pipe = publish_in(app.redis.pipeline(transaction=False), app, queues, worker, at, overwrite)
    if len(pipe):
        pipe.execute()


def publish_in(pipe: Any, app: TaskRunner, queues: list[str], worker: str, at: float, overwrite: bool = True) -> Any:
    """publish()'s commands, added to `pipe` (returned): for a worker that sends them
    without waiting on the answers (none, with no tasks)."""
    if not app.tasks:
        return pipe
    decls = {name: codec.dumps(declaration(app, t, worker, at)) for name, t in app.tasks.items()}
    targets = [app.keys.tasks] + [app.keys.q(q) + "tasks" for q in
                                  dict.fromkeys([*queues, *(t.spec.queue for t in app.tasks.values())])]
    for key in targets:
        if overwrite:
            pipe.hset(key, mapping=decls)
        else:
            for name, raw in decls.items():
                pipe.hsetnx(key, name, raw)
    return pipe


def parse(name: str, raw: str | None) -> dict[str, Any] | None:
    """A declaration as stored, or None if there is none or it is not a JSON object."""
    try:
        d = codec.loads(raw) if raw else None
    except ValueError:
        return None
    return {**d, "task": name} if isinstance(d, dict) else None


def known(app: TaskRunner) -> list[dict[str, Any]]:
    """Every declared task, by name."""
    found = (parse(name, raw) for name, raw in sorted(app.redis.hgetall(app.keys.tasks).items()))
    return [d for d in found if d is not None]


class Cache:
    """The declarations a producer looked up, each kept KEEP seconds: a producer that
    enqueues by name a task it does not import asks Redis for the task's queue once in a
    while, not per job (a deploy that changes it is seen within KEEP seconds)."""

    def __init__(self) -> None:
        self._found: dict[str, tuple[float, dict[str, Any] | None]] = {}

    def get(self, task: str) -> tuple[bool, dict[str, Any] | None]:
        """(True, the declaration or None) if looked up less than KEEP s ago, else (False, None)."""
        hit = self._found.get(task)
        return (True, hit[1]) if hit is not None and hit[0] > time.monotonic() else (False, None)

    def put(self, task: str, declared: dict[str, Any] | None) -> dict[str, Any] | None:
        self._found[task] = (time.monotonic() + KEEP, declared)
        return declared
