"""The producer side of the benchmark, run as a subprocess by bench/bench.py with the
interpreter of the system under test (taskrunner: the project's; peers: bench/.venv-peers):

    python -m bench.driver SYSTEM ACTION [ARG...]

SYSTEM: taskrunner, celery, rq, dramatiq, arq (io and aio jobs only), or evalsha (the raw
redis-py reference).
ACTION:
    enqueue N            enqueue N no-op jobs one at a time, timed (after a short warm-up)
    batch N              enqueue N no-op jobs with the system's batch call, timed (taskrunner, rq)
    fill N [KIND ARG...] enqueue N jobs, untimed (for the drain): no-op ones, or of KIND with
                         ARGs, e.g. `fill 2000 io 0.02` (KIND io: a sync task that sleeps;
                         aio: an async one; bench/io_bound.py)
    latency N INTERVAL   enqueue N latency jobs INTERVAL seconds apart, each with time.time()
    sleep SECONDS        enqueue one job that records its start and sleeps SECONDS
Prints one JSON object on stdout. Needs BENCH_REDIS_SOCKET (and PYTHONPATH with the repo)."""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from typing import Any

WARMUP = 50


def producers(system: str) -> dict[str, Callable[..., Any]]:
    """For each kind of job, a function that enqueues one, called with its arguments."""
    if system == "taskrunner":
        from bench import tasks_taskrunner as t
        from bench import tasks_taskrunner_io as tio

        return {"noop": lambda: t.noop.delay(), "latency": lambda ts: t.latency.delay(ts),
                "sleep": lambda s: t.sleep.delay(s),
                "batch": lambda n: t.app.enqueue_many({"task": "bench.noop"} for _ in range(n)),
                "io": lambda s: tio.io.delay(s), "aio": lambda s: tio.aio.delay(s)}
    if system == "celery":
        from bench import tasks_celery as t

        return {"noop": lambda: t.noop.delay(), "latency": lambda ts: t.latency.delay(ts),
                "sleep": lambda s: t.sleep.delay(s), "io": lambda s: t.io.delay(s)}
    if system == "rq":
        from bench import tasks_rq as t

        q = t.queue()
        def batch(n: int) -> None:
            from rq import Queue

            for i in range(0, n, 1000):  # as taskrunner's enqueue_many: 1000 jobs per round trip
                q.enqueue_many([Queue.prepare_data(t.noop) for _ in range(min(1000, n - i))])

        return {"noop": lambda: q.enqueue(t.noop), "latency": lambda ts: q.enqueue(t.latency, ts),
                "sleep": lambda s: q.enqueue(t.sleep, s, job_timeout=120), "batch": batch,
                "io": lambda s: q.enqueue(t.io, s)}
    if system == "dramatiq":
        from bench import tasks_dramatiq as t

        return {"noop": lambda: t.noop.send(), "latency": lambda ts: t.latency.send(ts),
                "sleep": lambda s: t.sleep.send(s), "io": lambda s: t.io.send(s)}
    if system == "arq":
        import asyncio

        from arq import create_pool

        from bench import tasks_arq as t

        loop = asyncio.new_event_loop()
        pool = loop.run_until_complete(create_pool(t.redis_settings()))
        return {"aio": lambda s: loop.run_until_complete(pool.enqueue_job("aio", s))}
    if system == "evalsha":
        import redis

        from bench import record

        r = redis.Redis(unix_socket_path=record.socket_path())
        sha = r.script_load("return 1")
        return {"noop": lambda: r.evalsha(sha, 0)}
    raise SystemExit(f"unknown system {system!r}")


def main(argv: list[str]) -> dict[str, Any]:
    system, action, *args = argv
    p = producers(system)
    if action == "enqueue":
        n = int(args[0])
        noop = p["noop"]
        for _ in range(WARMUP):  # connections, script loading, imports done lazily
            noop()
        t0 = time.perf_counter()
        for _ in range(n):
            noop()
        elapsed = time.perf_counter() - t0
        return {"n": n, "seconds": elapsed, "rate": n / elapsed, "warmup": WARMUP}
    if action == "batch":
        n = int(args[0])
        p["batch"](WARMUP)
        t0 = time.perf_counter()
        p["batch"](n)
        elapsed = time.perf_counter() - t0
        return {"n": n, "seconds": elapsed, "rate": n / elapsed, "warmup": WARMUP}
    if action == "fill":
        n, kind, job_args = int(args[0]), (args[1:2] or ["noop"])[0], [float(a) for a in args[2:]]
        send = p[kind]
        t0 = time.perf_counter()
        for _ in range(n):
            send(*job_args)
        return {"n": n, "seconds": time.perf_counter() - t0}
    if action == "latency":
        n, interval = int(args[0]), float(args[1])
        send = p["latency"]
        start = time.monotonic()
        for i in range(n):
            pause = start + i * interval - time.monotonic()
            if pause > 0:
                time.sleep(pause)
            send(time.time())
        return {"n": n, "seconds": time.monotonic() - start}
    if action == "sleep":
        p["sleep"](float(args[0]))
        return {"n": 1}
    raise SystemExit(f"unknown action {action!r}")


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1:])), flush=True)
