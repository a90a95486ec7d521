"""Connecting to Redis from a URL; the default is the embedded server of `taskrunner up`.

Besides redis-py's own forms (redis://, rediss://, unix://) this accepts Redis Sentinel:

    redis+sentinel://[[user]:password@]host[:port][,host[:port]...]/service[/db][?option=value&...]

each host:port a sentinel (port 26379 by default), `service` the name the sentinels
monitor (`sentinel monitor <service> ...`), user and password those of the Redis servers.
Options: sentinel_username, sentinel_password (AUTH to the sentinels), socket_timeout,
socket_connect_timeout (seconds). The client asks the sentinels for the current primary
whenever it opens a connection, and at most every RECHECK seconds when it takes one from its
pool: after a failover it moves to the promoted replica even if the old primary is still up.
"""

from __future__ import annotations

import os
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl, unquote, urlsplit

import redis
import redis.asyncio
import redis.asyncio.sentinel
import redis.sentinel

EMBEDDED_DIR = Path("var")
SENTINEL_SCHEME = "redis+sentinel"
SENTINEL_FORM = ("redis+sentinel://[[user]:password@]host[:port][,host[:port]...]/service[/db]"
                 "[?sentinel_password=...&socket_timeout=...]")
FORMS = f"redis://[[user]:password@]host[:port][/db], rediss://..., unix:///path[?db=N] or {SENTINEL_FORM}"
_SENTINEL_PORT = 26379
_HOST = re.compile(r"^(?:\[(?P<ipv6>[0-9A-Fa-f:.]+)\]|(?P<name>[^:\[\]/]+))(?::(?P<port>\d{1,5}))?$")
_FLOAT_OPTIONS = ("socket_timeout", "socket_connect_timeout")
_STR_OPTIONS = ("sentinel_username", "sentinel_password")
RECHECK = 1.0  # seconds between looks at which node the sentinels call the primary


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
    """The URL with its password hidden, fit for error messages and logs."""
    return re.sub(r"(://[^:@/]*:)[^@/]*@", r"\1***@", url)


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
        def bad(why: str) -> ValueError:
            return ValueError(f"bad Redis URL {redact(url)!r}: {why}; expected {SENTINEL_FORM}")

        parts = urlsplit(url)
        if parts.scheme != SENTINEL_SCHEME:
            raise bad(f"scheme is not {SENTINEL_SCHEME}")
        userinfo, _, hosts = parts.netloc.rpartition("@")
        user, _, password = userinfo.partition(":")
        sentinels = []
        for host in hosts.split(","):
            m = _HOST.match(host)
            if not m or not 0 < int(m["port"] or _SENTINEL_PORT) < 65536:
                raise bad(f"{host!r} is not host[:port]")
            sentinels.append((m["ipv6"] or m["name"], int(m["port"] or _SENTINEL_PORT)))
        path = [unquote(p) for p in parts.path.split("/")[1:]]
        if not path or not path[0] or len(path) > 2 or (len(path) == 2 and not path[1].isdigit()):
            raise bad("the path must be /service or /service/db")
        options: dict[str, Any] = {}
        sentinel_options: dict[str, Any] = {"socket_timeout": 1.0, "socket_connect_timeout": 1.0}
        for key, value in parse_qsl(parts.query, keep_blank_values=True, strict_parsing=bool(parts.query)):
            if key in _FLOAT_OPTIONS:
                try:
                    options[key] = float(value)
                except ValueError:
                    raise bad(f"{key} must be a number of seconds") from None
            elif key in _STR_OPTIONS:
                sentinel_options[key.removeprefix("sentinel_")] = value
            else:
                raise bad(f"unknown option {key!r} (known: {', '.join(_FLOAT_OPTIONS + _STR_OPTIONS)})")
        return cls(tuple(sentinels), path[0], int(path[1]) if len(path) == 2 else 0, unquote(user) or None,
                   unquote(password) or None, sentinel_options, options)

    def _master_options(self, options: dict[str, Any]) -> dict[str, Any]:
        return {"db": self.db, "username": self.username, "password": self.password, "socket_keepalive": True,
                "socket_connect_timeout": 5.0, **self.options, **options}

    def master(self, **options: Any) -> redis.Redis:
        """A client of the current primary (found anew by each connection it opens)."""
        sentinel = redis.sentinel.Sentinel(self.sentinels, sentinel_kwargs=self.sentinel_options)
        return sentinel.master_for(self.service, connection_pool_class=SentinelPool, **self._master_options(options))

    def master_async(self, **options: Any) -> redis.asyncio.Redis:
        """The same for redis.asyncio."""
        sentinel = redis.asyncio.sentinel.Sentinel(self.sentinels, sentinel_kwargs=self.sentinel_options)
        return sentinel.master_for(self.service, connection_pool_class=AsyncSentinelPool,
                                   **self._master_options(options))


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


def connect(url: str | None = None, **options: Any) -> redis.Redis:
    """A client with replies decoded as UTF-8 (the wire format is JSON text)."""
    url = url or default_url()
    options.setdefault("decode_responses", True)
    if url.startswith(SENTINEL_SCHEME + ":"):
        return SentinelURL.parse(url).master(**options)
    if "://" not in url:
        raise ValueError(f"bad Redis URL {redact(url)!r}: expected {FORMS}")
    if not url.startswith("unix:"):
        options.setdefault("socket_keepalive", True)
    try:
        return redis.Redis.from_url(url, **options)
    except ValueError as e:
        raise ValueError(f"bad Redis URL {redact(url)!r}: {e}; expected {FORMS}") from None


def connect_async(url: str | None = None, **options: Any) -> redis.asyncio.Redis:
    """connect() for redis.asyncio."""
    url = url or default_url()
    options.setdefault("decode_responses", True)
    if url.startswith(SENTINEL_SCHEME + ":"):
        return SentinelURL.parse(url).master_async(**options)
    try:
        return redis.asyncio.Redis.from_url(url, **options)
    except ValueError as e:
        raise ValueError(f"bad Redis URL {redact(url)!r}: {e}; expected {FORMS}") from None
