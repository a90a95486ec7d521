"""Our own connections for the hot paths, past redis-py's per-command work: Direct (a lone
enqueue's one command), Channel (a worker's batches in flight on one server) and
ClusterChannel (the same over a Redis Cluster's primaries). Each packs commands with hiredis
and parses replies itself on a connection redis-py opened with the client's settings; where
this redis-py lacks what they need (FAST_PATH), or the client is not a plain one (TLS or
Sentinel, which Channel takes but for TLS through Sentinel), of() gives None and callers take
redis-py's public path.
"""

from __future__ import annotations

import contextlib
import errno
import ipaddress
import os
import select
import socket
import ssl
import struct
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import hiredis
import redis
import redis.cluster
import redis.crc
import redis.sentinel

from taskrunner.protocol.connection import SentinelPool

PENDING = object()  # a reply not (all) come yet


class _Link:
    """One thread's connection. redis-py opens it (AUTH, SELECT, HELLO: the pool's settings);
    then we write packed commands to its socket and parse the replies with hiredis. The
    socket blocks, its timeout kept by the kernel (SO_RCVTIMEO, SO_SNDTIMEO): Python polls
    before every send and every recv on a socket that has a timeout of its own. With `spin`,
    a reply is polled for that many seconds before we sleep on the socket. A TLS socket
    (Channel only) keeps redis-py's timeout: Python's ssl reads again after each EAGAIN
    from a blocking socket, so the kernel's would bound no read; it is polled with a
    timeout of 0 for the while."""

    def __init__(self, pool: redis.ConnectionPool, spin: float = 0.0) -> None:
        self.conn = pool.connection_class(**pool.connection_kwargs)
        self.sock: socket.socket | None = None
        self.reader: Any = None
        self.spin = spin
        self.tls = False
        self.timeout: float | None = None  # a TLS socket's own

    def _open(self) -> socket.socket:
        conn = self.conn
        conn.connect()
        sock = conn._sock  # redis-py's own attribute; test_redis_restart would catch a change
        self.tls = isinstance(sock, ssl.SSLSocket)
        if self.tls:
            self.timeout = sock.gettimeout()
        else:
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
        except (BlockingIOError, TimeoutError):
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
                if self.tls:
                    data = self._recv_tls(bool(polling))
                else:
                    data = self.sock.recv(65536, socket.MSG_DONTWAIT if polling else 0)
            except (BlockingIOError, ssl.SSLWantReadError, TimeoutError):
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

    def _recv_tls(self, polling: bool) -> bytes:
        sock = self.sock
        assert sock is not None
        if not polling:
            return sock.recv(65536)
        sock.settimeout(0.0)  # ssl takes no MSG_DONTWAIT
        try:
            return sock.recv(65536)
        finally:
            sock.settimeout(self.timeout)


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


def _plain_pool(pool: Any, tls: bool = False) -> bool:
    """A pool of plain TCP or unix-socket connections, as _plain() says; with `tls`, of TLS
    connections too."""
    kinds = (redis.Connection, redis.UnixDomainSocketConnection, *((redis.SSLConnection,) if tls else ()))
    return (FAST_PATH and type(pool) is redis.ConnectionPool and getattr(pool, "cache", None) is None
            and pool.connection_class in kinds)


def _sentinel_pool(pool: Any) -> bool:
    """A pool of plain TCP connections to the primary Sentinel names (taskrunner's own
    SentinelPool, which rechecks it), where this redis-py has what Channel needs."""
    return (FAST_PATH and type(pool) is SentinelPool and pool.is_master and getattr(pool, "cache", None) is None
            and pool.connection_class is redis.sentinel.SentinelManagedConnection)


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

    def drop(self) -> None:
        """Close this thread's link, the answers it is owed unread (its next command opens
        another): a caller that no longer wants them neither waits for them nor leaves
        them to be taken for a later command's."""
        link = getattr(self.local, "link", None)
        if link is not None:
            link.close()


class Channel:
    """A connection of its own on which batches of commands stay in flight: send() returns
    at once, select() on fileno() tells when answers come, and take() gives each batch's
    answers once they have all come. The worker's syncs: Redis runs one while the worker
    reads its children, instead of each waiting on the other. Nothing is ever sent again:
    a batch whose answers were lost may have run, and the caller reconciles. The client's
    socket_timeout bounds the wait for an answer (deadline()). Pools of plain or TLS
    connections to one server, or of plain ones to the primary Sentinel names (_follow);
    not Cluster, no client-side cache: of() gives None otherwise."""

    def __init__(self, client: redis.Redis) -> None:
        self.pool: Any = client.connection_pool  # a SentinelPool's methods are used too
        self.link = _Link(self.pool)
        self.sentinel = isinstance(self.pool, SentinelPool)
        self.sizes: deque[int] = deque()  # commands per batch in flight, oldest first
        self.got: list[Any] = []  # the oldest batch's answers come so far
        self.heard = 0.0  # monotonic; the last answer, or the send that ended a silence

    @classmethod
    def of(cls, client: Any) -> Channel | None:
        pool = getattr(client, "connection_pool", None)
        return cls(client) if _plain_pool(pool, tls=True) or _sentinel_pool(pool) else None

    def send(self, commands: list[tuple[Any, ...]]) -> None:
        try:
            if self.sentinel:
                self._follow()
            self.link.write(b"".join(hiredis.pack_command(c) for c in commands))
        except BaseException:
            self.close()
            raise
        if not self.sizes:
            self.heard = time.monotonic()
        self.sizes.append(len(commands))

    def _follow(self) -> None:
        """Through Sentinel: ask the sentinels which node is the primary, at most every
        RECHECK (a round trip to a sentinel, as SentinelPool makes for redis-py's
        connections), and leave a node that is no longer it (a failover that left the old
        primary up: writes there are thrown away once Sentinel demotes it). Nothing in
        flight: the next write opens a connection to the new primary. Batches in flight:
        ConnectionError, and the caller reconciles with the new primary, which may lack
        what the old one took."""
        if self.link.sock is None:  # opening one asks the sentinels
            return
        if self.pool._due():
            with contextlib.suppress(redis.ConnectionError):  # none known just now: the connection will tell
                self.pool.get_master_address()
        if not self.pool.owns_connection(self.link.conn):
            if self.sizes:
                raise redis.ConnectionError("the Redis primary moved")
            self.link.close()

    def deadline(self) -> float:
        """When what is in flight counts as lost, if no answer comes before (monotonic)."""
        timeout = self.link.conn.socket_timeout
        return self.heard + float(timeout) if timeout and self.sizes else float("inf")

    def fileno(self) -> int:
        return self.link.sock.fileno()  # type: ignore[union-attr]  # open while batches are in flight

    def probe(self) -> Probe:
        """A PING to our server on a socket of its own, waited for without blocking (Probe);
        through Sentinel, to the primary the sentinels name now (a round trip to them)."""
        return Probe(self.link.conn, self.pool.get_master_address() if self.sentinel else None)

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


class Probe:
    """Does the server answer at all? One PING on a socket of its own, connected and read
    without blocking: the caller's select waits on it (for writing while `connecting`, then
    for reading) and calls step() when it is ready, True once any answer has come (+PONG, or
    an error reply such as NOAUTH: the server serves). redis-py opens a connection with a
    handshake (CLIENT SETINFO, AUTH or HELLO, SELECT) whose answers it waits for, each up to
    socket_timeout and again at each of the client's retries: a server that takes
    connections and answers nothing (SIGSTOPped, a hung host: the kernel still completes the
    TCP handshake) held the caller there, a worker's loop among them, reading no child.
    Opening connections once this has answered only narrows that window to what passes
    between the two (a round trip, unless the server hangs just then); the host name's
    lookup (getaddrinfo) blocks here as in redis-py. Over TLS the server takes the PING for
    a bad handshake and closes the connection (a reset: the PING was not all read), which is
    its answer. `deadline`: socket_timeout after it began (monotonic), when the caller counts
    it unanswered."""

    def __init__(self, conn: Any, address: tuple[str, int] | None = None) -> None:
        """A PING to `conn`'s server, or (TCP) to `address`."""
        timeout = conn.socket_timeout
        self.deadline = time.monotonic() + float(timeout) if timeout else float("inf")
        self.tls = isinstance(conn, redis.SSLConnection)
        if isinstance(conn, redis.UnixDomainSocketConnection):
            self.addresses: list[tuple[int, Any]] = [(socket.AF_UNIX, conn.path)]
        else:
            host, port = address or (conn.host, conn.port)
            try:
                found = socket.getaddrinfo(host, port, conn.socket_type, socket.SOCK_STREAM)
            except OSError as e:
                raise redis.ConnectionError(f"Error connecting to {host}:{port}: {e}") from None
            self.addresses = [(family, address) for family, _, _, _, address in found]
        self.sock: socket.socket | None = None
        self.connecting = False
        self._connect(None)

    def _connect(self, error: OSError | None) -> None:
        """Connect to the next address, as redis-py tries each the name has in turn; a
        refusal moves on, the last one's is raised."""
        self.close()
        while self.addresses:
            family, address = self.addresses.pop(0)
            self.sock = socket.socket(family, socket.SOCK_STREAM)
            self.sock.setblocking(False)
            err = self.sock.connect_ex(address)
            if err == errno.EINPROGRESS:  # TCP: writable once connected
                self.connecting = True
                return
            if err == 0:
                self._ping()
                return
            error = OSError(err, os.strerror(err))  # a unix socket's EAGAIN: its backlog is full
            self.close()
        raise redis.ConnectionError(f"Error while connecting: {error}")

    def _ping(self) -> None:
        self.connecting = False
        try:
            self.sock.send(b"PING\r\n")  # type: ignore[union-attr]  # 6 bytes into an empty buffer: all go
        except OSError as e:
            self.close()
            raise redis.ConnectionError(f"Error while writing to socket: {e}") from None

    def fileno(self) -> int:
        return self.sock.fileno()  # type: ignore[union-attr]  # open until answered or failed

    def step(self) -> bool:
        """The socket is ready: connected (send the PING), or an answer came (True)."""
        assert self.sock is not None
        if self.connecting:
            err = self.sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
            if err:
                self._connect(OSError(err, os.strerror(err)))
            else:
                self._ping()
            return False
        try:
            data = self.sock.recv(64)
        except BlockingIOError:
            return False
        except OSError as e:
            self.close()
            if self.tls and isinstance(e, ConnectionResetError):
                return True
            raise redis.ConnectionError(f"Error while reading from socket: {e}") from None
        self.close()
        if not data and not self.tls:
            raise redis.ConnectionError("Connection closed by server.")
        return True

    def close(self) -> None:
        """Shut the connection down, then close: a child forked while it was out holds the
        socket too, and close() alone leaves the connection open for as long as the child
        lives (redis-py's disconnect() shuts down for the same reason)."""
        if self.sock is not None:
            with contextlib.suppress(OSError):  # never connected, or the server reset it
                self.sock.shutdown(socket.SHUT_RDWR)
            self.sock.close()
            self.sock = None


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
                if not (block and any(s.left for s in self.spreads)):  # every primary's: they answer in any order
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


