"""spark=True tasks of tests/test_spark_tasks.py, on the tests' app, in queue "spark"
(workers run them with -A tests.spark_apps -Q spark)."""

from __future__ import annotations

import os
import time
from typing import Any

from taskrunner import SoftTimeLimit, current_job
from tests.apps import app


def _jvm() -> int:
    from pyspark import SparkContext

    return SparkContext._gateway.proc.pid  # type: ignore[union-attr]


@app.task(spark=True, queue="spark", max_duration=120)
def count(n: int) -> dict[str, Any]:
    """Counts n rows with the child's session; says which session, child and JVM ran it."""
    spark = current_job().spark
    return {"count": spark.range(n).count(), "app": spark.sparkContext.applicationId, "child": os.getpid(),
            "jvm": _jvm()}


def endless(spark: Any, marker: str) -> int:
    """A Spark job that never ends by itself: each of its 2 Spark tasks writes the PID of
    its Python worker to `marker` (the job has begun), then sleeps."""
    def slow(i: int) -> int:
        with open(marker, "a") as f:
            f.write(f"{os.getpid()}\n")
        time.sleep(600)
        return i

    return spark.sparkContext.parallelize(range(2), 2).map(slow).count()


@app.task(spark=True, queue="spark", max_duration=120, max_lost=1)
def crawl(marker: str) -> int:
    """endless(), after telling its child and JVM."""
    spark = current_job().spark
    app.redis.rpush(f"{app.settings.prefix}:jvm", f"{os.getpid()} {_jvm()}")
    return endless(spark, marker)


@app.task(queue="spark")
def not_spark() -> Any:
    return current_job().spark


@app.task(spark=True, queue="spark", soft_limit=20, max_duration=120)
def soft_crawl(marker: str) -> dict[str, Any]:
    """endless(), under a soft limit: says in Redis which of its blocks ran, and runs one
    more Spark job in its except block."""
    spark = current_job().spark
    said = f"{app.settings.prefix}:said"
    try:
        endless(spark, marker)
        app.redis.rpush(said, "returned")
        return {}
    except SoftTimeLimit:
        app.redis.rpush(said, "except")
        return {"after": spark.range(7).count()}  # the session runs this job's next Spark job
    finally:
        app.redis.rpush(said, "finally")
