"""Who holds which running job, and letting go of deliveries whose holder is gone. One
place for the dispatcher (dead workers, harvest) and the worker (its own orphans)."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

import psutil

from taskrunner.protocol import codec, scripts

if TYPE_CHECKING:
    from taskrunner.client.app import TaskRunner


@dataclass(frozen=True)
class Holding:
    """A holding entry (docs/PROTOCOL.md, `p running`): who runs a job, and since when. Any
    client may have written it, so it is read defensively: one that is not an entry is
    None (never an exception: it must not stop a dispatcher or a page)."""

    worker: str
    attempt: int
    host: str | None = None
    ip: str | None = None
    pid: float | None = None
    started_at: float = 0
    max_duration: float = 0
    ahead: float = 0  # seconds of work before it in a worker's prefetch

    @classmethod
    def parse(cls, raw: str) -> Holding | None:
        """The entry; None when it is not one (not a JSON object, or no worker name and
        integer attempt: nobody could be told to stop the job). Other fields of the wrong
        type read as absent."""
        try:
            e = codec.loads(raw)
        except ValueError:
            return None
        if not isinstance(e, dict):
            return None
        worker, attempt = e.get("worker"), e.get("attempt")
        if not isinstance(worker, str) or isinstance(attempt, bool) or not isinstance(attempt, int):
            return None
        host, ip = (v if isinstance(v, str) else None for v in (e.get("host"), e.get("ip")))
        return cls(worker, attempt, host, ip, number(e.get("pid")), number(e.get("started_at")) or 0,
                   number(e.get("max_duration")) or 0, number(e.get("ahead")) or 0)


def number(value: Any) -> float | int | None:
    """value when it is a JSON number, else None (a bool is not one)."""
    return value if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def pid_namespace() -> str:
    """Identifies the PID namespace, so PIDs are only compared where they mean the same."""
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return ""


def boot_id() -> str:
    """Identifies this machine's running kernel (a new one at each boot): unlike the host
    name, two machines never share it, and unlike the PID namespace's id (the first
    namespace has the same one everywhere), it tells machines apart."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""


def process_gone(pid: int) -> bool:
    """No process has this PID on this machine (in our PID namespace), or only its zombie."""
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True
    except psutil.Error:  # e.g. access denied: it exists
        return False


def identity() -> dict[str, str]:
    """The fields of a heartbeat's info that let a dispatcher on the same machine (same
    boot, same PID namespace) see at once that the process is gone (docs/PROTOCOL.md,
    Liveness)."""
    return {"pidns": pid_namespace(), "boot_id": boot_id()}


class Lost(NamedTuple):
    """A delivery lose.lua acted on: the job's new state (pending, failed, killed), and the
    worker ("" when unknown) and attempt it was lost from, to log it by."""

    queue: str
    id: str
    state: str
    worker: str
    attempt: str


def lose(app: TaskRunner, queue: str, values: list[Any], workers: list[str] | None = None) -> list[Lost]:
    """lose.lua on deliveries (id, attempt, reason, owner per job; fenced); each it acted
    on. `workers`: who held each (default: the owners given)."""
    if not values:
        return []
    states = scripts.LOSE(app.redis, [app.keys.q(queue)], [app.settings.failed_ttl, *values])
    return [Lost(queue, job_id, state, worker, attempt) for job_id, attempt, worker, state
            in zip(values[::4], values[1::4], values[3::4] if workers is None else workers, states) if state]


def held(app: TaskRunner, queues: list[str]) -> list[tuple[str, str, str, str]]:
    """(queue, id, worker, attempt) of every delivery in the queues' holding hashes (one
    round trip); entries that are not holding entries are left out (the dispatcher
    requeues those at their deadline)."""
    pipe = app.redis.pipeline(transaction=False)
    for q in queues:
        pipe.hgetall(app.keys.q(q) + "running")
    out = []
    for q, running in zip(queues, pipe.execute()):
        for job_id, raw in running.items():
            if (h := Holding.parse(raw)) is not None:
                out.append((q, job_id, h.worker, str(h.attempt)))
    return out


def lose_held(app: TaskRunner, queues: list[str], gone: Callable[[str, str], bool],
              why: str) -> list[Lost]:
    """Lose, fenced by owner and delivery, every running job for which gone(worker, id) is
    true; `why` is formatted with the worker's name. Returns those it acted on."""
    by_queue: dict[str, list[Any]] = {q: [] for q in queues}
    for q, job_id, worker, attempt in held(app, queues):
        if gone(worker, job_id):
            by_queue[q] += [job_id, attempt, why.format(worker), worker]
    return [lost for q, values in by_queue.items() for lost in lose(app, q, values)]
