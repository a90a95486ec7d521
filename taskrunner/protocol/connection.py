"""Connecting to Redis from a URL; the default is the embedded server of `taskrunner up`.

Besides redis-py's own forms (redis://, rediss://, unix://) this accepts Redis Cluster:

    redis+cluster://[[user]:password@]host[:port][,host[:port]...][?option=value&...]

each host:port a node of the cluster to learn its layout from (port 6379 by default; one
is enough, more in case it is down); options socket_timeout, socket_connect_timeout. The
client sends each command to the primary that owns its keys' slot: every key of a queue
shares the queue's hash tag, so every script call touches one slot; cluster mode only
changes what spans queues (see is_cluster()). And Redis Sentinel:

    redis+sentinel://[[user]:password@]host[:port][,host[:port]...]/service[/db][?option=value&...]

each host:port a sentinel (port 26379 by default), `service` the name the sentinels
monitor (`sentinel monitor <service> ...`), user and password those of the Redis servers.
Options: sentinel_username, sentinel_password (AUTH to the sentinels), socket_timeout,
socket_connect_timeout (seconds). The client asks the sentinels for the current primary
whenever it opens a connection, and at most every RECHECK seconds when it takes one from its
pool: after a failover it moves to the promoted replica even if the old primary is still up.

In both, an IPv6 host goes in brackets, and a '/', '?', '#' or '%' in the user or password is
percent-encoded (see urls.py, which reads them).
"""

from __future__ import annotations

import inspect
import os
import time
from dataclasses import dataclass, field
from typing import Any, TypeAlias

import redis
import redis.asyncio
import redis.asyncio.cluster
import redis.asyncio.retry
import redis.asyncio.sentinel
import redis.backoff
import redis.cluster
import redis.retry
import redis.sentinel

from taskrunner.errors import BadURL
from taskrunner.protocol.urls import (
    CLUSTER_FORM,
    CLUSTER_SCHEME,
    FORMS,
    REDIS_PORT,
    SENTINEL_FORM,
    SENTINEL_OPTIONS,
    SENTINEL_PORT,
    SENTINEL_SCHEME,
    check_db,
    complaint,
    default_url,
    parse_hosts_url,
    redact,
)

RECHECK = 1.0  # seconds between looks at which node the sentinels call the primary
#: Seconds an answer Redis owes at once may take, unless the URL says (socket_timeout):
#: redis-py 6 and later default to this, 5.x to none, where a Redis that stops answering
#: (SIGSTOP, a partition) hangs a worker's loop, and its stopping, for good. Blocking
#: commands are waited for longer (see slack()).
SOCKET_TIMEOUT = 5.0


@dataclass(frozen=True)
class SentinelURL:
    """A parsed redis+sentinel:// URL."""

    sentinels: tuple[tuple[str, int], ...]
    service: str
    db: int = 0
    username: str | None = None
    password: str | None = field(default=None, repr=False)
    sentinel_options: dict[str, Any] = field(default_factory=dict, repr=False)  # for the connections to the sentinels
    options: dict[str, Any] = field(default_factory=dict)  # for the connections to the primary

    @classmethod
    def parse(cls, url: str) -> SentinelURL:
        bad = complaint(url, SENTINEL_FORM)
        sentinels, user, password, path, options = parse_hosts_url(url, SENTINEL_SCHEME, SENTINEL_PORT, bad,
                                                                   SENTINEL_OPTIONS)
        if not path or not path[0] or len(path) > 2 or (len(path) == 2 and not path[1].isdigit()):
            raise bad("the path must be /service or /service/db")
        sentinel_options: dict[str, Any] = {"socket_timeout": 1.0, "socket_connect_timeout": 1.0}
        for key in SENTINEL_OPTIONS:
            if key in options:
                sentinel_options[key.removeprefix("sentinel_")] = options.pop(key)
        return cls(sentinels, path[0], int(path[1]) if len(path) == 2 else 0, user, password, sentinel_options,
                   options)

    def _master_options(self, options: dict[str, Any]) -> dict[str, Any]:
        return {"db": self.db, "username": self.username, "password": self.password, "socket_keepalive": True,
                "socket_connect_timeout": 5.0, "socket_timeout": SOCKET_TIMEOUT, **self.options, **options}

    def master(self, **options: Any) -> Client:
        """A client of the current primary (found anew by each connection it opens). Each
        sentinel is asked once per lookup, without redis-py's retries (redis-py 8: 10 tries,
        backing off up to 1 s): the other sentinels are its retry, and with every sentinel
        down a lookup took 12 s, on a worker's loop among others (before a probe, and at
        most once a second before a send)."""
        once = {"retry": redis.retry.Retry(redis.backoff.NoBackoff(), 0)}
        sentinel = redis.sentinel.Sentinel(self.sentinels, sentinel_kwargs={**once, **self.sentinel_options})
        return sentinel.master_for(self.service, connection_pool_class=SentinelPool, **self._master_options(options))

    def master_async(self, **options: Any) -> AsyncClient:
        """The same for redis.asyncio."""
        once = {"retry": redis.asyncio.retry.Retry(redis.backoff.NoBackoff(), 0)}
        sentinel = redis.asyncio.sentinel.Sentinel(self.sentinels, sentinel_kwargs={**once, **self.sentinel_options})
        return sentinel.master_for(self.service, connection_pool_class=AsyncSentinelPool,
                                   **self._master_options(options))


@dataclass(frozen=True)
class ClusterURL:
    """A parsed redis+cluster:// URL."""

    nodes: tuple[tuple[str, int], ...]
    username: str | None = None
    password: str | None = field(default=None, repr=False)
    options: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def parse(cls, url: str) -> ClusterURL:
        bad = complaint(url, CLUSTER_FORM)
        nodes, user, password, path, options = parse_hosts_url(url, CLUSTER_SCHEME, REDIS_PORT, bad)
        if any(path):
            raise bad("a cluster has no path (it has one database)")
        return cls(nodes, user, password, options)

    def _options(self, options: dict[str, Any]) -> dict[str, Any]:
        return {"username": self.username, "password": self.password, "socket_keepalive": True,
                "socket_connect_timeout": 5.0, "socket_timeout": SOCKET_TIMEOUT, **self.options, **options}

    def client(self, **options: Any) -> Client:
        """A client of the cluster (it asks a node for the slots layout at once)."""
        nodes = [redis.cluster.ClusterNode(h, p) for h, p in self.nodes]
        return _cluster(redis.cluster.RedisCluster, nodes, self._options(options))

    def client_async(self, **options: Any) -> AsyncClient:
        """The same for redis.asyncio (it connects on first use)."""
        nodes = [redis.asyncio.cluster.ClusterNode(h, p) for h, p in self.nodes]
        return _cluster(redis.asyncio.RedisCluster, nodes, self._options(options))


def is_cluster(client: Any) -> bool:
    """A Redis Cluster client: a command's keys must then share a slot, so what spans
    queues (a claim, an idle worker's wait) is done one queue at a time."""
    return isinstance(client, (redis.cluster.RedisCluster, redis.asyncio.RedisCluster))


def server_time(client: Client) -> float:
    """Redis's clock, in seconds: every process's deadlines and heartbeats are measured on
    it, so that hosts whose clocks disagree still agree on who is late."""
    sec, usec = client.time()
    return sec + usec / 1e6


class _Rechecked:
    """Whether it is time to ask the sentinels again (shared by the two pools below)."""

    _checked_at = float("-inf")

    def _due(self) -> bool:
        now = time.monotonic()
        if now - self._checked_at < RECHECK:
            return False
        self._checked_at = now
        return True


class SentinelPool(_Rechecked, redis.sentinel.SentinelConnectionPool):
    """redis-py's pool looks for the primary only when it opens a connection or one fails
    with READONLY. A busy client reuses its connections, so after a failover that left the
    old primary up (SENTINEL FAILOVER, a partition) it keeps writing there until Sentinel
    demotes it, seconds later, and that throws those writes away. This pool asks at most
    every RECHECK seconds and closes its idle connections when the primary moved."""

    def get_connection(self, *args: Any, **kwargs: Any) -> Any:
        if self._due():
            try:
                self.get_master_address()  # closes the idle connections if the primary moved
            except redis.ConnectionError:
                pass  # no primary known just now: the connection will tell
        return super().get_connection(*args, **kwargs)


class AsyncSentinelPool(_Rechecked, redis.asyncio.sentinel.SentinelConnectionPool):
    """SentinelPool for redis.asyncio."""

    async def get_connection(self, *args: Any, **kwargs: Any) -> Any:
        if self._due():
            try:
                await self.get_master_address()
            except redis.ConnectionError:
                pass
        return await super().get_connection(*args, **kwargs)


#: A Redis client as taskrunner holds one: redis.Redis (Sentinel-managed or not) or
#: redis.cluster.RedisCluster, always decoding replies to str. redis-py types its replies
#: loosely (bytes | str | Awaitable[...] by method, whatever the client's options), which
#: would want a cast at every call; this is the one place they are taken as what they are.
Client: TypeAlias = Any
#: The same for redis.asyncio (redis.asyncio.Redis or RedisCluster).
AsyncClient: TypeAlias = Any


def _cluster(kind: Any, nodes: list[Any], options: dict[str, Any]) -> Any:
    """A RedisCluster client of either kind (redis-py 5.0's types call both abstract), which
    finds FCALL's keys itself, as it does EVALSHA's: redis-py asks the server (COMMAND
    GETKEYS, a round trip more for every script call, a pipeline's too) for those of a
    command whose keys move, FCALL among them."""
    client = kind(startup_nodes=nodes, **options)
    parser = client.commands_parser
    get_keys = parser.get_keys
    if inspect.iscoroutinefunction(get_keys):
        async def get_keys_async(*args: Any) -> Any:
            return _fcall_keys(args) if _is_fcall(args) else await get_keys(*args)
        parser.get_keys = get_keys_async
    else:
        parser.get_keys = lambda conn, *args: _fcall_keys(args) if _is_fcall(args) else get_keys(conn, *args)
    return client


def _is_fcall(args: tuple[Any, ...]) -> bool:
    return len(args) > 2 and str(args[0]).upper() == "FCALL"


def _fcall_keys(args: tuple[Any, ...]) -> list[Any]:
    """FCALL's keys: FCALL <function> <numkeys> <key>... <arg>..."""
    return list(args[3:3 + int(args[2])])


def connect(url: str | None = None, **options: Any) -> Client:
    """A client with replies decoded as UTF-8 (the wire format is JSON text)."""
    url = url or default_url()
    options.setdefault("decode_responses", True)
    if url.startswith(SENTINEL_SCHEME + ":"):
        return SentinelURL.parse(url).master(**options)
    if url.startswith(CLUSTER_SCHEME + ":"):
        return ClusterURL.parse(url).client(**options)
    if "://" not in url:
        raise BadURL(f"bad Redis URL {redact(url)!r}: expected {FORMS}")
    check_db(url)
    _tls(url, options)
    if not url.startswith("unix:"):
        options.setdefault("socket_keepalive", True)
    options.setdefault("socket_timeout", SOCKET_TIMEOUT)  # the URL's own wins
    try:
        return redis.Redis.from_url(url, **options)
    except ValueError as e:
        raise BadURL(f"bad Redis URL {redact(url)!r}: {e}; expected {FORMS}") from None


CERT_REQS = ("none", "optional", "required")


def _tls(url: str, options: dict[str, Any]) -> None:
    """TASKRUNNER_REDIS_SSL_CERT_REQS for a rediss:// URL the platform sets and the user
    cannot add `?ssl_cert_reqs=none` to: Heroku Redis serves TLS with a self-signed
    certificate, which redis-py's default (required) refuses. The URL's own setting wins."""
    reqs = os.environ.get("TASKRUNNER_REDIS_SSL_CERT_REQS", "").strip().lower()
    if not reqs or not url.startswith("rediss:"):
        return
    if reqs not in CERT_REQS:
        raise BadURL(f"TASKRUNNER_REDIS_SSL_CERT_REQS={reqs!r}: expected one of {', '.join(CERT_REQS)}")
    options.setdefault("ssl_cert_reqs", reqs)


def connect_async(url: str | None = None, **options: Any) -> AsyncClient:
    """connect() for redis.asyncio."""
    url = url or default_url()
    options.setdefault("decode_responses", True)
    if url.startswith(SENTINEL_SCHEME + ":"):
        return SentinelURL.parse(url).master_async(**options)
    if url.startswith(CLUSTER_SCHEME + ":"):
        return ClusterURL.parse(url).client_async(**options)
    check_db(url)
    _tls(url, options)
    options.setdefault("socket_timeout", SOCKET_TIMEOUT)  # the URL's own wins
    try:
        return redis.asyncio.Redis.from_url(url, **options)
    except ValueError as e:
        raise BadURL(f"bad Redis URL {redact(url)!r}: {e}; expected {FORMS}") from None


async def close_async(client: AsyncClient) -> None:
    """Close an asyncio client of connect_async() with what it opened: its pool and, for a
    Sentinel-managed one, its connections to the sentinels. redis-py 5.0's aclose() leaves
    open a pool given to the client (as master_for gives it), and nothing closes the
    sentinels' own: the garbage collector closed them after their event loop had ended
    ("Event loop is closed", seen with redis-py 5.0.8)."""
    pool = getattr(client, "connection_pool", None)
    if isinstance(pool, AsyncSentinelPool):
        await client.aclose(close_connection_pool=True)
        for sentinel in pool.sentinel_manager.sentinels:
            await sentinel.aclose()
    else:
        await client.aclose()
