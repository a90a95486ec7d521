"""Reading Redis URLs: the forms taskrunner accepts, the default one, and their errors.

redis-py reads redis://, rediss:// and unix:// itself (check_db() refuses the database paths
it would misread); redis+cluster:// and redis+sentinel:// name several hosts, which
parse_hosts_url() splits by hand (see _split). connection.py turns a parsed URL into a client.
"""

from __future__ import annotations

import ipaddress
import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl, unquote, urlsplit

from taskrunner.errors import BadURL

EMBEDDED_DIR = Path("var")
SENTINEL_SCHEME = "redis+sentinel"
SENTINEL_FORM = ("redis+sentinel://[[user]:password@]host[:port][,host[:port]...]/service[/db]"
                 "[?sentinel_password=...&socket_timeout=...]")
CLUSTER_SCHEME = "redis+cluster"
CLUSTER_FORM = "redis+cluster://[[user]:password@]host[:port][,host[:port]...][?socket_timeout=...]"
FORMS = (f"redis://[[user]:password@]host[:port][/db], rediss://..., unix:///path[?db=N], {CLUSTER_FORM} "
         f"or {SENTINEL_FORM}")
SENTINEL_PORT = 26379
REDIS_PORT = 6379
_HOST = re.compile(r"^(?:\[(?P<ipv6>[^\[\]]+)\]|(?P<name>[A-Za-z0-9_.-]+))(?::(?P<port>[0-9]{1,5}))?$")
_FLOAT_OPTIONS = ("socket_timeout", "socket_connect_timeout")
SENTINEL_OPTIONS = ("sentinel_username", "sentinel_password")


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


def complaint(url: str, form: str) -> Callable[[str], BadURL]:
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


def parse_hosts_url(url: str, scheme: str, default_port: int, bad: Callable[[str], ValueError],
                    str_options: tuple[str, ...] = ()
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


def check_db(url: str) -> None:
    """redis-py reads redis://host/abc as database 0, and /1/2 as 12: refuse a path that
    is not one number (a unix:// URL's path is its socket; its ?db= redis-py checks)."""
    db = "" if url.startswith("unix:") else urlsplit(url).path.strip("/")
    if db and not db.isdigit():
        raise BadURL(f"bad Redis URL {redact(url)!r}: the database {db!r} is not a number; expected {FORMS}")
