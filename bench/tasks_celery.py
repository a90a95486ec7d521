"""The benchmark's tasks for Celery (run with the peers' venv: celery -A bench.tasks_celery worker)."""

from celery import Celery

from bench import record

app = Celery("bench", broker=f"redis+socket://{record.socket_path()}")
app.conf.update(
    task_ignore_result=True,  # no result backend: like the other systems, the task records its own completion
    broker_connection_retry_on_startup=True,
    worker_hijack_root_logger=False,
)


@app.task(name="bench.noop")
def noop():
    record.done()


@app.task(name="bench.latency")
def latency(enqueued_at):
    record.latency(enqueued_at)


@app.task(name="bench.sleep")
def sleep(seconds):
    record.sleep(seconds)


@app.task(name="bench.io")
def io(seconds):
    record.io(seconds)
