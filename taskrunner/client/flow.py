"""Per-job flow control a producer asks for (issue 17): a priority and a unique lock; and
an expiry. The fields enqueue.lua takes for them (docs/PROTOCOL.md, Pause, priorities, unique
jobs; Expiry), checked here so that a mistake is one line in the caller's process; the script
checks them again for producers in other languages. A job that asks for none gets no field:
it costs nothing more to enqueue, claim or finish."""

from __future__ import annotations

import hashlib
import re
from typing import Any

import orjson

from taskrunner.protocol import codec

UNTIL = ("start", "finish")
#: What enqueue.lua takes as a unique key: 1-200 printable characters, no spaces.
_KEY = re.compile(r"[!-~]{1,200}")


def unique_key_of(task: str, args: Any, kwargs: dict | None) -> str:
    """The key `unique_for` without `unique_key` locks: the SHA-1 (hex) of the canonical JSON
    of [task, args, kwargs] (keys sorted, no spaces), so that f(a=1, b=2) and f(b=2, a=1)
    are one job. Another language's producer makes the same key from the same JSON."""
    text = orjson.dumps([task, list(args), kwargs or {}], option=orjson.OPT_SORT_KEYS)
    return hashlib.sha1(text).hexdigest()


def expiry(expires: Any) -> list[Any]:
    """The enqueue field of a job's `expires` ([] for None): seconds from now (> 0) or an
    aware datetime (codec.expiry), by which it must have started, else it ends killed,
    Expired, at its claim. Workflow steps and callbacks may have one (a step that expires
    cancels those after it)."""
    return [] if expires is None else ["expires", codec.expiry(expires)]


def fields(task: str, args: Any, kwargs: dict | None, priority: int | None = None, unique_for: int | None = None,
           unique_key: str | None = None, unique_until: str | None = None, expires: Any = None) -> list[Any]:
    """The enqueue fields of a job's priority, unique lock and expiry ([] when it has none).
    `expires`: see expiry().
    `priority`: 0-9, higher claimed first (0: as a job without one). `unique_key`: while a job
    holding it has not started or ended (`unique_until`, default "finish") another job with
    it is not added: enqueue answers the holder's id. `unique_for`: seconds the lock lasts at
    most; without `unique_key` the key is derived from the task and its arguments."""
    out: list[Any] = expiry(expires)
    if priority is not None:
        if isinstance(priority, bool) or not isinstance(priority, int) or not 0 <= priority <= 9:
            raise ValueError(f"priority must be a whole number from 0 to 9, not {priority!r}")
        if priority:
            out += ["priority", priority]
    if unique_until is not None and unique_until not in UNTIL:
        raise ValueError(f"unique_until must be 'start' or 'finish', not {unique_until!r}")
    if unique_key is None and unique_for is None:
        if unique_until is not None:
            raise ValueError("unique_until needs unique_key or unique_for")
        return out
    if unique_for is not None:
        codec.count("unique_for", unique_for, minimum=1)
    if unique_key is None:
        unique_key = unique_key_of(task, args, kwargs)
    elif not isinstance(unique_key, str) or not _KEY.fullmatch(unique_key):
        raise ValueError(f"unique_key must be 1-200 printable characters without spaces, not {unique_key!r}")
    out += ["unique_key", unique_key]
    if unique_until is not None:
        out += ["unique_until", unique_until]
    if unique_for is not None:
        out += ["unique_for", unique_for]
    return out
