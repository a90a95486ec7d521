"""The benchmark's tasks for arq, and its worker (run with the peers' venv):

    python -m bench.tasks_arq MAX_JOBS

arq runs coroutines only. Its worker is started here rather than by its CLI, which logs
every job's start and end at INFO (the other systems' workers run at WARNING)."""

import sys

from arq.connections import RedisSettings
from arq.worker import run_worker

from bench import record

#: Seconds between two reads of the queue. arq's default, 0.5 s, leaves a worker idle once it
#: has started what one read gave it (at most max(5 * max_jobs, 100) jobs) until the next
#: read: 20 ms jobs at 64-way ran at 20% of the ideal, against 44% with 0.01 s (2026-11-25).
#: A user with a steady stream of short jobs would lower it.
POLL_DELAY = 0.01


def redis_settings() -> RedisSettings:
    return RedisSettings(unix_socket_path=record.socket_path())


async def aio(ctx, seconds):
    await record.aio(seconds)


class WorkerSettings:
    functions = [aio]
    redis_settings = redis_settings()
    poll_delay = POLL_DELAY


if __name__ == "__main__":
    run_worker(WorkerSettings, max_jobs=int(sys.argv[1]))
