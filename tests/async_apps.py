"""Tasks for the tests of children that run several jobs at once (tests/test_concurrency.py):
an app of their own, as one async def task makes a worker's children loop children."""

from __future__ import annotations

import asyncio
import time

from taskrunner import TaskRunner
from tests import apps as base
from tests.apps import mark

app = TaskRunner("tests-async")


def released(key: str) -> bool:
    return bool(base.app.redis.get(f"{base.app.settings.prefix}:release:{key}"))


@app.task(max_duration=60)
async def async_nap(key: str, seconds: float) -> str:
    """An async job: marks that it began, then sleeps `seconds` (or until released)."""
    mark(key)
    deadline = time.time() + seconds
    while time.time() < deadline:
        if released(key):
            return "released"
        await asyncio.sleep(0.01)
    return key


@app.task(max_duration=0.5)
async def async_too_slow(key: str) -> None:
    mark(key)
    await asyncio.sleep(30)


@app.task(max_duration=60)
async def async_deaf(key: str) -> None:
    """Ignores cancellation: only stopping its child ends it."""
    mark(key)
    while True:
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            mark(key + ":cancelled")


@app.task(max_duration=60)
async def async_span(seconds: float) -> list[float]:
    """Sleeps without touching Redis; says when it ran (epoch seconds), to count overlaps."""
    t0 = time.time()
    await asyncio.sleep(seconds)
    return [t0, time.time()]


@app.task(max_duration=60)
def thread_nap(key: str, seconds: float) -> str:
    """A job for a thread: marks that it began, then sleeps `seconds`."""
    mark(key)
    time.sleep(seconds)
    return key


@app.task(max_duration=60)
def thread_span(seconds: float) -> list[float]:
    t0 = time.time()
    time.sleep(seconds)
    return [t0, time.time()]


@app.task(soft_limit=0.3, max_duration=30)
async def async_soft(key: str) -> str:
    """Awaits past its soft limit: cancelled there, it cleans up in its finally block."""
    try:
        await asyncio.sleep(25)
    finally:
        mark(f"{key}:cleanup")
    return "slept"
