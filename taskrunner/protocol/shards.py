"""Sharded queues (issue 18): one logical queue Q spread over N physical queues, its
shards, each a queue of its own with its own hash tag, so that on a Redis Cluster they
spread over the primaries and each script still touches one slot.

Shard 0 is Q itself (`P:{Q}:`); shard i >= 1 is the queue named `Q~i` (`P:{Q~i}:`): "~" is
in no name a user may give, so no user queue can take a shard's name. Q's meta hash holds
`shards` (N; absent: 1, an ordinary queue). Producers read it once per KEEP seconds per
queue (a queue that is not sharded costs no command per job) and spread jobs over the
shards; workers read it when they start and at each heartbeat, and claim from every shard.
Each shard is FIFO (per priority); across shards there is no order (docs/PROTOCOL.md,
Sharded queues)."""

from __future__ import annotations

import itertools
import random
import re
import time
import zlib
from collections.abc import Sequence

#: What separates a logical queue's name from a shard's number.
SEP = "~"
#: The most shards a queue may have.
MAX = 64
#: Seconds a producer keeps a queue's shard count it read.
KEEP = 10.0

_SHARD = re.compile(r"([A-Za-z0-9][A-Za-z0-9_.:@-]{0,199})~([1-9][0-9]?)\Z")


def name(queue: str, i: int) -> str:
    """The physical queue of shard i of `queue` (shard 0: the queue itself)."""
    return f"{queue}{SEP}{i}" if i else queue


def names(queue: str, n: int) -> list[str]:
    """Every shard of `queue` with `n` shards, shard 0 first."""
    return [name(queue, i) for i in range(max(1, n))]


def split(physical: str) -> tuple[str, int]:
    """(logical queue, shard number) of a physical queue name ("Q~3" -> ("Q", 3); "Q" -> ("Q", 0))."""
    m = _SHARD.match(physical)
    return (m.group(1), int(m.group(2))) if m and int(m.group(2)) < MAX else (physical, 0)


def logical(physical: str) -> str:
    """The logical queue a physical queue belongs to."""
    return split(physical)[0]


def is_shard(physical: str) -> bool:
    """Is it the name of a shard >= 1 (as opposed to a queue a user may name)?"""
    return split(physical)[1] > 0


def count(value: int | str | None) -> int:
    """A queue's shard count as meta `shards` holds it (absent or not a count: 1)."""
    try:
        n = int(value or 1)
    except ValueError:
        return 1
    return n if 1 <= n <= MAX else 1


def of_key(key: str, n: int) -> int:
    """The shard of a job that holds `key` (a unique key, concurrency key, or rate-limited
    task): the same key always lands on the same shard, so that locks, slots and limits,
    which count per shard, count it exactly. CRC32: the same in every process and language."""
    return zlib.crc32(key.encode()) % n


def per_primary(owners: Sequence[str], primaries: Sequence[str]) -> list[int]:
    """How many shards each of `primaries` serves, `owners` being the primary of each shard."""
    return [sum(o == p for o in owners) for p in primaries]


def uneven(counts: Sequence[int]) -> bool:
    """Shards per primary that leave some primary with two more than another. With at
    least as many shards as primaries that covers a primary with none; with fewer, a
    spread is even when no primary has two."""
    return max(counts) - min(counts) > 1


def even_counts(owners: Sequence[str], primaries: Sequence[str], most: int) -> list[int]:
    """The smallest shard counts (at most `most` of them) that spread a queue evenly over
    `primaries`, a shard on each at least, `owners` being the primary of each of its
    first MAX shards: shard i's slot depends on the queue's name and i only, so a count
    n puts the queue on the primaries of owners[:n]."""
    return [n for n in range(max(2, len(primaries)), len(owners) + 1)
            if not uneven(per_primary(owners[:n], primaries))][:most]


class Spreader:
    """A producer's placement: per queue, the shard count (read at most once per KEEP
    seconds) and a round robin over the shards for jobs without a key, started at a
    different shard in each process."""

    def __init__(self) -> None:
        self._counts: dict[str, tuple[float, int]] = {}
        self._turns: dict[str, itertools.count] = {}

    def cached(self, queue: str) -> int | None:
        """The shard count of `queue` if read less than KEEP seconds ago, else None."""
        hit = self._counts.get(queue)
        return hit[1] if hit is not None and hit[0] > time.monotonic() else None

    def put(self, queue: str, n: int) -> int:
        self._counts[queue] = (time.monotonic() + KEEP, n)
        return n

    def forget(self, queue: str) -> None:
        self._counts.pop(queue, None)

    def place(self, queue: str, n: int, key: str | None) -> str:
        """The shard a job goes to: by its key's hash, else the next in turn."""
        if n <= 1:
            return queue
        if key is not None:
            return name(queue, of_key(key, n))
        turn = self._turns.get(queue)
        if turn is None:
            turn = self._turns[queue] = itertools.count(random.randrange(n))
        return name(queue, next(turn) % n)


class Served:
    """The queues a claimer (worker, Consumer) serves, in priority order, each as the
    physical queues of its shards. `order()` is the claim order of one claim: queue by
    queue as given, each sharded queue's shards from a turn that moves at each claim (so
    that every shard is claimed from first in turn: FIFO holds per shard, not across), or
    from the shard whose wake token woke the claimer. A queue named twice (`-Q a,b,a`) is
    served once, where first named: a second place in a strict priority order adds
    nothing but its keys again in every claim and heartbeat."""

    def __init__(self, queues: list[str]) -> None:
        self.queues = list(dict.fromkeys(queues))
        self.counts = [1] * len(self.queues)
        self._turn = 0

    @property
    def physical(self) -> list[str]:
        return [s for q, n in zip(self.queues, self.counts) for s in names(q, n)]

    def update(self, counts: list[int]) -> bool:
        """Take the shard counts read (meta `shards` of each queue, as count() reads it):
        whether they changed."""
        changed = counts != self.counts
        self.counts = counts
        return changed

    def shards_of(self, physical: str) -> int:
        """The shard count of the queue that `physical` belongs to (1: not sharded, or not served)."""
        q = logical(physical)
        return next((n for served, n in zip(self.queues, self.counts) if served == q), 1)

    def after(self, physical: str) -> str:
        """The shard after `physical` in its queue's ring (itself where not sharded)."""
        q, i = split(physical)
        return name(q, (i + 1) % self.shards_of(physical))

    def order(self, woken: str | None = None) -> list[str]:
        self._turn += 1
        out: list[str] = []
        for q, n in zip(self.queues, self.counts):
            group = names(q, n)
            start = self._turn % n
            if woken is not None and woken in group:
                start = group.index(woken)
            out += group[start:] + group[:start]
        return out
