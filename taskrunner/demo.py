"""The demo app of `taskrunner up --demo`: a little of everything a task runner meets."""

from __future__ import annotations

import os
import time

from taskrunner import Retry, TaskRunner

app = TaskRunner("demo")


@app.task
def add(a: float, b: float) -> float:
    return a + b


@app.task(max_duration=10)
def sleep(seconds: float) -> float:
    time.sleep(seconds)
    return seconds


@app.task(retries=2, retry_backoff=0.2)
def flaky(attempts_needed: int, counter: str) -> str:
    """Fails until it has been tried `attempts_needed` times (retried with backoff)."""
    n = app.redis.incr(f"demo:flaky:{counter}")
    app.redis.expire(f"demo:flaky:{counter}", 3600)
    if n < attempts_needed:
        raise RuntimeError(f"failure {n} of {attempts_needed - 1} (will be retried)")
    return f"succeeded on try {n}"


@app.task
def fail(message: str) -> None:
    raise ValueError(message)


@app.task(max_duration=1)
def too_slow() -> None:
    """Runs past its max duration: flagged stuck, stopped, failed with TimeLimitExceeded."""
    time.sleep(30)


@app.task(max_lost=2)
def crash() -> None:
    """Kills its own process: requeued, then failed with WorkerLost (a poison pill)."""
    os._exit(3)


@app.task
def polls(counter: str) -> str:
    """Requeues itself with a delay twice, as a task waiting for something would."""
    n = app.redis.incr(f"demo:polls:{counter}")
    app.redis.expire(f"demo:polls:{counter}", 3600)
    if n < 3:
        raise Retry(delay=0.5)
    return "ready"


@app.task(queue="slow", max_duration=600)
def report(seconds: float) -> float:
    """A long job: still running when you open the dashboard (the Running page)."""
    time.sleep(seconds)
    return seconds


@app.task(queue="slow", max_duration=5, timeout_policy="flag")
def overdue(seconds: float) -> float:
    """Runs past its max duration with timeout_policy="flag": flagged stuck (the Stuck
    page) and left running, where the default policy would stop it."""
    time.sleep(seconds)
    return seconds


@app.periodic("* * * * *")
def tick() -> float:
    return time.time()


#: The failures the demo plans, by task name: what each shows.
PLANNED = {
    "taskrunner.demo.fail": "raises ValueError: failed, no retries",
    "taskrunner.demo.too_slow": "runs past its 1 s max duration: stopped, failed with TimeLimitExceeded",
    "taskrunner.demo.crash": "kills its own process: requeued once, then failed with WorkerLost",
}


def workload() -> list:
    """What `up --demo` enqueues and waits for; returns the jobs."""
    run = str(time.time_ns())
    jobs = [add.delay(i, i) for i in range(200)]
    jobs += [sleep.delay(0.2 * i) for i in range(1, 6)]
    jobs += [flaky.delay(2, f"{run}.{i}") for i in range(3)]
    jobs += [polls.delay(f"{run}.p")]
    jobs += [fail.delay("this one fails on purpose"), too_slow.delay(), crash.delay()]
    jobs += [add.apply_async((1, 1), delay=2 + i) for i in range(3)]
    return jobs


def showcase() -> list:
    """Two long jobs of the "slow" queue, to look at in the dashboard while they last: one
    running (3 minutes), one stuck past its max duration (10 minutes)."""
    app.purge("slow")  # left by an earlier demo stopped while they ran
    return [report.delay(180), overdue.delay(600)]
