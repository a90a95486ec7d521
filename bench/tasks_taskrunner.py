"""The benchmark's tasks for taskrunner (worker: `taskrunner worker -A bench.tasks_taskrunner`)."""

import os

from bench import record
from taskrunner import TaskRunner

app = TaskRunner("bench", redis_url=os.environ.get("REDIS_URL") or f"unix://{record.socket_path()}",
                 prefix=os.environ.get("TASKRUNNER_PREFIX", "trbench"))


@app.task(name="bench.noop", max_duration=60)
def noop():
    record.done()


@app.task(name="bench.latency", max_duration=60)
def latency(enqueued_at):
    record.latency(enqueued_at)


@app.task(name="bench.sleep", max_duration=120)
def sleep(seconds):
    record.sleep(seconds)


@app.task(name="bench.step", max_duration=60)
def step(*_: object) -> int:
    """A workflow step that does nothing (bench/workflow_cost.py): takes its parent's result."""
    return 1
