"""What every benchmark task does, whatever the system running it: the same few Redis
commands on the same server, in db 1 (BENCH_DB), so that the systems' own keys in db 0
are untouched. Imported by the task modules of taskrunner and of the peers, so it
needs nothing but redis-py (present in both environments)."""

from __future__ import annotations

import os
import time

import redis

SOCKET_ENV = "BENCH_REDIS_SOCKET"
BENCH_DB = 1
DONE = "bench:done"        # INCR by each no-op job
LATENCY = "bench:latency"  # RPUSH of (start - enqueued_at) seconds, by each latency job
STARTS = "bench:starts"    # RPUSH of time.time() at each start of the sleep job

_client: redis.Redis | None = None
_pid = 0


def socket_path() -> str:
    path = os.environ.get(SOCKET_ENV)
    if not path:
        raise RuntimeError(f"{SOCKET_ENV} is not set: run these tasks through bench/bench.py")
    return path


def client() -> redis.Redis:
    """One connection per process (made again after a fork)."""
    global _client, _pid
    if _client is None or _pid != os.getpid():
        _client = redis.Redis(unix_socket_path=socket_path(), db=BENCH_DB)
        _pid = os.getpid()
    return _client


def done() -> None:
    client().incr(DONE)


def latency(enqueued_at: float) -> None:
    started = time.time()
    client().rpush(LATENCY, started - float(enqueued_at))


def sleep(seconds: float) -> None:
    client().rpush(STARTS, time.time())
    time.sleep(float(seconds))
