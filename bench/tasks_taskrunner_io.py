"""taskrunner's I/O-bound tasks (bench/io_bound.py), on the app of bench/tasks_taskrunner.py.
A module of their own because an app with an `async def` task gets loop children
(--async-slots): the no-op benchmark's worker (`-A bench.tasks_taskrunner`) keeps its
classic ones. Worker: `taskrunner worker -A bench.tasks_taskrunner_io`."""

from bench import record
from bench.tasks_taskrunner import app

__all__ = ["app", "io", "aio"]


@app.task(name="bench.io", max_duration=60)
def io(seconds):
    record.io(seconds)


@app.task(name="bench.aio", max_duration=60)
async def aio(seconds):
    await record.aio(seconds)
