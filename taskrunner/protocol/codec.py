"""JSON on the wire, strictly: values JSON cannot carry are refused, never coerced; and
the checks of what else a caller gives (names, ids, seconds, counts) before it is sent."""

from __future__ import annotations

import datetime
import math
import os
import re
import threading
import time
from typing import Any

import orjson

from taskrunner.errors import InvalidName, NotJSONError

# orjson would turn dataclasses, datetimes and numpy values into JSON silently;
# passthrough makes them errors, so what a consumer reads is what the producer sent.
_STRICT = orjson.OPT_PASSTHROUGH_DATACLASS | orjson.OPT_PASSTHROUGH_DATETIME | orjson.OPT_PASSTHROUGH_SUBCLASS
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.:@-]{0,199}\Z")
_SHARD = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.:@-]{0,199}~[1-9][0-9]?\Z")
_ID = re.compile(r"[A-Za-z0-9_.:@-]{1,200}\Z")
_CROCKFORD = "0123456789ABCDEFGHJKMNPQRSTVWXYZ"
_PAIRS = [a + b for a in _CROCKFORD for b in _CROCKFORD]
_SHIFTS = range(120, -1, -10)


def dumps(value: Any, what: str = "value") -> bytes:
    try:
        data = orjson.dumps(value, option=_STRICT)
    except TypeError as e:
        raise NotJSONError(f"{what} is not JSON: {e} (taskrunner sends JSON only)") from None
    # orjson writes NaN and infinities as null; look for them only when a null is there.
    if b"null" in data and _non_finite(value):
        raise NotJSONError(f"{what} is not JSON: NaN and infinity have no JSON form (taskrunner sends JSON only)")
    return data


def _non_finite(value: Any) -> bool:
    """Is there a NaN or infinite float anywhere in value (JSON-shaped, depth <= 255)?"""
    if isinstance(value, float):
        return not math.isfinite(value)
    if isinstance(value, dict):
        return any(_non_finite(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return any(_non_finite(v) for v in value)
    return False


def loads(data: str | bytes) -> Any:
    return orjson.loads(data)


def check_name(kind: str, name: str) -> str:
    """Queue and task names: letters, digits and _.:@- , at most 200, starting alnum."""
    if not isinstance(name, str) or not _NAME.match(name):
        raise InvalidName(f"invalid {kind} name {name!r}: use letters, digits and _.:@- "
                          "(at most 200, starting with a letter or digit)")
    return name


def check_queue(name: str) -> str:
    """A queue as records and keys name it: a name check_name() takes, or a shard of one,
    "Q~i" (1 <= i < 64, protocol/shards.py), which users cannot name a queue of their own."""
    if isinstance(name, str) and _SHARD.match(name) and int(name.rpartition("~")[2]) < 64:
        return name
    return check_name("queue", name)


def check_id(job_id: str) -> str:
    if not isinstance(job_id, str) or not _ID.match(job_id):
        raise InvalidName(f"invalid job id {job_id!r}: use 1-200 letters, digits and _.:@-")
    return job_id


_last_id = 0  # this process's last new_id() as a number: the next one is above it
_id_lock = threading.Lock()


def _forget_last_id() -> None:
    """In a forked child: it must not count up from its parent's last id as the parent does
    (the two would make the same ids); and a lock held by another thread at the fork stays so."""
    global _last_id, _id_lock
    _last_id, _id_lock = 0, threading.Lock()


os.register_at_fork(after_in_child=_forget_last_id)


def new_id() -> str:
    """A ULID: 26 characters that sort by creation time (ms), then 80 random bits. Within a
    process each is above the last (in the same millisecond the random part counts up: the
    monotonic form of ULID), so one producer's ids sort in the order it made them; ids
    from random bits alone came out in random order within a millisecond."""
    global _last_id
    n = (int(time.time() * 1000) << 80) | int.from_bytes(os.urandom(10), "big")
    with _id_lock:
        n = _last_id = max(n, _last_id + 1)
    return "".join([_PAIRS[(n >> s) & 1023] for s in _SHIFTS])  # 26 characters, 10 bits at a time


#: Seconds the scripts take (enqueue.lua's SECONDS_MAX, 2^53): whole seconds up to it are exact doubles.
SECONDS_MAX = 2**53


def seconds(name: str, value: Any, positive: bool = False) -> float:
    """A duration given by a caller: a finite number, >= 0 (> 0 if positive), below 2^53 as
    the scripts take it (enqueue.lua refuses more, in words naming the job: the caller's
    mistake is said here first). NaN or text would reach the Lua scripts as strings they
    cannot compare."""
    try:
        ok = not isinstance(value, (bool, str)) and math.isfinite(value) and value < SECONDS_MAX \
            and (value > 0 if positive else value >= 0)
    except (TypeError, OverflowError):
        ok = False
    if not ok:
        raise ValueError(f"{name} must be a finite number of seconds {'> 0' if positive else '>= 0'} and < 2^53, "
                         f"not {value!r}")
    return float(value)


def expiry(value: Any) -> float:
    """A job's `expires` as a producer gives it — seconds from now (> 0) or an aware
    datetime — as seconds from now: enqueue.lua adds them to Redis's clock, so that the
    claim compares the expiry with the clock it reads (a producer's own may be off). A
    datetime is measured against this machine's clock, once, here; one that has passed is
    refused (the job could never run), as is a naive one (which zone?)."""
    if isinstance(value, datetime.datetime):
        if value.utcoffset() is None:
            raise ValueError(f"expires must be an aware datetime (with a tzinfo), not the naive {value.isoformat()}")
        left = (value - datetime.datetime.now(datetime.timezone.utc)).total_seconds()
        if left <= 0:
            raise ValueError(f"expires {value.isoformat()} has passed: the job could never run")
        return left
    try:
        return seconds("expires", value, positive=True)
    except ValueError:
        raise ValueError(f"expires must be seconds from now (a finite number > 0 and < 2^53) or an aware datetime, "
                         f"not {value!r}") from None


def count(name: str, value: Any, minimum: int = 0) -> int:
    """A whole number given by a caller, from `minimum` to 2**31 - 1 (the scripts count in
    doubles: a larger one would be stored as text no reader turns back into that number)."""
    if isinstance(value, bool) or not isinstance(value, int) or not minimum <= value < 2**31:
        raise ValueError(f"{name} must be a whole number from {minimum} to {2**31 - 1}, not {value!r}")
    return value


_RATE = re.compile(r"([1-9][0-9]{0,8})/([smh])\Z")
_PERIODS = {"s": 1, "m": 60, "h": 3600}


def rate(name: str, value: Any) -> str:
    """A rate limit: "N/s", "N/m" or "N/h", N a whole number from 1 to 999999999 (as the
    scripts read it: docs/PROTOCOL.md, Flow control)."""
    if not isinstance(value, str) or not _RATE.match(value):
        raise ValueError(f'{name} must be "N/s", "N/m" or "N/h" with N a whole number from 1 to 999999999 '
                         f"(e.g. \"20/s\"), not {value!r}")
    return value


def rate_period(value: str) -> tuple[int, int]:
    """A rate limit checked by rate() as (N, the period in seconds)."""
    m = _RATE.match(value)
    assert m is not None, value
    return int(m[1]), _PERIODS[m[2]]
