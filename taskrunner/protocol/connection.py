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
percent-encoded (see _split).
"""

from __future__ import annotations

import contextlib
import inspect
import ipaddress
import logging
import os
import re
import select
import socket
import struct
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.connection import wait
from pathlib import Path
from typing import Any, TypeAlias
from urllib.parse import parse_qsl, unquote, urlsplit

import hiredis
import redis
import redis.asyncio
import redis.asyncio.cluster
import redis.asyncio.sentinel
import redis.cluster
import redis.crc
import redis.sentinel

from taskrunner.errors import BadURL

EMBEDDED_DIR = Path("var")
SENTINEL_SCHEME = "redis+sentinel"
SENTINEL_FORM = ("redis+sentinel://[[user]:password@]host[:port][,host[:port]...]/service[/db]"
                 "[?sentinel_password=...&socket_timeout=...]")
CLUSTER_SCHEME = "redis+cluster"
CLUSTER_FORM = "redis+cluster://[[user]:password@]host[:port][,host[:port]...][?socket_timeout=...]"
FORMS = (f"redis://[[user]:password@]host[:port][/db], rediss://..., unix:///path[?db=N], {CLUSTER_FORM} "
         f"or {SENTINEL_FORM}")
_SENTINEL_PORT = 26379
_REDIS_PORT = 6379
_HOST = re.compile(r"^(?:\[(?P<ipv6>[^\[\]]+)\]|(?P<name>[A-Za-z0-9_.-]+))(?::(?P<port>[0-9]{1,5}))?$")
_FLOAT_OPTIONS = ("socket_timeout", "socket_connect_timeout")
_STR_OPTIONS = ("sentinel_username", "sentinel_password")
RECHECK = 1.0  # seconds between looks at which node the sentinels call the primary
#: Seconds an answer Redis owes at once may take, unless the URL says (socket_timeout):
#: redis-py 6 and later default to this, 5.x to none, where a Redis that stops answering
#: (SIGSTOP, a partition) hangs a worker's loop, and its stopping, for good. Blocking
#: commands are waited for longer (see slack()).
SOCKET_TIMEOUT = 5.0
log = logging.getLogger("taskrunner")


def default_url() -> str:
    """REDIS_URL if set; else the socket of a `taskrunner up` running here; else localhost."""
    url = os.environ.get("REDIS_URL")
    if url:
        return url
    sock = EMBEDDED_DIR / "redis.sock"
    if sock.exists():
        return f"unix://{sock.resolve()}"
    return "redis://127.0.0.1:6379/0"


def redact(url: str) -> str:
    """The URL with its passwords hidden, fit for error messages and logs: the userinfo's up
    to the last '@' (a raw '/' or '@' in it too, at the cost of hiding more), and the
    password options (?password=, ?sentinel_password=)."""
    url = re.sub(r"(://[^:@/?#]*:).*@", r"\1***@", url)
    return re.sub(r"([?&](?:sentinel_)?password=)[^&#]*", r"\1***", url)


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
        bad = _complaint(url, SENTINEL_FORM)
        sentinels, user, password, path, options = _parse(url, SENTINEL_SCHEME, _SENTINEL_PORT, bad, _STR_OPTIONS)
        if not path or not path[0] or len(path) > 2 or (len(path) == 2 and not path[1].isdigit()):
            raise bad("the path must be /service or /service/db")
        sentinel_options: dict[str, Any] = {"socket_timeout": 1.0, "socket_connect_timeout": 1.0}
        for key in _STR_OPTIONS:
            if key in options:
                sentinel_options[key.removeprefix("sentinel_")] = options.pop(key)
        return cls(sentinels, path[0], int(path[1]) if len(path) == 2 else 0, user, password, sentinel_options,
                   options)

    def _master_options(self, options: dict[str, Any]) -> dict[str, Any]:
        return {"db": self.db, "username": self.username, "password": self.password, "socket_keepalive": True,
                "socket_connect_timeout": 5.0, "socket_timeout": SOCKET_TIMEOUT, **self.options, **options}

    def master(self, **options: Any) -> Client:
        """A client of the current primary (found anew by each connection it opens)."""
        sentinel = redis.sentinel.Sentinel(self.sentinels, sentinel_kwargs=self.sentinel_options)
        return sentinel.master_for(self.service, connection_pool_class=SentinelPool, **self._master_options(options))

    def master_async(self, **options: Any) -> AsyncClient:
        """The same for redis.asyncio."""
        sentinel = redis.asyncio.sentinel.Sentinel(self.sentinels, sentinel_kwargs=self.sentinel_options)
        return sentinel.master_for(self.service, connection_pool_class=AsyncSentinelPool,
                                   **self._master_options(options))


def _complaint(url: str, form: str) -> Callable[[str], BadURL]:
    """Makes the error of a bad URL: what is wrong, and the form expected."""

    def bad(why: str) -> BadURL:
        return BadURL(f"bad Redis URL {redact(url)!r}: {why}; expected {form}")

    return bad


def _split(url: str, scheme: str, bad: Callable[[str], ValueError]) -> tuple[str | None, str, str, str]:
    """(userinfo or None, host list, path, query) of scheme://[userinfo@]hosts[/path][?query],
    split here by RFC 3986's rules rather than by urlsplit: urlsplit checks a netloc as one
    host, and how differs between Python builds (Debian's 3.11.2 refuses "10.0.0.1,[::1]:7001"
    as an invalid IPv6 URL, 3.11.7 takes it). The authority ends at the first '/', '?' or '#';
    within it the last '@' ends the userinfo, so a raw '@' or ':' in a password works, while
    '/', '?' and '#' there must be percent-encoded."""
    head, sep, rest = url.partition("://")
    if not sep or head.lower() != scheme:
        raise bad(f"it must start with {scheme}://")
    end = min((i for i in map(rest.find, "/?#") if i >= 0), default=len(rest))
    authority, rest = rest[:end], rest[end:]
    userinfo, at, hosts = authority.rpartition("@")
    if not at and "@" in rest:  # the userinfo was cut short: a '/', '?' or '#' in it
        raise bad("a '/', '?' or '#' in the user or password must be percent-encoded (%2F, %3F, %23)")
    rest, hash_, _ = rest.partition("#")
    if hash_:
        raise bad("'#' has no place in it (in the password, write it %23)")
    path, _, query = rest.partition("?")
    return (userinfo if at else None), hosts, path, query


def _hosts(hosts: str, default_port: int, bad: Callable[[str], ValueError]) -> tuple[tuple[str, int], ...]:
    """[(host, port)] of "host[:port],...", an IPv6 address in brackets."""
    if not hosts:
        raise bad("no host given")
    found = []
    for host in hosts.split(","):
        m = _HOST.match(host)
        if not m:
            hint = " (an IPv6 address goes in brackets: [::1]:port)" if host.count(":") > 1 else ""
            raise bad(f"{host!r} is not host[:port]{hint}")
        port = int(m["port"] or default_port)
        if not 0 < port < 65536:
            raise bad(f"{host!r} is not host[:port] (a port is 1-65535)")
        if m["ipv6"] is not None:
            try:
                ipaddress.IPv6Address(unquote(m["ipv6"]))
            except ValueError:
                raise bad(f"{host!r} is not host[:port] ({m['ipv6']!r} is not an IPv6 address)") from None
        found.append((unquote(m["ipv6"]) if m["ipv6"] is not None else m["name"], port))
    return tuple(found)


def _parse(url: str, scheme: str, default_port: int, bad: Callable[[str], ValueError], str_options: tuple[str, ...] = ()
           ) -> tuple[tuple[tuple[str, int], ...], str | None, str | None, list[str], dict[str, Any]]:
    """(hosts, user, password, path segments, options) of a URL naming several hosts."""
    userinfo, hosts, path, query = _split(url, scheme, bad)
    user, _, password = (userinfo or "").partition(":")
    options: dict[str, Any] = {}
    try:
        pairs = parse_qsl(query, keep_blank_values=True, strict_parsing=bool(query))
    except ValueError:
        raise bad("the options after '?' must be name=value pairs joined by '&'") from None
    for key, value in pairs:
        if key in _FLOAT_OPTIONS:
            try:
                options[key] = float(value)
            except ValueError:
                raise bad(f"{key} must be a number of seconds") from None
        elif key in str_options:
            options[key] = value
        else:
            raise bad(f"unknown option {key!r} (known: {', '.join(_FLOAT_OPTIONS + str_options)})")
    segments = [unquote(p) for p in path.split("/")[1:]]
    return _hosts(hosts, default_port, bad), unquote(user) or None, unquote(password) or None, segments, options


@dataclass(frozen=True)
class ClusterURL:
    """A parsed redis+cluster:// URL."""

    nodes: tuple[tuple[str, int], ...]
    username: str | None = None
    password: str | None = field(default=None, repr=False)
    options: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def parse(cls, url: str) -> ClusterURL:
        bad = _complaint(url, CLUSTER_FORM)
        nodes, user, password, path, options = _parse(url, CLUSTER_SCHEME, _REDIS_PORT, bad)
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
    _check_db(url)
    _tls(url, options)
    if not url.startswith("unix:"):
        options.setdefault("socket_keepalive", True)
    options.setdefault("socket_timeout", SOCKET_TIMEOUT)  # the URL's own wins
    try:
        return redis.Redis.from_url(url, **options)
    except ValueError as e:
        raise BadURL(f"bad Redis URL {redact(url)!r}: {e}; expected {FORMS}") from None


def _check_db(url: str) -> None:
    """redis-py reads redis://host/abc as database 0, and /1/2 as 12: refuse a path that
    is not one number (a unix:// URL's path is its socket; its ?db= redis-py checks)."""
    db = "" if url.startswith("unix:") else urlsplit(url).path.strip("/")
    if db and not db.isdigit():
        raise BadURL(f"bad Redis URL {redact(url)!r}: the database {db!r} is not a number; expected {FORMS}")


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


PENDING = object()  # a reply not (all) come yet


class _Link:
    """One thread's connection. redis-py opens it (AUTH, SELECT, HELLO: the pool's settings);
    then we write packed commands to its socket and parse the replies with hiredis. The
    socket blocks, its timeout kept by the kernel (SO_RCVTIMEO, SO_SNDTIMEO): Python polls
    before every send and every recv on a socket that has a timeout of its own. With `spin`,
    a reply is polled for that many seconds before we sleep on the socket."""

    def __init__(self, pool: redis.ConnectionPool, spin: float = 0.0) -> None:
        self.conn = pool.connection_class(**pool.connection_kwargs)
        self.sock: socket.socket | None = None
        self.reader: Any = None
        self.spin = spin

    def _open(self) -> socket.socket:
        conn = self.conn
        conn.connect()
        sock = conn._sock  # redis-py's own attribute; test_redis_restart would catch a change
        sock.settimeout(None)
        if conn.socket_timeout:
            t = float(conn.socket_timeout)
            timeval = struct.pack("ll", int(t), int(t % 1 * 1e6))
            for option in (socket.SO_RCVTIMEO, socket.SO_SNDTIMEO):
                sock.setsockopt(socket.SOL_SOCKET, option, timeval)
        enc = conn.encoder
        decoding = {"encoding": enc.encoding, "errors": enc.encoding_errors} if enc.decode_responses else {}
        assert _PARSE_ERROR is not None  # FAST_PATH: only then is this class used
        self.reader = hiredis.Reader(protocolError=redis.exceptions.InvalidResponse,
                                     replyError=_PARSE_ERROR, **decoding)
        self.sock = sock
        return sock

    def close(self) -> None:
        self.sock = self.reader = None
        self.conn.disconnect()

    def write(self, data: bytes) -> None:
        try:
            (self.sock or self._open()).sendall(data)
        except BlockingIOError:
            raise redis.TimeoutError("Timeout writing to socket") from None
        except OSError as e:
            raise redis.ConnectionError(f"Error while writing to socket: {e}") from None

    def ask(self, packed: bytes) -> Any:
        """Send one packed command and return its reply (an error reply too, not raised)."""
        self.write(packed)
        return self.reply()

    def call(self, packed: bytes) -> Any:
        """ask(), and again on a connection error: a connection that Redis dropped while
        idle (a restart, CLIENT KILL) fails here first, so connect again and retry, as the
        pool's check at checkout would; then the client's retry policy."""
        try:
            return self.ask(packed)
        except (redis.ConnectionError, redis.TimeoutError):
            self.close()
            return self.conn.retry.call_with_retry(lambda: self.ask(packed), lambda error: self.close())

    def reply(self, block: bool = True) -> Any:
        """The next reply; an error reply is returned (a ResponseError), not raised. Without
        block, PENDING when it has not all come yet."""
        if self.reader is None or self.sock is None:
            raise redis.ConnectionError("Connection closed before its replies were read.")
        spin_until = time.perf_counter() + self.spin if block and self.spin else 0.0
        while (r := self.reader.gets()) is False:
            polling = not block or (spin_until and time.perf_counter() < spin_until)
            try:
                data = self.sock.recv(65536, socket.MSG_DONTWAIT if polling else 0)
            except BlockingIOError:
                if not block:
                    return PENDING
                if polling:
                    continue
                raise redis.TimeoutError("Timeout reading from socket") from None
            except OSError as e:
                raise redis.ConnectionError(f"Error while reading from socket: {e}") from None
            if not data:
                raise redis.ConnectionError("Connection closed by server.")
            self.reader.feed(data)
        return r


def _internals() -> Callable[[str], Exception] | None:
    """What _Link takes from redis-py beyond its public API, or None where this redis-py
    differs: its parser's mapping of an error reply to an exception (redis._parsers.base,
    since 5.0), and a connection's _sock (the socket once connected), encoder, retry and
    socket_timeout. Checked once, at import: with None, Direct.of() and Channel.of() give
    None and every command takes redis-py's public path (slower, the same results)."""
    try:
        from redis._parsers.base import BaseParser

        conn = redis.Connection()  # not connected: only its attributes are looked at
        parse_error = BaseParser.parse_error
    except (ImportError, AttributeError, TypeError):
        return None
    if not (all(hasattr(conn, a) for a in ("_sock", "encoder", "retry", "socket_timeout"))
            and hasattr(hiredis, "pack_command") and callable(parse_error)):
        return None
    return parse_error


_PARSE_ERROR = _internals()
FAST_PATH = _PARSE_ERROR is not None  # this redis-py has what Direct and Channel need


def _plain(client: Any) -> bool:
    """A client whose pool opens plain TCP or unix-socket connections to one server (not
    TLS, Sentinel or Cluster, no client-side cache: redis-py 5.1+'s `cache`, which must see
    every read) and a redis-py whose internals we know (FAST_PATH): we can use their
    sockets ourselves."""
    return _plain_pool(getattr(client, "connection_pool", None))


def _plain_pool(pool: Any) -> bool:
    """A pool of plain TCP or unix-socket connections, as _plain() says."""
    return (FAST_PATH and type(pool) is redis.ConnectionPool and getattr(pool, "cache", None) is None
            and pool.connection_class in (redis.Connection, redis.UnixDomainSocketConnection))


def _cpus() -> int:
    """CPUs this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def _on_this_machine(pool: redis.ConnectionPool) -> bool:
    """Does the pool connect to a unix socket or a loopback address?"""
    if pool.connection_class is redis.UnixDomainSocketConnection:
        return True
    host = str(pool.connection_kwargs.get("host", "localhost"))
    try:
        return host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class Direct:
    """A connection per thread, used directly, for the one hot single-command path (a lone
    enqueue): redis-py spends more CPU on a command than Redis does, taking a connection
    from the pool and giving it back (with a poll() to check it), in event and metrics
    hooks, and in a poll() before each send and recv. Same connection settings and retry
    policy as the client's own; a connection that failed mid-command is closed, never
    reused with a reply half read. Only for a plain pool of TCP or unix-socket connections
    (not TLS, Sentinel or Cluster): of() gives None otherwise. Its connections are not the
    pool's: each goes with its thread.

    `spin`: seconds to poll for a reply before sleeping on the socket (Settings.enqueue_spin)
    when Redis is on this machine and we have more than one CPU: a caller that waits for the
    answer anyway is then awake when it comes, where waking a sleeping process can take
    longer than Redis's work. A remote Redis's answer takes the network's round trip: no spin."""

    def __init__(self, client: redis.Redis, spin: float = 0.0) -> None:
        self.client = client
        self.pool = client.connection_pool
        self.local = threading.local()
        self.spin = spin if _cpus() > 1 and _on_this_machine(self.pool) else 0.0

    @classmethod
    def of(cls, client: Any, spin: float = 0.0) -> Direct | None:
        return cls(client, spin) if _plain(client) else None

    def _on_link(self, work: Callable[..., Any], *args: Any) -> Any:
        """work(this thread's link, *args); a link that failed mid-command is closed (error
        replies are returned by the link, not raised: they leave it fine)."""
        link = getattr(self.local, "link", None)
        if link is None:
            link = self.local.link = _Link(self.pool, self.spin)
        try:
            return work(link, *args)
        except BaseException:
            link.close()
            raise

    def execute_command(self, *args: Any) -> Any:
        r = self._on_link(_Link.call, hiredis.pack_command(args))
        if isinstance(r, redis.ResponseError):
            raise r
        return r

    def send(self, commands: list[tuple[Any, ...]]) -> int:
        """Send commands and return without their answers (read() them): the caller works
        meanwhile. No retry: a caller whose read() fails does it all again another way."""
        self._on_link(_Link.write, b"".join(hiredis.pack_command(c) for c in commands))
        return len(commands)

    def read(self, n: int) -> list[Any]:
        """The answers to the last n commands sent; an error reply is returned, not raised."""
        return self._on_link(lambda link: [link.reply() for _ in range(n)])


class Channel:
    """A connection of its own on which batches of commands stay in flight: send() returns
    at once, select() on fileno() tells when answers come, and take() gives each batch's
    answers once they have all come. The worker's syncs: Redis runs one while the worker
    reads its children, instead of each waiting on the other. Nothing is ever sent again:
    a batch whose answers were lost may have run, and the caller reconciles. The client's
    socket_timeout bounds the wait for an answer (deadline()). Plain pools only, as
    Direct: of() gives None otherwise."""

    def __init__(self, client: redis.Redis) -> None:
        self.link = _Link(client.connection_pool)
        self.sizes: deque[int] = deque()  # commands per batch in flight, oldest first
        self.got: list[Any] = []  # the oldest batch's answers come so far
        self.heard = 0.0  # monotonic; the last answer, or the send that ended a silence

    @classmethod
    def of(cls, client: Any) -> Channel | None:
        return cls(client) if _plain(client) else None

    def send(self, commands: list[tuple[Any, ...]]) -> None:
        try:
            self.link.write(b"".join(hiredis.pack_command(c) for c in commands))
        except BaseException:
            self.close()
            raise
        if not self.sizes:
            self.heard = time.monotonic()
        self.sizes.append(len(commands))

    def deadline(self) -> float:
        """When what is in flight counts as lost, if no answer comes before (monotonic)."""
        timeout = self.link.conn.socket_timeout
        return self.heard + float(timeout) if timeout and self.sizes else float("inf")

    def fileno(self) -> int:
        return self.link.sock.fileno()  # type: ignore[union-attr]  # open while batches are in flight

    def take(self, block: bool = False) -> list[list[Any]]:
        """The batches answered whole since the last call, oldest first (block: wait for
        every one in flight); an error reply is returned, not raised."""
        done = []
        try:
            while self.sizes:
                r = self.link.reply(block)
                if r is PENDING:
                    break
                self.heard = time.monotonic()
                self.got.append(r)
                if len(self.got) == self.sizes[0]:
                    done.append(self.got)
                    self.got = []
                    self.sizes.popleft()
        except BaseException:
            self.close()
            raise
        return done

    def close(self) -> None:
        """Forget what is in flight (the caller reconciles) and the connection."""
        self.link.close()
        self.sizes.clear()
        self.got = []


class _NodeLink(_Link):
    """A ClusterChannel's connection to one primary: what it owes, in the order sent."""

    def __init__(self, pool: redis.ConnectionPool) -> None:
        super().__init__(pool)
        self.owed: deque[tuple[_Spread, int]] = deque()  # (batch, index in it) per command sent
        self.fd = -1  # registered with the channel's epoll while open
        self.heard = 0.0  # monotonic; its last answer, or the send that ended its silence


class _Spread:
    """A batch a ClusterChannel has in flight: its answers, each in its command's place."""

    __slots__ = ("answers", "left")

    def __init__(self, n: int) -> None:
        self.answers: list[Any] = [None] * n
        self.left = n


#: Script calls, whose first key is their 4th word (FCALL/EVALSHA <name> <numkeys> <key>...).
_CALLS = ("FCALL", "EVALSHA")


class ClusterChannel:
    """Channel for a Redis Cluster: a batch's commands go each to the primary that owns its
    first key's slot (redis-py's slot map), packed with hiredis and written on a connection
    of our own to each primary; one epoll over those connections is what select() waits
    on, and a batch is taken once every primary has answered its share. What redis-py's
    ClusterPipeline spends per command (command objects, a connection from a pool for each
    node and back, response callbacks, a blocking read of every node in turn) took half a
    busy worker's main-process CPU on a queue of 12 shards, the worker waiting meanwhile.
    As Channel, nothing is ever sent again: a batch whose answers were lost may have run
    (the caller reconciles), and after close() the next send() reads the cluster's layout
    anew (a failover, a node gone). A MOVED or ASK answer is taken as any answer, and
    scripts.Batch.settle fails the batch on it (a resharding or a failover: the caller
    reconciles, then closes us). Each primary's silence is timed apart: one that stopped
    answering is found within socket_timeout of its own last answer, whatever the others
    answer. Plain connections only (not TLS), and where select.epoll is (Linux): of()
    gives None otherwise."""

    def __init__(self, client: redis.cluster.RedisCluster) -> None:
        self.client = client
        timeout = client.nodes_manager.connection_kwargs.get("socket_timeout")
        self.timeout = float(timeout) if timeout else None
        self.links: dict[str, _NodeLink] = {}  # node name -> link
        self.by_fd: dict[int, _NodeLink] = {}
        self.poller = select.epoll()
        self.spreads: deque[_Spread] = deque()  # oldest first
        self.stale = False  # read the layout before the next send

    @classmethod
    def of(cls, client: Any) -> ClusterChannel | None:
        if not (isinstance(client, redis.cluster.RedisCluster) and hasattr(select, "epoll")):
            return None
        pool = client.get_redis_connection(client.get_default_node()).connection_pool
        return cls(client) if _plain_pool(pool) else None

    def _link(self, command: tuple[Any, ...]) -> _NodeLink:
        """The link to the primary of the command's (first) key's slot."""
        if command[0] in _CALLS and int(command[2]):
            slot = redis.crc.key_slot(self.client.encoder.encode(command[3]))
        else:
            found = self.client.determine_slot(*command)
            if found is None:  # a command to every node: not in a batch
                raise redis.exceptions.RedisClusterException(f"{command[0]} has no key to route it by")
            slot = found
        node = self.client.nodes_manager.get_node_from_slot(slot)
        link = self.links.get(node.name)
        if link is None:
            link = self.links[node.name] = _NodeLink(self.client.get_redis_connection(node).connection_pool)
        return link

    def send(self, commands: list[tuple[Any, ...]]) -> None:
        try:
            if self.stale:
                self.client.nodes_manager.initialize()
                self.stale = False
            self._drop_closed()
            spread = _Spread(len(commands))
            shares: dict[_NodeLink, list[bytes]] = {}
            for i, command in enumerate(commands):
                link = self._link(command)
                link.owed.append((spread, i))
                shares.setdefault(link, []).append(hiredis.pack_command(command))
            now = time.monotonic()
            for link, packed in shares.items():
                if len(link.owed) == len(packed):  # it owed nothing before: its silence starts now
                    link.heard = now
                link.write(b"".join(packed))
                if link.fd < 0:
                    fd = link.sock.fileno()  # type: ignore[union-attr]  # open once written
                    self.poller.register(fd, select.EPOLLIN)
                    link.fd = fd
                    self.by_fd[fd] = link
        except BaseException:
            self.close()
            raise
        self.spreads.append(spread)

    def _drop_closed(self) -> None:
        """Drop the links that are readable while owing nothing: their node closed them while
        idle (its `timeout` setting, a restart). Written to, they would fail the next batch,
        and nothing was sent on them yet, so a new connection is safe."""
        for fd, _ in self.poller.poll(0):
            link = self.by_fd.get(fd)
            if link is not None and not link.owed:
                self._drop(link)

    def deadline(self) -> float:
        """When what is in flight counts as lost, if no answer comes before (monotonic): the
        earliest of the primaries owing answers, each timed from its own last answer."""
        if not self.timeout:
            return float("inf")
        return min((link.heard + self.timeout for link in self.links.values() if link.owed), default=float("inf"))

    def fileno(self) -> int:
        return self.poller.fileno()

    def take(self, block: bool = False) -> list[list[Any]]:
        """The batches answered whole since the last call, oldest first (block: wait for
        every one in flight, until deadline() at most: then TimeoutError); an error reply
        is returned, not raised."""
        try:
            while True:
                for fd, _ in self.poller.poll(0):
                    link = self.by_fd.get(fd)
                    if link is None:
                        continue
                    if not link.owed:  # readable while owing nothing: the node closed it
                        self._drop(link)
                        continue
                    while link.owed:
                        r = link.reply(block=False)
                        if r is PENDING:
                            break
                        spread, i = link.owed.popleft()
                        spread.answers[i] = r
                        spread.left -= 1
                        link.heard = time.monotonic()
                if not (block and self.spreads and self.spreads[-1].left):
                    break
                wait = self.deadline() - time.monotonic()
                if wait <= 0:
                    raise redis.TimeoutError("no answer from a Redis Cluster primary within socket_timeout")
                self.poller.poll(-1 if wait == float("inf") else wait)  # one that answers, or the deadline
        except BaseException:
            self.close()
            raise
        done = []
        while self.spreads and not self.spreads[0].left:
            done.append(self.spreads.popleft().answers)
        return done

    def _drop(self, link: _NodeLink) -> None:
        if link.fd >= 0:
            # Unregistered by hand: forked children hold the socket too, and epoll forgets
            # a socket only once every process has closed it.
            with contextlib.suppress(OSError):  # closed already: nothing to forget
                self.poller.unregister(link.fd)
            del self.by_fd[link.fd]
            link.fd = -1
        link.owed.clear()
        link.close()
        self.links = {name: x for name, x in self.links.items() if x is not link}

    def close(self) -> None:
        """Forget what is in flight (the caller reconciles) and the connections; the next
        send() reads the cluster's layout first."""
        for link in list(self.links.values()):
            self._drop(link)
        self.spreads.clear()
        self.stale = True


def connect_async(url: str | None = None, **options: Any) -> AsyncClient:
    """connect() for redis.asyncio."""
    url = url or default_url()
    options.setdefault("decode_responses", True)
    if url.startswith(SENTINEL_SCHEME + ":"):
        return SentinelURL.parse(url).master_async(**options)
    if url.startswith(CLUSTER_SCHEME + ":"):
        return ClusterURL.parse(url).client_async(**options)
    _check_db(url)
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


def slack(socket_timeout: float | None) -> float:
    """Seconds a blocking command's answer may come after its own timeout before the
    connection counts as hung: the connection's socket_timeout (what an answer due at once
    may take), at least 1 s; 5 s where it has none."""
    return max(1.0, float(socket_timeout or 5.0))


def transient(e: BaseException) -> bool:
    """A Redis error that passes by itself, after which a waiter connects again and looks
    again: Redis down or restarting (connection errors, LOADING), unreachable for a while
    (timeouts), failing over (READONLY, a blocked command UNBLOCKED, MASTERDOWN), a cluster
    resharding or electing (MOVED, ASK, TRYAGAIN, CLUSTERDOWN) or with no node reachable."""
    passing = (redis.ConnectionError, redis.TimeoutError, redis.exceptions.ReadOnlyError,
               redis.exceptions.ClusterError, redis.exceptions.ClusterDownError, redis.exceptions.TryAgainError,
               redis.exceptions.MovedError, redis.exceptions.AskError, redis.exceptions.RedisClusterException)
    return isinstance(e, passing) or (isinstance(e, redis.ResponseError)
                                      and str(e).startswith(("UNBLOCKED", "MASTERDOWN", "BUSY ")))


class Outage:
    """How a process that rides out a Redis outage says so: one warning when Redis stops
    answering, the tries after it at debug level, and one line when it answers again. A
    line per try filled a worker's log with one every heartbeat for as long as Redis was
    down, and hid when it came back."""

    def __init__(self, what: str, logger: logging.Logger = log) -> None:
        self.what, self.log = what, logger
        self.since: float | None = None  # when this outage began (monotonic); None: Redis answers

    def failed(self, error: BaseException | str, pause: float | None, bound: str = "") -> None:
        """A try failed with `error` (or what it means); the next comes in `pause` seconds
        (None: when asked, as the dashboard's next request; `bound`: how long or when the
        tries go on, said in the warning)."""
        if self.since is None:
            self.since = time.monotonic()
            self.log.warning("%s: Redis unavailable (%s); trying again until it answers%s", self.what, error, bound)
        elif pause is None:
            self.log.debug("%s: Redis still unavailable (%s)", self.what, error)
        else:
            self.log.debug("%s: Redis still unavailable (%s); retrying in %.1fs", self.what, error, pause)

    def ok(self) -> None:
        """A try went through."""
        if self.since is not None:
            self.log.info("%s: Redis answers again (unavailable for %.1fs)", self.what, time.monotonic() - self.since)
            self.since = None


class Backoff:
    """The pauses of a waiter whose Redis failed (transient()): 0.1 s doubling up to 2 s,
    so that a restart is noticed soon after it ends, without hammering a Redis that is
    down; one warning per outage (Outage). A wait with a deadline makes its last try at the
    deadline (the pause before it cut short), then gives up (raises the error): the job's
    state is then unknown. (It gave up when the next pause would pass the deadline: a 15 s
    bound tried last ~2 s before it, missing a failover that ended just inside it.)"""

    def __init__(self, what: str, deadline: float | None) -> None:
        self.what, self.deadline = what, deadline
        self.pause = 0.0
        self.outage = Outage(what)

    def after(self, error: BaseException) -> float:
        """Seconds to pause before the next try; raises `error` where that is not for
        us to ride out."""
        if not transient(error):
            raise error
        self.pause = min(max(self.pause * 2, 0.1), 2.0)
        if self.deadline is None:
            self.outage.failed(error, self.pause)
            return self.pause
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise error
        self.outage.failed(error, min(self.pause, left), f" (for {round(left, 1):g}s at most)")
        return min(self.pause, left)

    def ok(self) -> None:
        self.outage.ok()
        self.pause = 0.0


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
