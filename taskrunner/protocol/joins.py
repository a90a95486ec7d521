"""Carrying a workflow's news between the slots of a Redis Cluster (docs/PROTOCOL.md,
Workflows: *Across slots*).

A parent whose child lives in another slot cannot touch it: the script that ends the parent
leaves an entry in the outbox of the parent's queue instead, in the same call. A carrier
applies the entry with join.lua in the child's slot, then deletes it: the worker that
finished the parent, right after its finish (finish.lua answers the entries it left), else
the dispatcher's pass, which carries every entry older than CARRY_AFTER. join.lua counts a
parent once per child, so an entry carried twice (a carrier that died before deleting it,
two at once) changes nothing more; an entry is deleted only once join.lua applied it, so
one that a carrier never got to is carried by the next pass. The carrying itself is an
operation of the client's (steps.carry), for the synchronous and asyncio drivers alike."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from taskrunner.client.app import TaskRunner

#: Seconds an entry waits in an outbox before the dispatcher carries it: the worker that
#: left it carries it at once, so the dispatcher takes only what such a carrier did not.
CARRY_AFTER = 2.0
#: The fields of an entry that join.lua takes after child, parent, task and state ("" when absent).
NEWS = ("result", "error_type", "error", "canceled_by")


@dataclass(frozen=True)
class Entry:
    """An outbox entry: the outbox's queue (the parent's), its stream id and its fields
    (child and parent as "<queue> <id>", task, state, and what NEWS it has)."""

    queue: str
    id: str
    fields: dict[str, str]


def parse(reply: Any) -> list[Entry]:
    """Entries as XRANGE gives them (redis-py: (id, {field: value}) pairs), or as finish.lua,
    join.lua and attach.lua answer them ([id, [field, value, ...]])."""
    out = []
    for sid, raw in reply:
        f = raw if isinstance(raw, dict) else dict(zip(raw[0::2], raw[1::2]))
        out.append(Entry(f["parent"].split(" ", 1)[0], sid, f))
    return out


def split(answer: list[Any], n: int) -> tuple[list[Any], list[Entry]]:
    """A script's answer of `n` values, one per item, and the outbox entries it left (a last
    value, present only when it left some)."""
    return answer[:n], parse(answer[n]) if len(answer) > n else []


def join_args(app: TaskRunner, entries: list[Entry]) -> list[Any]:
    """join.lua's ARGV for entries of one children's queue: the failed TTL, then 8 values per
    entry (child id, parent, task, state, then NEWS)."""
    args: list[Any] = [app.settings.failed_ttl]
    for e in entries:
        f = e.fields
        args += [f["child"].split(" ", 1)[1], f["parent"], f.get("task", ""), f["state"], *(f.get(k, "") for k in NEWS)]
    return args


def outbox(app: TaskRunner, queue: str) -> str:
    """The key of a queue's outbox."""
    return app.keys.q(queue) + "outbox"
