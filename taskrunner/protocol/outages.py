"""Riding out a Redis outage: which errors pass by themselves (transient()), how a process
says that Redis stopped and started answering (Outage: one warning, one line when it is
back), and the pauses between tries (Backoff). Workers, dispatchers, the dashboard, waiters
and producers share them, so that each outage reads the same in every log.
"""

from __future__ import annotations

import logging
import threading
import time

import redis
import redis.exceptions

log = logging.getLogger("taskrunner")


#: How redis-py's cluster client begins a RedisClusterException that passes: it found no
#: node of the startup list or saw slots without a primary while it read the layout (a
#: failover, an election). Its other ones are our mistakes, which no wait ends: a command whose
#: keys span slots ("... all keys must map to the same key slot"), one without a key to route
#: it by, a node not in cluster mode.
_PASSING_LAYOUT = ("All slots are not covered", "startup_nodes could not agree")


def transient(e: BaseException) -> bool:
    """A Redis error that passes by itself, after which a waiter connects again and looks
    again: Redis down or restarting (connection errors, LOADING), unreachable for a while
    (timeouts), failing over (READONLY, a blocked command UNBLOCKED, MASTERDOWN), a cluster
    resharding or electing (MOVED, ASK, TRYAGAIN, CLUSTERDOWN, a slot without a primary) or
    with no node reachable (redis-py's RedisClusterException "cannot be connected", raised
    from the last node's error: it passes when that does). Not any other
    RedisClusterException: redis-py raises that class for a command across slots too, a
    mistake that retrying would only hide for the whole bound."""
    passing = (redis.ConnectionError, redis.TimeoutError, redis.exceptions.ReadOnlyError,
               redis.exceptions.ClusterError, redis.exceptions.ClusterDownError, redis.exceptions.TryAgainError,
               redis.exceptions.MovedError, redis.exceptions.AskError, redis.exceptions.SlotNotCoveredError)
    if isinstance(e, passing):
        return True
    if isinstance(e, redis.exceptions.RedisClusterException):
        cause = e.__cause__
        return str(e).startswith(_PASSING_LAYOUT) or (cause is not None and cause is not e and transient(cause))
    return isinstance(e, redis.ResponseError) and str(e).startswith(("UNBLOCKED", "MASTERDOWN", "BUSY "))


class Outage:
    """How a process that rides out a Redis outage says so: one warning when Redis stops
    answering, the tries after it at debug level, and one line when it answers again. A
    line per try filled a worker's log with one every heartbeat for as long as Redis was
    down, and hid when it came back. One may be shared by the threads of a process (a
    producer's requests, steps.outage_of()): each try names what it was for (`what`; by
    default the outage's own), and whichever thread fails first warns, and only it."""

    def __init__(self, what: str, logger: logging.Logger = log) -> None:
        self.what, self.log = what, logger
        self.since: float | None = None  # when this outage began (monotonic); None: Redis answers
        self._lock = threading.Lock()  # since's check and change, for threads that share it

    def failed(self, error: BaseException | str, pause: float | None, bound: str = "", what: str | None = None) -> None:
        """A try failed with `error` (or what it means); the next comes in `pause` seconds
        (None: when asked, as the dashboard's next request; `bound`: how long or when the
        tries go on, said in the warning)."""
        what = what or self.what
        with self._lock:
            first = self.since is None
            if first:
                self.since = time.monotonic()
        if first:
            self.log.warning("%s: Redis unavailable (%s); trying again until it answers%s", what, error, bound)
        elif pause is None:
            self.log.debug("%s: Redis still unavailable (%s)", what, error)
        else:
            self.log.debug("%s: Redis still unavailable (%s); retrying in %.1fs", what, error, pause)

    def ok(self, what: str | None = None) -> None:
        """A try went through."""
        if self.since is None:
            return
        with self._lock:
            since, self.since = self.since, None
        if since is not None:
            self.log.info("%s: Redis answers again (unavailable for %.1fs)", what or self.what,
                          time.monotonic() - since)


class Backoff:
    """The pauses of a waiter whose Redis failed (transient()): 0.1 s doubling up to 2 s,
    so that a restart is noticed soon after it ends, without hammering a Redis that is
    down; one warning per outage (Outage: its own, or `outage`, one shared with others that
    wait for the same Redis). A wait with a deadline makes its last try at the
    deadline (the pause before it cut short), then gives up (raises the error): the job's
    state is then unknown. (It gave up when the next pause would pass the deadline: a 15 s
    bound tried last ~2 s before it, missing a failover that ended just inside it.)"""

    def __init__(self, what: str, deadline: float | None, outage: Outage | None = None) -> None:
        self.what, self.deadline = what, deadline
        self.pause = 0.0
        self.outage = outage or Outage(what)

    def after(self, error: BaseException) -> float:
        """Seconds to pause before the next try; raises `error` where that is not for
        us to ride out."""
        if not transient(error):
            raise error
        self.pause = min(max(self.pause * 2, 0.1), 2.0)
        if self.deadline is None:
            self.outage.failed(error, self.pause, what=self.what)
            return self.pause
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise error
        self.outage.failed(error, min(self.pause, left), f" (for {round(left, 1):g}s at most)", self.what)
        return min(self.pause, left)

    def ok(self) -> None:
        self.outage.ok(self.what)
        self.pause = 0.0
