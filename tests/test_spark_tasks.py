"""`@app.task(spark=True)`: a worker's child keeps one real SparkSession (local mode) for
its Spark tasks, stops it when it is recycled, and a kill or a max duration cancels the
job's Spark job group: the child and its session go on. A child that dies takes its JVM
with it. One worker with one child per test: one JVM at a time."""

from __future__ import annotations

import os
import signal

import psutil
import pytest

if not os.environ.get("CI"):  # CI installs PySpark and Java: there a missing one fails
    pytest.importorskip("pyspark", reason="PySpark is not installed (pip install 'taskrunner[spark]')")

from taskrunner.errors import JobFailed  # noqa: E402
from tests import spark_apps  # noqa: E402
from tests.conftest import wait_for  # noqa: E402

WORKER = "tests.spark_apps"


def gone(pid: int) -> bool:
    """Not running (a zombie whose parent has not reaped it yet has stopped too)."""
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_a_child_keeps_one_session_until_it_is_recycled(app, stack):
    stack.worker("-Q", "spark", "--max-jobs-per-child", "2", app=WORKER, concurrency=1)
    first = spark_apps.count.delay(1000).wait(240)
    second = spark_apps.count.delay(50).wait(60)
    assert (first["count"], second["count"]) == (1000, 50)
    assert second["app"] == first["app"] and second["child"] == first["child"] and second["jvm"] == first["jvm"]
    # Its second job recycles the child: it exits, its session and JVM stopped (and reaped) first.
    wait_for(lambda: gone(first["child"]), 60, "the recycled child to exit")
    assert not psutil.pid_exists(first["jvm"])
    # A task that is not spark=True gets no session (its child must not start a JVM).
    job = spark_apps.not_spark.delay()
    with pytest.raises(JobFailed):
        job.wait(30)
    data = job.refresh().data
    assert data["error_type"] == "taskrunner.errors.TaskRunnerError", data
    assert "current_job().spark is for tasks declared with @app.task(spark=True)" in data["error"]


def test_kill_and_max_duration_cancel_the_spark_job_and_the_session_goes_on(app, stack, tmp_path):
    # A kill_grace far longer than the test waits: the jobs end by cancellation, not SIGKILL.
    w = stack.worker("-Q", "spark", app=WORKER, concurrency=1, env={"TASKRUNNER_KILL_GRACE": "60"})
    jvms = f"{app.settings.prefix}:jvm"

    def crawling(marker) -> list[int]:
        """The PIDs of the Python workers of the job's two Spark tasks, once both run."""
        return wait_for(lambda: marker.exists() and len(pids := marker.read_text().split()) == 2 and
                        [int(p) for p in pids], 240, "the Spark job's two tasks to run")

    killed = spark_apps.crawl.delay(str(tmp_path / "a"))
    workers = crawling(tmp_path / "a")
    r = stack.cli("kill", killed.id)
    assert r.returncode == 0, r.stderr
    wait_for(lambda: killed.refresh().data["state"] == "killed", 30, "the job killed")
    assert killed.data["error"] == "killed on request", killed.data
    wait_for(lambda: all(gone(p) for p in workers), 30, "the canceled Spark tasks' Python workers to stop")

    timed = spark_apps.crawl.apply_async([str(tmp_path / "b")], max_duration=15)
    crawling(tmp_path / "b")
    wait_for(lambda: timed.refresh().data["state"] == "failed", 40, "the job past its max duration")
    assert timed.data["error_type"] == "TimeLimitExceeded", timed.data
    assert "its Spark job group was canceled" in timed.data["error"], timed.data

    # The same child and the same session ran both, and run the next job.
    [(child, jvm)] = {tuple(map(int, x.split())) for x in app.redis.lrange(jvms, 0, -1)}
    again = spark_apps.count.delay(10).wait(60)
    assert (again["child"], again["jvm"], again["count"]) == (child, jvm, 10)
    assert stack.children_of(w) == [child]

    # A child that dies (SIGKILL) takes its JVM with it.
    lost = spark_apps.crawl.delay(str(tmp_path / "c"))  # max_lost=1: it fails, it does not run again
    crawling(tmp_path / "c")
    os.kill(child, signal.SIGKILL)
    wait_for(lambda: gone(jvm), 60, "the dead child's JVM to stop")
    wait_for(lambda: lost.refresh().data["state"] == "failed", 30, "the lost job failed")
    assert lost.data["error_type"] == "WorkerLost", lost.data
