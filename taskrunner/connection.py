"""Connecting to Redis from a URL; the default is the embedded server of `taskrunner up`."""

from __future__ import annotations

import os
from pathlib import Path

import redis

EMBEDDED_DIR = Path("var")


def default_url() -> str:
    """REDIS_URL if set; else the socket of a `taskrunner up` running here; else localhost."""
    url = os.environ.get("REDIS_URL")
    if url:
        return url
    sock = EMBEDDED_DIR / "redis.sock"
    if sock.exists():
        return f"unix://{sock.resolve()}"
    return "redis://127.0.0.1:6379/0"


def connect(url: str | None = None, **options) -> redis.Redis:
    """A client with replies decoded as UTF-8 (the wire format is JSON text)."""
    url = url or default_url()
    if "://" not in url:
        raise ValueError(f"bad Redis URL {url!r}: expected redis://host:port/db, rediss://... or unix:///path")
    options.setdefault("decode_responses", True)
    if not url.startswith("unix:"):
        options.setdefault("socket_keepalive", True)
    try:
        return redis.Redis.from_url(url, **options)
    except ValueError as e:
        raise ValueError(f"bad Redis URL {url!r}: {e}") from None
