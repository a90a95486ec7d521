"""Find jobs by a piece of text: the dashboard's search box. A job id is looked up directly;
other text matches task names, and the task and arguments of the jobs of the states asked
for, read a page at a time and never more than `budget` jobs per call (a cursor goes on):
a search costs the same at a thousand jobs or a million."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from taskrunner.client import declarations
from taskrunner.ops import listing

if TYPE_CHECKING:
    from taskrunner.client.app import TaskRunner

STATES = ("pending", "delayed", "waiting", "failed", "killed", "canceled", "completed")
DEFAULT_STATES = ("failed", "killed", "pending", "delayed")
#: Jobs read per round trip, and at most per call by default.
CHUNK = 200
BUDGET = 2000
#: Most characters of a search text.
TEXT_MAX = 200


@dataclass
class Cursor:
    """Where a search goes on: the queue (index into the sorted names), the state (index
    into the states searched) and the offset into that list."""

    queue: int = 0
    state: int = 0
    offset: int = 0

    @classmethod
    def parse(cls, text: str | None) -> Cursor:
        """From "queue.state.offset" (a link's `after`); ValueError when it is not one."""
        if not text:
            return cls()
        try:
            c = cls(*(int(x) for x in text.split(".")))
        except (TypeError, ValueError):
            raise ValueError("after must be the value a previous search gave") from None
        if min(c.queue, c.state, c.offset) < 0:
            raise ValueError("after must be the value a previous search gave")
        return c

    def __str__(self) -> str:
        return f"{self.queue}.{self.state}.{self.offset}"


def search(app: TaskRunner, text: str, states: tuple[str, ...] = DEFAULT_STATES, after: Cursor | None = None,
           limit: int = 50, budget: int | None = None) -> dict[str, Any]:
    """Tasks whose name contains `text` (case-insensitive), and up to `limit` jobs of
    `states` whose task or arguments contain it, having read at most `budget` jobs:
    {"tasks", "jobs", "examined", "after" (str: where the next call goes on; None: done)}."""
    budget = budget or BUDGET
    needle = text.lower()
    tasks = sorted({t["task"] for t in declarations.known(app) if needle in str(t.get("task", "")).lower()})
    queues = sorted(app.queue_names())
    c = after or Cursor()
    found: list[dict[str, Any]] = []
    examined = 0
    while c.queue < len(queues) and len(found) < limit and examined < budget:
        q, state = queues[c.queue], states[c.state] if c.state < len(states) else None
        if state is None:
            c = Cursor(c.queue + 1)
            continue
        take = min(CHUNK, budget - examined)
        ids = listing.job_ids(app, q, state, take, c.offset)
        rows = [{"id": i, "queue": q} for i in ids]
        for r, (task, args, kwargs) in zip(rows, listing.hmget(app, rows, "task", "args", "kwargs")):
            examined += 1
            c.offset += 1
            if any(needle in (v or "").lower() for v in (task, args, kwargs)):
                found.append(r)
                if len(found) >= limit:
                    break
        else:
            if len(ids) < take:  # read to the end of the list: the next state
                c = Cursor(c.queue, c.state + 1)
    jobs = listing.fill(app, found, listing.FINISHED_FIELDS + ("enqueued_at", "due_at"))
    done = c.queue >= len(queues)
    return {"tasks": tasks, "jobs": jobs, "examined": examined, "after": None if done else str(c),
            "cursor": None if done else asdict(c)}

