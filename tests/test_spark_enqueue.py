"""enqueue_dataframe on a real local SparkSession: one job per row, each enqueued once
however often the call runs."""

from __future__ import annotations

import os

import pytest

if not os.environ.get("CI"):  # CI installs PySpark and Java: there a missing one fails
    pytest.importorskip("pyspark", reason="PySpark is not installed (pip install 'taskrunner[spark]')")

from taskrunner.ops import analyze  # noqa: E402
from taskrunner.protocol import codec  # noqa: E402
from taskrunner.spark import enqueue_dataframe  # noqa: E402


@pytest.fixture(scope="module")
def spark():
    session = analyze.spark_session("local[2]")
    yield session
    session.stop()


def test_each_row_is_enqueued_exactly_once(app, spark, monkeypatch):
    # The executors get the settings from the environment, as a job without app= does.
    monkeypatch.setenv("REDIS_URL", app.settings.redis_url)
    monkeypatch.setenv("TASKRUNNER_PREFIX", app.settings.prefix)
    df = spark.range(100_000).selectExpr("concat('sku-', id) AS sku", "id AS n", "cast(id % 7 AS string) AS shop")
    assert df.rdd.getNumPartitions() >= 2
    assert enqueue_dataframe(df, "shop.reindex", id_column="sku", queue="reindex") == 100_000
    pending = app.keys.q("reindex") + "pending"
    assert app.redis.llen(pending) == 100_000
    job = app.job("sku-4242", "reindex").refresh()
    assert job.data["task"] == "shop.reindex" and codec.loads(job.data["kwargs"]) == {"n": 4242, "shop": "0"}
    # The whole call again (as a Spark task run again would): nothing new.
    assert enqueue_dataframe(df, "shop.reindex", id_column="sku", queue="reindex", app=app, batch=500) == 0
    assert app.redis.llen(pending) == 100_000
    assert len(set(app.redis.lrange(pending, 0, -1))) == 100_000


def test_a_frame_it_cannot_enqueue_is_refused_before_spark_runs(app, spark):
    df = spark.range(3).selectExpr("id AS sku", "current_timestamp() AS at")
    with pytest.raises(ValueError, match="column 'at' is timestamp, which JSON has not: cast it"):
        enqueue_dataframe(df, "shop.reindex", id_column="sku", app=app)
    with pytest.raises(ValueError, match=r"no column 'id' in the DataFrame \(its columns: sku, at\)"):
        enqueue_dataframe(df, "shop.reindex", id_column="id", app=app)
    assert enqueue_dataframe(df.select("sku"), "shop.reindex", id_column="sku", app=app) == 3  # whole numbers
    assert app.job("2", "default").refresh().data["kwargs"] == "{}"
