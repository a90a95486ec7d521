"""Blocking waits on Redis lists (BRPOP, BLPOP) that last as long as asked: a worker's and a
consumer's wait for a wake token, a waiter's for a result. Each block has a connection of
its own, outside the client's pool and its socket_timeout; on a cluster, one per slot.
"""

from __future__ import annotations

import time
from multiprocessing.connection import wait
from typing import Any

import redis
import redis.cluster

from taskrunner.protocol.connection import is_cluster


def slack(socket_timeout: float | None) -> float:
    """Seconds a blocking command's answer may come after its own timeout before the
    connection counts as hung: the connection's socket_timeout (what an answer due at once
    may take), at least 1 s; 5 s where it has none."""
    return max(1.0, float(socket_timeout or 5.0))


class Blocker:
    """One BRPOP (or BLPOP: `command`) on `keys` outstanding on a connection of its own (kept
    across calls, outside the client's pool); select() tells when it answered, or pop() waits
    for it. Its wait is not bounded by the connection's socket_timeout (redis-py 6 and later
    default it to 5 s), which would cut off any longer block, but by the block's own
    timeout plus slack(): a wait lasts as long as asked. On a Redis Cluster the
    keys must share a slot, and the connection goes to the primary that owns it. When the
    primary moved (a Sentinel failover the worker saw no error in, a cluster failover or
    resharding) arm() raises ConnectionError once, so that the worker reconciles what it
    holds with the new primary, which may lack writes the old one took (jobs we finished)."""

    def __init__(self, client: redis.Redis | redis.cluster.RedisCluster, keys: list[str],
                 command: str = "BRPOP", cancellable: bool = False) -> None:
        self.client, self.keys, self.command = client, keys, command
        self.pool: Any = None
        self.conn: Any = None
        self.armed = False
        self.due = 0.0  # when an armed command's answer is late: the connection hangs (monotonic)
        self.address: tuple[Any, Any] | None = None  # where our connection went, since the last reset()
        self.cancellable = cancellable  # cancel() may be called: know our connection's CLIENT ID
        self.client_id: int | None = None

    def _pool(self) -> Any:
        if isinstance(self.client, redis.cluster.RedisCluster):
            return self.client.get_redis_connection(self.client.get_node_from_key(self.keys[0])).connection_pool
        return self.client.connection_pool

    def arm(self, timeout: float) -> None:
        if not self.armed:
            pool = self._pool()
            if self.conn is not None and (pool is not self.pool or not pool.owns_connection(self.conn)):
                self._close()  # the pool found that the primary moved, or the slot did
            self.pool = pool
            if self.conn is None:
                self.conn = pool.connection_class(**pool.connection_kwargs)
            if self.conn._sock is None:  # a new socket (redis-py reconnects one an error closed): a new CLIENT ID
                self.client_id = None
            # connect() first: send_command() alone would skip a Sentinel-managed
            # connection's lookup of the primary and dial the default localhost:6379.
            self.conn.connect()
            before, self.address = self.address, (getattr(self.conn, "host", None), getattr(self.conn, "port", None))
            if before not in (None, self.address):
                raise redis.ConnectionError(f"the Redis primary moved to {self.address[0]}:{self.address[1]}")
            if self.cancellable and self.client_id is None:
                self.conn.send_command("CLIENT", "ID")
                self.client_id = int(self.conn.read_response())
            self.conn.send_command(self.command, *self.keys, timeout)
            self.armed = True
            self.due = time.monotonic() + timeout + slack(self.conn.socket_timeout)

    def pop(self, timeout: float) -> Any:
        """Block up to `timeout` seconds for an item: [key, item], or None. The connection
        stays open for the next call (reset() closes it)."""
        return _pop([self], timeout)

    def fileno(self) -> int:
        return self.conn._sock.fileno()

    def read(self) -> Any:
        self.armed = False
        try:
            return self.conn.read_response()
        except redis.exceptions.MovedError:
            self._close()
            self.client.nodes_manager.initialize()  # type: ignore[union-attr]  # learn the new layout
            raise
        except BaseException:
            self._close()
            raise

    def cancel(self) -> Any:
        """End an armed command without losing what it took (made with cancellable=True):
        CLIENT UNBLOCK from another connection to its server, then its answer: None, or the
        [key, item] it had taken already (closing the connection would drop that item).
        Made without cancellable (one BRPOP on every list, one server: it has answered by
        the time its claimer returns), it is reset."""
        if not self.armed:
            return None
        if not self.cancellable:
            self.reset()
            return None
        try:
            unblocked = redis.Redis(connection_pool=self.pool).execute_command("CLIENT", "UNBLOCK", self.client_id)
            if not unblocked and not self.conn.can_read(timeout=0.5):
                self._close()  # not blocked and no answer on its way: nothing taken, nothing to wait for
                return None
        except BaseException:
            self._close()
            raise
        return self.read()

    def reset(self) -> None:
        """Cancel: closing the connection ends the BRPOP on the server. The worker also
        calls this after a Redis error, and reconciles then: no move left to tell."""
        self._close()
        self.address = None

    def _close(self) -> None:
        self.armed = False
        self.client_id = None
        if self.conn is not None:
            self.conn.disconnect()
            self.conn = None


def blockers_on(client: redis.Redis | redis.cluster.RedisCluster, keys: list[str], command: str = "BRPOP",
                cancellable: bool = False) -> list[Blocker]:
    """What waits on any of the lists `keys`: one Blocker on all of them; on a cluster, where
    one command's keys must share a slot, one per key (each to the primary of its slot)."""
    groups = [[key] for key in keys] if is_cluster(client) else [keys]
    return [Blocker(client, group, command, cancellable) for group in groups]


def give_back(client: Any, wake: str) -> None:
    """Put back a wake token taken but not used (one BRPOP of several answered once another
    had woken the claimer, or once it had no room): for another idle claimer, as one BRPOP
    on every list would have left it."""
    give_back_in(client.pipeline(transaction=False), wake).execute()


def give_back_in(pipe: Any, wake: str) -> Any:
    """give_back()'s commands, added to `pipe` (returned). At most one token, as the
    scripts leave it: a token given back twice (a sync that failed, sent again) is one."""
    return pipe.lpush(wake, "1").ltrim(wake, 0, 0)


def _pop(blockers: list[Blocker], timeout: float) -> Any:
    """Arm every blocker and return the first item that comes (None if none in `timeout`)."""
    for b in blockers:
        b.arm(timeout)
    waitables: list[Any] = list(blockers)  # each has a fileno(), as wait() needs
    ready: list[Any] = wait(waitables, timeout + slack(blockers[0].conn.socket_timeout))
    if not ready:
        for b in blockers:
            b.reset()
        raise redis.TimeoutError(f"no answer from Redis to a {timeout:g}s {blockers[0].command} in time")
    items = [b.read() for b in ready]
    return next((item for item in items if item), None)


def pop_any(client: redis.Redis | redis.cluster.RedisCluster, keys: list[str], timeout: float,
            command: str = "BRPOP") -> Any:
    """Wait up to `timeout` (any length) for an item on any of the lists `keys`, and take
    it: [key, item], or None. One BRPOP (or BLPOP); on a cluster, where one command's keys
    must share a slot, one per key, each to the node of its slot, until one answers."""
    blockers = blockers_on(client, keys, command)
    try:
        return _pop(blockers, timeout)
    finally:
        for b in blockers:
            b.reset()

