"""Tasks of tests/test_retry_policy.py, on the tests' app (workers run them with -A tests.retry_apps)."""

from __future__ import annotations

import os
import time

from taskrunner import Retry
from tests.apps import app, mark


@app.task(max_retries=2)
def asks(key: str, times: int) -> int:
    """Raises Retry on its first `times` runs (counted under `key`), then returns the run."""
    n = mark(key)
    if n <= times:
        raise Retry()
    return n


@app.task(max_retries=1, max_duration=60)
def survives(key: str) -> str:
    """Run 1 and 2 wait (to be SIGKILLed, then stopped by a worker's shutdown), run 3 asks
    to retry once, run 4 returns: lost and handed back deliveries are no Retry."""
    n = mark(key)
    if n <= 2:
        app.redis.rpush(f"{app.settings.prefix}:started", f"{key}:{os.getpid()}")
        time.sleep(60)
    if n == 3:
        raise Retry()
    return "done"


@app.task(retries=2, retry_backoff=1000, retry_backoff_max=0.05)
def capped(key: str) -> int:
    """Fails twice: a backoff of 1000 s capped at 0.05 s by the task itself."""
    n = mark(key)
    if n < 3:
        raise RuntimeError(f"try {n}")
    return n


@app.task(failed_ttl=3600, result_ttl=60)
def short_lived(fail: bool) -> str:
    if fail:
        raise ValueError("dead letter")
    return "ok"


@app.task(ignore_result=True)
def quiet() -> object:
    """Returns what JSON cannot hold: dropped, not encoded."""
    return {1, 2}
