"""What every benchmark task does, whatever the system running it. Imported by the task
modules of taskrunner and of the peers, so it needs nothing but redis-py (present in both
environments).

A no-op job records its completion by appending one byte to a file beside the socket
(O_APPEND: atomic across processes and threads; about 3 us), so that the drain measures
the systems and not the recorder. With BENCH_RECORDER=redis it INCRs a counter instead,
as the benchmark did before 2026-11-21: that costs each job a round trip and ~50 us of
redis-py CPU, which then dominates the drain (see docs/PERFORMANCE.md). The latency and
recovery jobs push their timestamps to Redis (after taking them), in db 1 (BENCH_DB), so
that the systems' own keys in db 0 are untouched. The I/O-bound jobs (bench/io_bound.py)
wait, with time.sleep or asyncio.sleep, then record their completion as a no-op does."""

from __future__ import annotations

import asyncio
import os
import time

import redis

SOCKET_ENV = "BENCH_REDIS_SOCKET"
RECORDER_ENV = "BENCH_RECORDER"
RECORDERS = ("file", "redis")
BENCH_DB = 1
DONE = "bench:done"        # INCR by each no-op job (BENCH_RECORDER=redis)
LATENCY = "bench:latency"  # RPUSH of (start - enqueued_at) seconds, by each latency job
STARTS = "bench:starts"    # RPUSH of time.time() at each start of the sleep job

_client: redis.Redis | None = None
_pid = 0
_fd = -1
_fd_pid = 0


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


def recorder() -> str:
    name = os.environ.get(RECORDER_ENV) or "file"
    if name not in RECORDERS:
        raise RuntimeError(f"{RECORDER_ENV}={name!r}: choose among {', '.join(RECORDERS)}")
    return name


def done_file() -> str:
    return socket_path() + ".done"


def done() -> None:
    global _fd, _fd_pid
    if recorder() == "redis":
        client().incr(DONE)
        return
    if _fd < 0 or _fd_pid != os.getpid():
        _fd = os.open(done_file(), os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        _fd_pid = os.getpid()
    os.write(_fd, b".")


def reset() -> None:
    """Zero the count of done() calls (the Redis counter goes with a FLUSHALL)."""
    with open(done_file(), "wb"):
        pass


def count(db: redis.Redis) -> int:
    """How many done() calls so far; db: a client of BENCH_DB."""
    if recorder() == "redis":
        return int(db.get(DONE) or 0)
    try:
        return os.path.getsize(done_file())
    except FileNotFoundError:
        return 0


def latency(enqueued_at: float) -> None:
    started = time.time()
    client().rpush(LATENCY, started - float(enqueued_at))


def sleep(seconds: float) -> None:
    client().rpush(STARTS, time.time())
    time.sleep(float(seconds))


def io(seconds: float) -> None:
    """An I/O-bound job run in a thread: it waits, then counts as done."""
    time.sleep(float(seconds))
    done()


async def aio(seconds: float) -> None:
    """The same as a coroutine: the write of one byte does not block for long enough to
    matter (~3 us)."""
    await asyncio.sleep(float(seconds))
    done()
