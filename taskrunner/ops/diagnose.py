"""Why Redis cannot be used as its URL says, in one line, for the CLI's errors and the
check at the start of a worker, dispatcher or dashboard.

A configuration mistake (a database the server lacks, TLS against a plain server, a
Sentinel URL naming a plain server, a refused password) is told apart from a Redis that
is down for now: the first will not mend itself, so commands exit 2 on it and long-running
processes do not start; the second is waited for. redis-py's own errors say neither (a
TLS handshake with a plain server just times out, an unreachable sentinel comes back as
a thousand characters of repr), so where it matters we ask the server ourselves."""

from __future__ import annotations

import socket
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import redis
import redis.cluster
import redis.sentinel

from taskrunner.protocol.connection import SentinelURL
from taskrunner.protocol.outages import transient
from taskrunner.protocol.urls import SENTINEL_SCHEME, default_url, redact

_PROBE_TIMEOUT = 2.0  # seconds for each look at a server while explaining an error


@dataclass(frozen=True)
class Problem:
    """What is wrong, in one line, and whether it is a mistake in the configuration
    (`lasting`) rather than an outage that may end."""

    message: str
    lasting: bool


def explain(error: BaseException, url: str | None) -> Problem | None:
    """The Problem behind an error from Redis when reached through `url` (None: the
    default URL); None for an error that is not about reaching Redis."""
    url = url or default_url()
    text = str(error)
    if isinstance(error, redis.AuthenticationError) or text.startswith(("WRONGPASS", "NOAUTH", "invalid password")):
        return Problem(f"Redis refused the credentials of {redact(url)}: {text}", True)
    if "DB index is out of range" in text:
        return Problem(f"Redis at {redact(url)} has no such database (DB index is out of range: a server has "
                       "databases 0 to 15 unless its `databases` setting says more)", True)
    if url.startswith(SENTINEL_SCHEME + ":") and isinstance(error, (redis.sentinel.MasterNotFoundError,
                                                                     redis.ResponseError)):
        return _sentinels(SentinelURL.parse(url), url)
    if not isinstance(error, (redis.ConnectionError, redis.TimeoutError, redis.cluster.RedisClusterException)):
        if transient(error):  # an answer a failover, a load or a busy script gives: it passes
            return Problem(f"Redis at {redact(url)} cannot serve this for now ({text}): failing over, loading or "
                           "busy; try again (a READONLY that lasts: the URL names a replica, not the primary)", False)
        return None
    if "CERTIFICATE_VERIFY_FAILED" in text:
        return Problem(f"the TLS certificate of {redact(url)} is not trusted: {text} (a self-signed one, as Heroku "
                       "Redis has: set TASKRUNNER_REDIS_SSL_CERT_REQS=none, or add ?ssl_cert_reqs=none to the URL)",
                       True)
    parts = urlsplit(url)
    if parts.scheme == "rediss" and _plain_server(parts.hostname or "localhost", parts.port or 6379):
        return Problem(f"{parts.hostname}:{parts.port or 6379} is a plain Redis, not TLS: use redis:// for it "
                       f"(rediss:// is for a TLS port); {redact(url)} failed with: {text}", True)
    return Problem(f"cannot reach Redis at {redact(url)}: {text} (set REDIS_URL or --redis-url)", False)


def _plain_server(host: str, port: int) -> bool:
    """Does a plain (non-TLS) Redis answer at host:port?"""
    try:
        with socket.create_connection((host, port), timeout=_PROBE_TIMEOUT) as s:
            s.sendall(b"PING\r\n")
            answer = s.recv(64)
    except OSError:
        return False
    return answer.startswith((b"+PONG", b"-NOAUTH", b"-ERR", b"-DENIED", b"-LOADING"))


def _sentinels(s: SentinelURL, url: str) -> Problem:
    """Ask each sentinel of the URL what it knows of the service."""
    found, lasting = [], True
    for host, port in s.sentinels:
        client = redis.Redis(host, port, decode_responses=True,
                             **{**s.sentinel_options, "socket_timeout": _PROBE_TIMEOUT,
                                "socket_connect_timeout": _PROBE_TIMEOUT})
        try:
            masters: Any = client.sentinel_masters()  # redis-py: a dict of service -> its state
        except redis.ResponseError as e:
            found.append(f"{host}:{port} is not a sentinel (a Redis server: use redis://{host}:{port}/ for it)"
                         if "unknown command" in str(e) else f"{host}:{port} answered: {e}")
            continue
        except redis.RedisError as e:
            found.append(f"{host}:{port} is unreachable ({e})")
            lasting = False
            continue
        finally:
            client.close()
        if s.service in masters:
            found.append(f"{host}:{port} knows no healthy primary of it")
            lasting = False
        else:
            found.append(f"{host}:{port} does not monitor it (it monitors {', '.join(sorted(masters)) or 'nothing'})")
    return Problem(f"no sentinel of {redact(url)} names a primary for service {s.service!r}: {'; '.join(found)}",
                   lasting)
