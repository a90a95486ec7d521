"""Who holds which running job, and letting go of deliveries whose holder is gone. One
place for the dispatcher (dead workers, harvest) and the worker (its own orphans)."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from . import codec, scripts

if TYPE_CHECKING:
    from .app import TaskRunner


def pid_namespace() -> str:
    """Identifies the PID namespace, so PIDs are only compared where they mean the same."""
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return ""


def lose(app: TaskRunner, queue: str, values: list[Any]) -> list[tuple[str, str]]:
    """lose.lua on deliveries (id, attempt, reason, owner per job; fenced); returns
    (id, new state) for each it acted on."""
    if not values:
        return []
    states = scripts.LOSE(app.redis, [app.keys.q(queue)], [app.settings.result_ttl, *values])
    return [(job_id, state) for job_id, state in zip(values[::4], states) if state]


def lose_held(app: TaskRunner, queues: list[str], gone: Callable[[str, str], bool],
              why: str) -> list[tuple[str, str, str]]:
    """Lose, fenced by owner and delivery, every running job for which gone(worker, id) is
    true; `why` is formatted with the worker's name. Returns (queue, id, new state)."""
    pipe = app.redis.pipeline(transaction=False)
    for q in queues:
        pipe.hgetall(app.keys.q(q) + "running")
    acted = []
    for q, running in zip(queues, pipe.execute()):
        values: list[Any] = []
        for job_id, raw in running.items():
            try:
                entry = codec.loads(raw)
                worker, attempt = entry["worker"], str(entry["attempt"])
            except (ValueError, KeyError, TypeError):
                continue
            if gone(worker, job_id):
                values += [job_id, attempt, why.format(worker), worker]
        acted += [(q, job_id, state) for job_id, state in lose(app, q, values)]
    return acted
