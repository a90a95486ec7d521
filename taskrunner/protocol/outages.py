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
    default the outage's own), and whichever thread fails first warns, and only it. Those
    threads ride it as Backoffs (its `riders`: each joins at its first failure and leaves
    when it goes through or gives up): it is over, said once, when a rider goes through and
    no other still fails (a cluster: one primary failing over while the other slots answer,
    a request that went through elsewhere must not end it under the ones still failing), and
    forgotten when the last rider gives up (a later outage warns anew, and its length counts
    from its own start). A single-threaded user (a worker's loop) may call failed() and ok()
    itself instead."""

    def __init__(self, what: str, logger: logging.Logger = log) -> None:
        self.what, self.log = what, logger
        self.since: float | None = None  # when this outage began (monotonic); None: Redis answers
        self.riders = 0  # the Backoffs riding it: failed, and neither through nor given up yet
        # since's and riders' check and change, for threads that share it. Reentrant: a
        # request's generator closed by the garbage collector within a holder's section
        # leaves the outage (Backoff.give_up) in that same thread.
        self._lock = threading.RLock()

    def failed(self, error: BaseException | str, pause: float | None, bound: str = "", what: str | None = None,
               joins: bool = False) -> None:
        """A try failed with `error` (or what it means); the next comes in `pause` seconds
        (None: when asked, as the dashboard's next request; `bound`: how long or when the
        tries go on, said in the warning). `joins`: a Backoff's first failure, it rides the
        outage from now (left())."""
        what = what or self.what
        with self._lock:
            first = self.since is None
            if first:
                self.since = time.monotonic()
            self.riders += joins
        if first:
            self.log.warning("%s: Redis unavailable (%s); trying again until it answers%s", what, error, bound)
        elif pause is None:
            self.log.debug("%s: Redis still unavailable (%s)", what, error)
        else:
            self.log.debug("%s: Redis still unavailable (%s); retrying in %.1fs", what, error, pause)

    def ok(self, what: str | None = None) -> None:
        """A try went through: the outage is over (a single-threaded user's call; a rider
        leaves by left())."""
        if self.since is None:
            return
        with self._lock:
            since, self.since = self.since, None
        if since is not None:
            self.log.info("%s: Redis answers again (unavailable for %.1fs)", what or self.what,
                          time.monotonic() - since)

    def left(self, what: str, through: bool) -> None:
        """A rider left: its request went through (`through`), or gave up. With no other
        rider left the outage is over: said (ok()) when it went through, else forgotten."""
        with self._lock:
            self.riders = max(self.riders - 1, 0)
            if self.riders:
                return
            if not through:
                self.since = None
                return
            self.ok(what)


class Backoff:
    """The pauses of a waiter whose Redis failed (transient()): 0.1 s doubling up to 2 s,
    so that a restart is noticed soon after it ends, without hammering a Redis that is
    down; one warning per outage (Outage: its own, or `outage`, one shared with others that
    wait for the same Redis). A wait with a deadline makes its last try at the
    deadline (the pause before it cut short), then gives up (raises the error): the job's
    state is then unknown. (It gave up when the next pause would pass the deadline: a 15 s
    bound tried last ~2 s before it, missing a failover that ended just inside it.) It rides
    the outage (Outage.riders) from its first failure until a try goes through (ok()) or it
    gives up (give_up(), as after() does when it raises)."""

    def __init__(self, what: str, deadline: float | None, outage: Outage | None = None) -> None:
        self.what, self.deadline = what, deadline
        self.pause = 0.0
        self.outage = outage or Outage(what)
        self.riding = False

    def after(self, error: BaseException) -> float:
        """Seconds to pause before the next try; raises `error` where that is not for
        us to ride out."""
        left = None if self.deadline is None else self.deadline - time.monotonic()
        if not transient(error) or (left is not None and left <= 0):
            self.give_up()
            raise error
        self.pause = min(max(self.pause * 2, 0.1), 2.0)
        joins, self.riding = not self.riding, True
        if left is None:
            self.outage.failed(error, self.pause, what=self.what, joins=joins)
            return self.pause
        self.outage.failed(error, min(self.pause, left), f" (for {round(left, 1):g}s at most)", self.what, joins)
        return min(self.pause, left)

    def ok(self) -> None:
        """A try went through: it leaves the outage it rode (a Backoff that never failed
        ends none: others may still ride it)."""
        if self.riding:
            self.riding = False
            self.outage.left(self.what, True)
        self.pause = 0.0

    def give_up(self) -> None:
        """The request ends without going through (raised, or closed midway): it leaves the
        outage it rode. Does nothing once it left."""
        if self.riding:
            self.riding = False
            self.outage.left(self.what, False)
