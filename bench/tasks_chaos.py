"""The chaos harness's tasks (bench/chaos.py). Each run of a job writes to a ledger on a
separate redis-server that no fault touches (CHAOS_LEDGER_URL), so that what really ran
can be checked against what the faulted Redis says:

    HINCRBY runs <key> 1            at the start of every run
    RPUSH starts:<key> "<time> <pid>"
    HINCRBY done <key> 1            when the body's work is done
    INCR cron:runs                  each run of the cron tick
    INCR soak:done                  each run of the soak's job (bench/soak.py)

<key> is the job id, passed as the first argument (a task cannot see its own id)."""

from __future__ import annotations

import json
import os
import time

import redis

from taskrunner import TaskRunner

LEDGER_ENV = "CHAOS_LEDGER_URL"
#: Max duration of the ordinary tasks. A delivery whose finish Redis forgot (power loss
#: under everysec) looks like a running job until this passes: keep it short.
MAX_DURATION = 20

app = TaskRunner("chaos")  # REDIS_URL and TASKRUNNER_PREFIX from the environment

_client: redis.Redis | None = None
_pid = 0


class PlannedFailure(Exception):
    """Raised on purpose: the job must end failed, after its one retry."""


def ledger() -> redis.Redis:
    """One connection per process (made again after a fork)."""
    global _client, _pid
    if _client is None or _pid != os.getpid():
        url = os.environ.get(LEDGER_ENV)
        if not url:
            raise RuntimeError(f"{LEDGER_ENV} is not set: run these tasks through bench/chaos.py")
        _client = redis.Redis.from_url(url, decode_responses=True)
        _pid = os.getpid()
    return _client


def started(key: str) -> None:
    ledger().pipeline(transaction=False).hincrby("runs", key, 1).rpush(
        f"starts:{key}", f"{time.time():.6f} {os.getpid()}").execute()


def done(key: str) -> None:
    ledger().hincrby("done", key, 1)


@app.task(name="chaos.noop", max_duration=MAX_DURATION)
def noop(key: str) -> None:
    started(key)
    done(key)


@app.task(name="chaos.sleep", max_duration=MAX_DURATION)
def nap(key: str, seconds: float) -> None:
    started(key)
    time.sleep(seconds)
    done(key)


@app.task(name="chaos.fail", max_duration=MAX_DURATION, retries=1, retry_backoff=0.2)
def fail(key: str) -> None:
    started(key)
    done(key)
    raise PlannedFailure(f"{key} fails by design")


@app.task(name="chaos.overtime", max_duration=1)
def overtime(key: str) -> None:
    """Runs past its max duration: the worker stops it (TimeLimitExceeded, no retry)."""
    started(key)
    time.sleep(30)
    done(key)


@app.periodic("* * * * * */2", name="chaos.tick", queue="cron", max_duration=MAX_DURATION)
def tick() -> None:
    ledger().incr("cron:runs")


@app.task(name="chaos.soak", max_duration=MAX_DURATION)
def soak(payload: dict, seconds: float) -> int:
    """The soak's job: a little JSON in and out, a short sleep, one count."""
    time.sleep(seconds)
    ledger().incr("soak:done")
    return len(payload)


# -- workflow mode (bench/chaos.py --workflows): a chord and a chain on queue "wf" ----------------


@app.task(name="chaos.member", max_duration=MAX_DURATION, queue="wf")
def member(key: str, i: int) -> int:
    """A chord's member: its result is i*i, so the callback's argument proves the order."""
    started(key)
    time.sleep(0.15)  # 500 of them keep the 6 slots of a run busy for ~12 s: faults land among them
    done(key)
    return i * i


@app.task(name="chaos.collect", max_duration=MAX_DURATION, queue="wf")
def collect(results: list, key: str) -> int:
    """The chord's callback: every run records the results it was given."""
    started(key)
    ledger().rpush("wf:collected", json.dumps(results))
    done(key)
    return len(results)


@app.task(name="chaos.step", max_duration=MAX_DURATION, queue="wf")
def step(x: int, key: str) -> int:
    """A chain's step: x + 1, so the last step's result is the chain's length."""
    started(key)
    time.sleep(0.3)  # 50 steps one after the other: ~15 s of the fault window
    done(key)
    return x + 1
