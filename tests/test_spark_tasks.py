"""`@app.task(spark=True)`: a worker's child keeps one real SparkSession (local mode, and
on the tests' standalone cluster) for its Spark tasks, stops it when it is recycled, and a
kill, a max duration or a soft limit cancels the job's Spark job group: the child and its
session go on. A child that dies takes its JVM with it. One worker with one child per
test: one JVM (one application) at a time."""

from __future__ import annotations

import json
import os
import signal
import sys
import time
import urllib.request

import psutil
import pytest

if not os.environ.get("CI"):  # CI installs PySpark and Java: there a missing one fails
    pytest.importorskip("pyspark", reason="PySpark is not installed (pip install 'taskrunner[spark]')")

from taskrunner.errors import JobFailed  # noqa: E402
from tests import spark_apps  # noqa: E402
from tests.conftest import free_port, wait_for  # noqa: E402

WORKER = "tests.spark_apps"


def gone(pid: int) -> bool:
    """Not running (a zombie whose parent has not reaped it yet has stopped too)."""
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def crawling(marker) -> list[int]:
    """The PIDs of the Python workers of an endless() Spark job's two tasks, once both run."""
    return wait_for(lambda: marker.exists() and len(pids := marker.read_text().split()) == 2 and
                    [int(p) for p in pids], 240, "the Spark job's two tasks to run")


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


def test_a_soft_limit_during_a_spark_action_cancels_its_job_group(app, stack, tmp_path):
    """SoftTimeLimit comes while the task waits on the JVM for a Spark action: the job's
    Spark job group is canceled (its Spark tasks stop), and SoftTimeLimit is raised in the
    task as the action returns, so its except and finally blocks run; its except block's
    Spark job runs (the cancel is done first). Raised inside py4j's wait for the answer,
    it broke the call (a Py4JError, no except SoftTimeLimit) and the Spark job ran on."""
    stack.worker("-Q", "spark", app=WORKER, concurrency=1, env={"TASKRUNNER_KILL_GRACE": "60"})
    assert spark_apps.count.delay(10).wait(240)["count"] == 10  # the session started: the limit is the action's
    began = time.monotonic()
    job = spark_apps.soft_crawl.delay(str(tmp_path / "a"))  # soft_limit=20
    workers = crawling(tmp_path / "a")
    assert job.wait(80) == {"after": 7}
    assert time.monotonic() - began < 80  # the soft limit ended it, long before the max duration (120 s)
    assert app.redis.lrange(f"{app.settings.prefix}:said", 0, -1) == ["except", "finally"]
    wait_for(lambda: all(gone(p) for p in workers), 30, "the canceled Spark tasks' Python workers to stop")
    assert spark_apps.count.delay(5).wait(60)["count"] == 5


@pytest.mark.timeout(600)  # and the cluster's start, when it is the first to ask (1-3 min on 2 busy cores)
def test_spark_tasks_on_the_standalone_cluster(app, stack, tmp_path, spark_cluster):
    """TASKRUNNER_SPARK_MASTER names the tests' standalone cluster: a child's session is an
    application of that master, kept across jobs; a kill cancels the job's Spark job group
    there: the application's status API shows the job failed, its tasks killed, and the
    application running on for the next job."""
    ui = free_port()
    env = {"TASKRUNNER_SPARK_MASTER": spark_cluster.master, "PYSPARK_PYTHON": sys.executable,
           "TASKRUNNER_KILL_GRACE": "60",
           "TASKRUNNER_SPARK_CONF": f"spark.ui.enabled=true,spark.ui.port={ui},spark.executor.memory=512m"}
    w = stack.worker("-Q", "spark", app=WORKER, concurrency=1, env=env)
    first = spark_apps.count.delay(1000).wait(240)
    second = spark_apps.count.delay(50).wait(60)
    assert (first["count"], second["count"]) == (1000, 50)
    assert second["app"] == first["app"] and second["child"] == first["child"]
    running = {a["id"]: a for a in spark_cluster.status()["activeapps"]}
    assert running[first["app"]]["state"] == "RUNNING", running

    def jobs(group: str) -> list[dict]:
        url = f"http://127.0.0.1:{ui}/api/v1/applications/{first['app']}/jobs"
        with urllib.request.urlopen(url, timeout=10) as r:
            return [j for j in json.load(r) if j.get("jobGroup") == group]

    killed = spark_apps.crawl.delay(str(tmp_path / "a"))
    crawling(tmp_path / "a")
    assert [j["status"] for j in jobs(killed.id)] == ["RUNNING"]
    assert stack.cli("kill", killed.id).returncode == 0
    wait_for(lambda: killed.refresh().data["state"] == "killed", 30, "the job killed")
    # The job fails as it is canceled; its tasks are counted killed as the executor reports them.
    [job] = wait_for(lambda: [j for j in jobs(killed.id) if j["status"] != "RUNNING" and not j["numActiveTasks"]], 60,
                     "the Spark job and its tasks to end")
    assert (job["status"], job["numKilledTasks"], job["numCompletedTasks"]) == ("FAILED", 2, 0), job
    again = spark_apps.count.delay(10).wait(60)
    assert (again["app"], again["child"], again["count"]) == (first["app"], first["child"], 10)
    assert first["app"] in {a["id"] for a in spark_cluster.status()["activeapps"]}
    # The worker stops: so does its child's session, an application the master then lists as finished.
    w.send_signal(signal.SIGTERM)
    assert w.wait(60) == 0
    done = wait_for(lambda: {a["id"]: a for a in spark_cluster.status()["completedapps"]}.get(first["app"]), 30,
                    "the application finished")
    assert done["state"] == "FINISHED", done
