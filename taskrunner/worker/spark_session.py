"""Spark in taskrunner's processes: the settings every session starts with (shared with
`taskrunner analyze`), and the one SparkSession a worker's child keeps for its
`@app.task(spark=True)` tasks (`current_job().spark`).

A child makes its session on first use (a session takes 5-9 s to start; its JVM is the
child's subprocess) and keeps it for its next jobs. Each job's Spark jobs run in a job
group named by the job's id (interruptOnCancel: running Spark tasks are interrupted, their
Python workers killed). When the worker stops such a job (a kill, its max duration, the
shutdown grace), its SIGTERM does not interrupt the task: it asks a thread of ours to
cancel the job group (a call made on our own py4j connection: the main thread's is busy
waiting for the Spark job), the Spark action then fails in the task, and the child answers
the job as stopped (Outcome "killed"; the worker makes it what it stopped it for) and goes
on with its session. A task that goes on without Spark is stopped with its child after
kill_grace, as any.

The session stops when the child exits (recycled, the worker stopping): the context, then
the JVM, waited for. A child that dies (SIGKILL, a crash) cannot stop it: the JVM exits
on its own when its stdin, a pipe from the child, closes (PySpark's gateway does so), and
one killed on purpose (`_Killed`) kills and reaps its JVM first.

pyspark is imported only when a session is made: the core install has none."""

from __future__ import annotations

import logging
import os
import queue
import sys
import tempfile
import threading
from typing import Any

from taskrunner.errors import TaskRunnerError, require_extra

log = logging.getLogger("taskrunner.worker")

_LOG4J = """rootLogger.level = warn
rootLogger.appenderRef.stderr.ref = console
appender.console.type = Console
appender.console.name = console
appender.console.target = SYSTEM_ERR
appender.console.layout.type = PatternLayout
appender.console.layout.pattern = %d{HH:mm:ss} %p %c{1}: %m%n
logger.native.name = org.apache.hadoop.util.NativeCodeLoader
logger.native.level = error
logger.sink3.name = org.apache.spark.sql.execution.streaming.FileStreamSink
logger.sink3.level = error
logger.sink4.name = org.apache.spark.sql.execution.streaming.sinks.FileStreamSink
logger.sink4.level = error
"""

#: The settings a session gets unless TASKRUNNER_SPARK_CONF or --conf say otherwise (small on
#: purpose: local mode on 2 shared cores; raise them for a cluster or a bigger archive). The
#: last measured with `taskrunner analyze` at 10M records (docs/PERFORMANCE.md): Spark lists
#: the files it is given in a job of one task per file past 32 files (1,400 tasks: 29 s),
#: here of 4 tasks (6 s).
DEFAULT_CONF = {"spark.sql.shuffle.partitions": "4", "spark.driver.memory": "1g", "spark.ui.enabled": "false",
                "spark.ui.showConsoleProgress": "false", "spark.sql.session.timeZone": "UTC",
                "spark.sql.sources.parallelPartitionDiscovery.parallelism": "4"}


def parse_conf(entries: list[str], where: str = "--conf") -> dict[str, str]:
    """`k=v` entries as a dict; ValueError (one line) for one without a key or `=`."""
    conf = {}
    for entry in entries:
        key, eq, value = entry.partition("=")
        if not eq or not key.strip():
            raise ValueError(f"bad {where} entry {entry!r}: use key=value, e.g. spark.driver.memory=2g")
        conf[key.strip()] = value.strip()
    return conf


def spark_conf(overrides: list[str] | None = None) -> dict[str, str]:
    """DEFAULT_CONF, then TASKRUNNER_SPARK_CONF ("k=v,k=v"), then `overrides` (--conf k=v),
    each over the one before."""
    env = os.environ.get("TASKRUNNER_SPARK_CONF", "")
    return {**DEFAULT_CONF, **parse_conf([e for e in env.split(",") if e.strip()], "TASKRUNNER_SPARK_CONF"),
            **parse_conf(overrides or [])}


def spark_session(master: str | None = None, conf: dict[str, str] | None = None, default_master: str = "local[2]",
                  app_name: str = "taskrunner-analyze") -> Any:
    """A SparkSession on `master` (default TASKRUNNER_SPARK_MASTER, else `default_master`)
    with `conf` (default spark_conf()). In local mode its Python workers run our interpreter
    (PYSPARK_PYTHON, unless set): Spark's default is the first python3 on PATH, another
    Python than a virtualenv's, without its packages. On a cluster the executors' Python is
    theirs: set PYSPARK_PYTHON if python3 is not it."""
    from pyspark.sql import SparkSession

    master = master or os.environ.get("TASKRUNNER_SPARK_MASTER") or default_master
    if master.startswith("local"):
        os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    log4j = os.path.join(tempfile.gettempdir(), "taskrunner-log4j2.properties")
    with open(log4j, "w") as f:
        f.write(_LOG4J)
    java_opts = f"-Dlog4j2.configurationFile=file:{log4j}"
    builder = SparkSession.builder.appName(app_name).master(master)
    settings = {"spark.driver.extraJavaOptions": java_opts, "spark.executor.extraJavaOptions": java_opts,
                **(conf if conf is not None else spark_conf())}
    for key, value in settings.items():
        builder = builder.config(key, value)
    return builder.getOrCreate()


class ChildSpark:
    """The session of this process (a worker's child, or a process in eager mode) for its
    spark=True tasks, and the job group of the job that runs now."""

    def __init__(self) -> None:
        self.session: Any = None
        self.group: str | None = None  # the running job whose Spark jobs are in its group (it used the session)
        self.canceled = False  # the worker stopped that job: its group was canceled
        self._cancels: queue.SimpleQueue[tuple[str, threading.Event | None] | None] = queue.SimpleQueue()
        self._pid = 0
        #: A soft limit that came while the main thread (a classic child's task) waited on the
        #: JVM (`_waiting` calls under way): raised there as the call returns, once
        #: `_canceled` says the group's cancel is done (defer()).
        self._due: BaseException | None = None
        self._waiting = 0
        self._canceled = threading.Event()

    def get(self, job_id: str) -> Any:
        """The session, made on first use, with this thread's Spark jobs in `job_id`'s group."""
        if self.session is None or self._pid != os.getpid():
            require_extra("spark", "a spark=True task", "pyspark")
            self.session = spark_session(default_master="local[*]", app_name=f"taskrunner-{os.getpid()}")
            self._pid = os.getpid()
            client = self.session.sparkContext._gateway._gateway_client
            client.send_command = self._raising_when_due(client.send_command)  # this gateway's only
            threading.Thread(target=self._cancel_loop, name="taskrunner-spark-cancel", daemon=True).start()
            log.info("started a Spark session (%s, application %s) for spark=True tasks",
                     self.session.sparkContext.master, self.session.sparkContext.applicationId)
        if self.canceled:
            raise TaskRunnerError(f"job {job_id} was stopped: its Spark job group was canceled")
        if self.group != job_id:
            self.session.sparkContext.setJobGroup(job_id, f"taskrunner job {job_id}", interruptOnCancel=True)
            self.group = job_id
        return self.session

    def cancel(self) -> bool:
        """Called by the SIGTERM handler of a child whose worker stops the running job: if
        that job runs Spark jobs, have them canceled (by our thread; we may not call the JVM
        from a handler that interrupted a call to it) and say True: the task is not
        interrupted, its Spark action fails. False: nothing of Spark to cancel."""
        if self.group is None or self._pid != os.getpid():
            return False
        if not self.canceled:
            self.canceled = True
            self._cancels.put((self.group, None))
        return True

    def end(self) -> bool:
        """The job ended: was its Spark job group canceled (the worker stopped it)?"""
        canceled, self.group, self.canceled = self.canceled, None, False
        return canceled

    def defer(self, exc: BaseException) -> bool:
        """Called by the SIGALRM handler of a job's soft limit (soft_limit.py, the main
        thread) with the exception it would raise: True when the task is waiting on the
        JVM (py4j waits for the answer to a call, usually a Spark action's). Raised there,
        SoftTimeLimit would cut py4j's exchange short (py4j makes it a Py4JError and closes
        the connection) and the Spark job would run on. Instead the job's group is canceled
        (by our thread) and `exc` is raised in the task as that call returns (failed, as
        the cancel makes a running action fail; or done), once the cancel is done: a Spark
        job that the task's except block starts is not canceled by it."""
        if not self._waiting or self._pid != os.getpid():
            return False
        self._due = exc
        self._canceled.clear()
        if self.group is not None:
            self._cancels.put((self.group, self._canceled))
        else:
            self._canceled.set()
        return True

    def forget(self) -> None:
        """The soft limit's block ended: nothing deferred to raise any more."""
        self._due = None

    def _raising_when_due(self, send: Any) -> Any:
        """py4j's send_command (a call to the JVM and the wait for its answer), counted in
        `_waiting` on the main thread, which then raises a soft limit deferred meanwhile."""
        main = threading.main_thread().ident

        def send_command(command: str, *args: Any, **kwargs: Any) -> Any:
            if threading.get_ident() != main:  # our cancel thread's, py4j's finalizer's
                return send(command, *args, **kwargs)
            self._waiting += 1
            try:
                return send(command, *args, **kwargs)
            finally:
                self._waiting -= 1
                if self._due is not None:
                    exc, self._due = self._due, None
                    self._canceled.wait(30)
                    raise exc
        return send_command

    def _cancel_loop(self) -> None:
        while (entry := self._cancels.get()) is not None:
            group, done = entry
            try:
                self.session.sparkContext.cancelJobGroup(group)
                log.info("canceled the Spark job group of job %s", group)
            except Exception as e:  # noqa: BLE001 — the kill at kill_grace is the backstop
                log.warning("could not cancel the Spark job group of job %s: %s", group, e)
            if done is not None:
                done.set()

    def stop(self) -> None:
        """The child exits (recycled, its worker stopping): stop the session, then its JVM,
        and wait for it, so that none outlives us."""
        if self.session is None or self._pid != os.getpid():
            return
        self._cancels.put(None)
        try:
            self.session.stop()
        except Exception as e:  # noqa: BLE001 — the JVM is ended below anyway
            log.warning("stopping the Spark session: %s", e)
        self._end_jvm(wait=30.0)

    def abandon(self) -> None:
        """The child is killed in a job that runs no Spark job: end its JVM now."""
        if self.session is not None and self._pid == os.getpid():
            self._end_jvm(wait=0.0)

    def _end_jvm(self, wait: float) -> None:
        from pyspark import SparkContext

        proc = getattr(SparkContext._gateway, "proc", None)
        self.session = None
        SparkContext._gateway = SparkContext._jvm = None  # type: ignore[assignment]  # a next session starts its own
        if proc is None:
            return
        try:
            proc.stdin.close()  # the gateway exits on EOF
            proc.wait(wait)
        except Exception:  # noqa: BLE001 — subprocess.TimeoutExpired, or a broken pipe
            proc.kill()
            proc.wait()


#: This process's.
CHILD = ChildSpark()
