"""Tasks of the flow-control tests (rate limits, concurrency keys), on the tests' app:
workers run them with `-A tests.flow_apps`."""

from __future__ import annotations

import time

from tests.apps import app


def _now() -> float:
    """Redis's clock: the same for every process, as the claim's started_at."""
    s, us = app.redis.time()
    return s + us / 1e6


@app.task(rate_limit="20/s")
def limited(i: int) -> int:
    return i


@app.task(max_concurrency=2)
def capped(key: str, seconds: float) -> None:
    """Records its run as "<key> <start> <end>" (Redis time) in the test's spans list."""
    start = _now()
    time.sleep(seconds)
    app.redis.rpush(f"{app.settings.prefix}:spans", f"{key} {start} {_now()}")


@app.task(max_concurrency=1, max_duration=60)
def capped_hold(key: str) -> str:
    """Says it started, then runs until released (a Redis key)."""
    app.redis.rpush(f"{app.settings.prefix}:started", key)
    deadline = time.time() + 30
    while time.time() < deadline:
        if app.redis.get(f"{app.settings.prefix}:release:{key}"):
            return "released"
        time.sleep(0.02)
    return "timeout"


@app.task(rate_limit="1/h", queue="trickle")
def trickle(i: int) -> int:
    return i
