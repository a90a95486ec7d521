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
    """A delivery lose.lua acted on: the job's new state (pending, failed, killed), the
    worker ("" when unknown) and attempt it was lost from, to log it by, and whether it may
    have begun (False: it waited in the dead process's prefetch, not counted as lost)."""

    queue: str
    id: str
    state: str
    worker: str
    attempt: str
    began: bool = True


class Held(NamedTuple):
    """A delivery in a queue's holding hash, and its entry."""

    queue: str
    id: str
    holding: Holding


def may_have_begun(losing: list[Held], seen: list[Held], serial: Callable[[Holding], bool]) -> list[bool]:
    """For each delivery of `losing` (its process is gone), whether it may have begun: only
    those count towards the job's max_lost (lose.lua's `began`), so that a worker that dies
    again and again does not fail the jobs that merely waited in its prefetch (the poison
    pill rule is for the job that kills its process). A process of a holder for which
    `serial` is true (a worker whose children run one job at a time, in the order they were
    claimed: its heartbeat's `serial`) ran the first in line of the deliveries it held: of
    those among `seen` (the holding entries read with `losing`), the one claimed first
    (`started_at`, the claim's time), and of that claim's, the first sent (the least
    `ahead`, which grows along a claim's chain). Not the least `started_at + ahead`: a later
    claim's `ahead` counts only what is left of the running job's max duration, so a job
    claimed later can have the earlier latest start. That one, and any tied with it (two
    with the same place cannot be told apart), may have begun, the others had not. Claims
    on shards in different Redis servers are ordered by their clocks: skewed by more than
    the time between two claims, the wrong one of two jobs counts (one per death, as
    before). Anything else may have: a holder not known to be serial (a loop child runs many at once; an older
    worker, a consumer), an entry without a PID or a start, or in a process whose entries
    lack one (the order is unknown). Caveat: a job that ended within the worker's last
    moments, its result not yet sent, still holds its place in line, and the one the child
    began after it then counts as not begun (docs/PROTOCOL.md, Lose)."""
    unknown = (float("-inf"), 0.0)  # a start missing: the order is unknown, every one counts
    first: dict[tuple[str, float], tuple[float, float]] = {}  # (worker, pid) -> the first in line's place
    for e in seen:
        h = e.holding
        if h.pid is None or not serial(h):
            continue
        place = (h.started_at, h.ahead) if h.started_at > 0 else unknown
        first[h.worker, h.pid] = min(first.get((h.worker, h.pid), place), place)
    out = []
    for e in losing:
        h = e.holding
        at = first.get((h.worker, h.pid)) if h.pid is not None and serial(h) else None
        out.append(at is None or at == unknown or (h.started_at, h.ahead) == at)
    return out


def lose(app: TaskRunner, queue: str, values: list[Any], workers: list[str] | None = None) -> list[Lost]:
    """lose.lua on deliveries (id, attempt, reason, owner, began per job; fenced); each it
    acted on. `workers`: who held each (default: the owners given)."""
    if not values:
        return []
    states = scripts.LOSE(app.redis, [app.keys.q(queue)], [app.settings.failed_ttl, *values])
    return [Lost(queue, job_id, state, worker, attempt, began != "0") for job_id, attempt, worker, began, state
            in zip(values[::5], values[1::5], values[3::5] if workers is None else workers, values[4::5], states)
            if state]


def holdings(app: TaskRunner, queues: list[str]) -> list[Held]:
    """Every delivery in the queues' holding hashes (one round trip); entries that are not
    holding entries are left out (the dispatcher requeues those at their deadline)."""
    pipe = app.redis.pipeline(transaction=False)
    for q in queues:
        pipe.hgetall(app.keys.q(q) + "running")
    return [Held(q, job_id, h) for q, running in zip(queues, pipe.execute()) for job_id, raw in running.items()
            if (h := Holding.parse(raw)) is not None]


def held(app: TaskRunner, queues: list[str]) -> list[tuple[str, str, str, str]]:
    """(queue, id, worker, attempt) of every delivery in the queues' holding hashes (holdings())."""
    return [(e.queue, e.id, e.holding.worker, str(e.holding.attempt)) for e in holdings(app, queues)]


def serial_by_heartbeat(app: TaskRunner, workers: set[str]) -> Callable[[Holding], bool]:
    """may_have_begun()'s `serial`: true for the holders among `workers` whose heartbeat's
    info says `serial` (docs/PROTOCOL.md, Liveness); one MGET, only when deliveries are
    lost. A holder whose info expired, or says nothing, is not known to be one."""
    names = sorted(workers)
    infos = app.redis.mget([app.keys.worker(n) for n in names]) if names else []
    out = set()
    for n, raw in zip(names, infos):
        try:
            info = codec.loads(raw) if raw else None
        except ValueError:
            continue
        if isinstance(info, dict) and info.get("serial") is True:
            out.add(n)
    return lambda h: h.worker in out


def lose_held(app: TaskRunner, queues: list[str], gone: Callable[[Held], bool], why: str,
              serial: Callable[[Holding], bool] | None = None) -> list[Lost]:
    """Lose, fenced by owner and delivery, every running job for which gone(delivery) is
    true (its holding entry says who holds which attempt: a worker reconciling tells its
    own from an attempt of the same job it no longer holds); `why` is formatted with the
    worker's name. Only those that may have begun count
    towards max_lost (may_have_begun(), by `serial`; default: the holders' heartbeats say).
    Returns those it acted on."""
    seen = holdings(app, queues)
    losing = [e for e in seen if gone(e)]
    if not losing:
        return []
    if serial is None:
        serial = serial_by_heartbeat(app, {e.holding.worker for e in losing})
    by_queue: dict[str, list[Any]] = {q: [] for q in queues}
    for e, began in zip(losing, may_have_begun(losing, seen, serial)):
        h = e.holding
        by_queue[e.queue] += [e.id, str(h.attempt), why.format(h.worker), h.worker, "1" if began else "0"]
    return [lost for q, values in by_queue.items() for lost in lose(app, q, values)]
