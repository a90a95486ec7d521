"""Tasks the tests run in real worker processes."""

from __future__ import annotations

import json
import logging
import os
import signal
import time
from collections.abc import Iterator

from taskrunner import Reject, Retry, SoftTimeLimit, TaskRunner, current_job

app = TaskRunner("tests")


def mark(name: str) -> int:
    """Count a run in Redis (a ledger the test reads), e.g. per job id."""
    return app.redis.incr(f"{app.settings.prefix}:ledger:{name}")


@app.task
def add(a, b):
    return a + b


@app.task
def record(key: str) -> int:
    return mark(key)


@app.task(max_duration=60)
def hold(key: str, seconds: float = 30) -> str:
    """Marks that it started, then runs until released (a Redis key) or `seconds` pass."""
    mark(key)
    app.redis.rpush(f"{app.settings.prefix}:started", f"{key}:{os.getpid()}")
    deadline = time.time() + seconds
    while time.time() < deadline:
        if app.redis.get(f"{app.settings.prefix}:release:{key}"):
            return "released"
        time.sleep(0.02)
    return "timeout"


@app.task(max_duration=60)
def hold_first(key: str) -> int:
    """Its first delivery marks that it began and runs until released (a Redis key) or 60 s
    pass; a later one marks it and ends at once. Returns its delivery's attempt: which
    delivery's result the record kept."""
    attempt = current_job().attempt
    mark(key)
    deadline = time.time() + 60
    while attempt == 1 and time.time() < deadline and not app.redis.get(f"{app.settings.prefix}:release:{key}"):
        time.sleep(0.02)
    return attempt


@app.task(max_duration=60)
def stubborn(key: str) -> None:
    """Ignores SIGTERM: only SIGKILL stops it."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    mark(key)
    time.sleep(60)


@app.task(max_duration=0.5)
def too_slow(key: str) -> None:
    mark(key)
    time.sleep(30)


@app.task
def boom(message: str) -> None:
    raise ValueError(message)


@app.task(retries=2, retry_backoff=0.1)
def flaky(key: str, succeed_on: int) -> str:
    n = mark(key)
    if n < succeed_on:
        raise RuntimeError(f"try {n}")
    return f"ok on try {n}"


@app.task(retries=3, retry_backoff=0.05, retry_on=(ConnectionError, TimeoutError), no_retry_on=ConnectionRefusedError)
def picky(key: str, error: str) -> None:
    """Raises the builtin exception named `error`, counting its tries under `key`."""
    mark(key)
    raise {"ConnectionError": ConnectionError, "ConnectionRefusedError": ConnectionRefusedError,
           "ValueError": ValueError}[error](error)


@app.task(retries=1, retry_backoff=0.05, max_duration=60)
def whoami() -> dict:
    """Its own delivery, as current_job() tells it; fails its first try to show attempt 2."""
    job = current_job()
    if job.attempt == 1:
        raise RuntimeError("first try")
    return {"id": job.id, "task": job.task, "queue": job.queue, "attempt": job.attempt, "deadline": job.deadline,
            "headers": job.headers}


@app.task(max_lost=2)
def crash(key: str) -> None:
    mark(key)
    os._exit(7)


@app.task(max_lost=3)
def crash_worker(key: str) -> None:
    """A poison pill that takes its whole worker down: the process group, the worker and its
    children (as a container's OOM kill would), once Redis knows that the jobs sent to this
    child before it have ended (their results go there within ~10 ms) and its worker holds
    one sent ahead behind it, or after 0.8 s (the worker hands such jobs back after 1 s)."""
    mark(key)
    me, pid = current_job(), os.getpid()
    running = app.keys.q(me.queue) + "running"
    deadline = time.time() + 0.8
    while time.time() < deadline:
        entries = {i: json.loads(e) for i, e in app.redis.hgetall(running).items()}
        starts = [e["started_at"] + e.get("ahead", 0) for e in entries.values() if e.get("pid") == pid]
        if min(starts) == entries[me.id]["started_at"] + entries[me.id].get("ahead", 0) < max(starts):
            break
        time.sleep(0.01)
    os.killpg(os.getpgrp(), signal.SIGKILL)


@app.task(max_lost=1)
def fragile(key: str) -> int:
    """record(), failed WorkerLost the first time a process dies while it runs."""
    return mark(key)


@app.task
def requeue_me(key: str, times: int) -> int:
    n = mark(key)
    if n <= times:
        raise Retry(delay=0.2)
    return n


@app.task(retries=5)
def reject(reason: str) -> None:
    raise Reject(reason)


@app.task
def not_json() -> object:
    return {1, 2}


@app.task(queue="high")
def high(key: str) -> int:
    return mark(key)



@app.task(queue="solo")
def exclusive_probe(i: int) -> int:
    """Counts how many of these run at once (the queue is exclusive: never more than 1)."""
    p = app.settings.prefix
    now_running = app.redis.incr(f"{p}:probe:running")
    app.redis.rpush(f"{p}:probe:order", i)
    app.redis.rpush(f"{p}:probe:max", now_running)
    time.sleep(0.05)
    app.redis.decr(f"{p}:probe:running")
    return i


@app.task
def logged(path: str, i: int, seconds: float = 0.0) -> int:
    """Appends a line `i` to the file at `path` (one write, O_APPEND: whole lines from any
    number of processes), then sleeps: runs counted outside Redis, which a failover may roll
    back."""
    with open(path, "a") as f:
        f.write(f"{i}\n")
    time.sleep(seconds)
    return i


@app.task
def nap(seconds: float) -> float:
    time.sleep(seconds)
    return seconds


@app.task(max_duration=60)
def chatty(key: str, lines: int) -> int:
    """Reports progress and log lines (through job.log and `logging`), then waits to be
    released, as `hold` does."""
    job = current_job()
    for i in range(1, lines + 1):
        job.log("line %d of %d", i, lines)
        job.progress(i / lines, f"wrote {i}")
    logging.getLogger("tests.chatty").warning("through logging: %s", key)
    deadline = time.time() + 50
    while not app.redis.get(f"{app.settings.prefix}:release:{key}") and time.time() < deadline:
        time.sleep(0.02)
    return lines


_ballast: list[bytes] = []


@app.task
def child_pid(grow_mb: int = 0) -> int:
    """The PID of the child running it; with grow_mb, leaks that many MB in it for good."""
    if grow_mb:
        _ballast.append(b"x" * (grow_mb << 20))
    return os.getpid()



@app.task(soft_limit=0.3, max_duration=30)
def soft_sleeper(key: str, handle: bool) -> str:
    """Sleeps past its soft limit; with `handle`, catches SoftTimeLimit and returns, else
    marks its clean-up and lets it out."""
    try:
        time.sleep(25)
    except SoftTimeLimit:
        mark(f"{key}:cleanup")
        if handle:
            return "cleaned up"
        raise
    return "slept"


class _SlowToFinalize:
    def __del__(self) -> None:
        time.sleep(0.05)


@app.task(max_duration=60)
def finalizing(key: str) -> None:
    """Spends its time in __del__ methods, where Python swallows exceptions: a kill most
    likely arrives there. Marks its clean-up."""
    try:
        mark(key)
        deadline = time.time() + 30
        while time.time() < deadline:
            _SlowToFinalize()
    finally:
        mark(f"{key}:cleanup")


def _finalizing_as_it_yields(key: str) -> Iterator[int]:
    try:
        while True:
            yield (_SlowToFinalize(), 0)[1]  # the object's __del__ runs in the yield's line
    finally:
        mark(f"{key}:generator")


@app.task(max_duration=60)
def finalizing_generator(key: str) -> None:
    """finalizing(), the __del__ run in a generator's yield line: a kill raised as the
    generator suspends would skip its finally block for good."""
    try:
        mark(key)
        for _ in _finalizing_as_it_yields(key):
            pass
    finally:
        mark(f"{key}:cleanup")


@app.task(soft_limit=0.3, max_duration=30)
def soft_finalizing(key: str) -> str:
    """Spends its time in __del__ methods past its soft limit (SIGALRM most likely lands in
    one, where Python swallows exceptions); catches SoftTimeLimit and returns."""
    try:
        deadline = time.time() + 20
        while time.time() < deadline:
            _SlowToFinalize()
    except SoftTimeLimit:
        mark(f"{key}:cleanup")
        return "cleaned up"
    return "ran on"


@app.task(soft_limit=0.3, max_duration=30)
def soft_spinner(key: str) -> str:
    """Runs Python code past its soft limit (a thread gets SoftTimeLimit between bytecodes)."""
    try:
        deadline = time.time() + 25
        while time.time() < deadline:
            time.sleep(0.01)
    finally:
        mark(f"{key}:cleanup")
    return "spun"


@app.task
def mul(a, b):
    return a * b


@app.task
def counted(x, key: str):
    """A chain step that counts its runs in the ledger and passes x + 1 on."""
    mark(key)
    return x + 1


@app.task(max_duration=60)
def gate(x, key: str):
    """A chain step that counts its runs, says it started, waits for its release key (a test
    kills its worker meanwhile), then passes x on."""
    mark(key)
    app.redis.rpush(f"{app.settings.prefix}:started", f"{key}:{os.getpid()}")
    deadline = time.time() + 30
    while time.time() < deadline and not app.redis.get(f"{app.settings.prefix}:release:{key}"):
        time.sleep(0.02)
    return x


@app.task
def slow_counted(x, key: str, seconds: float = 0.05):
    """counted(), taking `seconds`: a step a chaos test can kill workers in the middle of
    (8 kills, each counted against the job a child ran, not the jobs in its prefetch: the
    default max_lost, 5, holds)."""
    mark(key)
    time.sleep(seconds)
    return x + 1


@app.task
def tsum(values: list) -> int:
    """A chord's callback: the sum of its members' results (None for one that failed)."""
    return sum(v or 0 for v in values)


@app.task
def anything(*args, **kwargs) -> list:
    """Takes any arguments (the enqueue's check refuses none): gives them back."""
    return [list(args), kwargs]


@app.task(result_ttl=1)
def forgetful(value):
    """Returns its value, kept 1 s (a chord member whose own result TTL is shorter than the chord)."""
    return value


@app.task
def echo(value):
    """Returns what it is given (a callback's argument, to look at)."""
    return value


@app.task
def fails_until_fixed(x, key: str):
    """A workflow step that fails for good (no retries) until the test sets its `fixed` key
    (then an operator retries it), then passes x on; its runs are counted in the ledger."""
    mark(key)
    if not app.redis.get(f"{app.settings.prefix}:fixed:{key}"):
        raise RuntimeError(f"{key} is broken")
    return x
