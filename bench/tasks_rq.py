"""The benchmark's tasks for RQ (run with the peers' venv: rq worker --url unix://...)."""

from redis import Redis
from rq import Queue

from bench import record


def connection() -> Redis:
    return Redis(unix_socket_path=record.socket_path())


def queue() -> Queue:
    return Queue("default", connection=connection())


def noop():
    record.done()


def latency(enqueued_at):
    record.latency(enqueued_at)


def sleep(seconds):
    record.sleep(seconds)


def io(seconds):
    record.io(seconds)
