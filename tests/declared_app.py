"""An app whose tasks declare settings that differ from every default, run by a worker
that a producer without this module (the CLI without -A, a foreign client) relies on."""

from __future__ import annotations

from taskrunner import TaskRunner

app = TaskRunner("declared")


@app.task(queue="lane", max_duration=10, retries=3, retry_backoff=0.05, timeout_policy="flag", max_lost=2)
def flaky(key: str, succeed_on: int) -> str:
    """Fails until its `succeed_on`th run (counted in Redis): completes only if retried."""
    n = app.redis.incr(f"{app.settings.prefix}:ledger:{key}")
    if n < succeed_on:
        raise RuntimeError(f"try {n}")
    return f"ok on try {n}"


@app.task(max_duration=0.25)
def quick(x: float) -> float:
    return x
