"""The benchmark's tasks for Dramatiq (run with the peers' venv: dramatiq bench.tasks_dramatiq)."""

import dramatiq
from dramatiq.brokers.redis import RedisBroker

from bench import record

broker = RedisBroker(unix_socket_path=record.socket_path())
dramatiq.set_broker(broker)


@dramatiq.actor(actor_name="bench_noop", max_retries=0)
def noop():
    record.done()


@dramatiq.actor(actor_name="bench_latency", max_retries=0)
def latency(enqueued_at):
    record.latency(enqueued_at)


@dramatiq.actor(actor_name="bench_sleep", max_retries=0, time_limit=120_000)
def sleep(seconds):
    record.sleep(seconds)


@dramatiq.actor(actor_name="bench_io", max_retries=0)
def io(seconds):
    record.io(seconds)
