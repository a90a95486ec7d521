"""`taskrunner analyze`: a PySpark job over the archived job history.

Per task, queue, worker host and hour: counts; completed/failed/killed/requeued/canceled
counts and rates (canceled: workflow steps that never ran, canceled by a failed parent);
runtime p50/p95/p99 (how long each delivery ran, whatever its outcome); queue wait p50/p95
(start of a delivery minus the job's enqueue time); the top error types. Results go next to
the archive (`<history dir>/_analysis/<group>/`, Parquet) and a summary into Redis
(`tr:{_}:history:summary`) for the dashboard, which never imports pyspark.

Local mode on this machine by default (`local[2]`, few shuffle partitions, no UI, quiet
logs); a cluster with --master / TASKRUNNER_SPARK_MASTER, same code."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any

from taskrunner.errors import TaskRunnerError
from taskrunner.ops.history import default_dir
from taskrunner.protocol import codec
from taskrunner.worker.spark_session import DEFAULT_CONF as DEFAULT_CONF  # the settings of every session of ours
from taskrunner.worker.spark_session import spark_conf, spark_session

if TYPE_CHECKING:
    from taskrunner.client.app import TaskRunner

#: percentile_approx accuracy: a percentile's rank is off by at most n / ACCURACY.
ACCURACY = 10_000
GROUPS = {"tasks": "task", "queues": "queue", "workers": "host", "hours": "hour"}
TOP_ERRORS = 5
#: The states of history records counted (and their rates) per group.
OUTCOMES = ("completed", "failed", "killed", "requeued", "canceled")


def parse_since(value: str) -> float:
    """'7d', '12h', '30m', '90s' or seconds."""
    units = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}
    try:
        return float(value[:-1]) * units[value[-1]] if value and value[-1] in units else float(value)
    except ValueError:
        raise ValueError(f"bad duration {value!r}: use e.g. 7d, 12h, 30m") from None


def spark_location(history_dir: str) -> str:
    """The archive as Spark names it. One TASKRUNNER_HISTORY_DIR serves pyarrow (the archiver,
    compaction, analyze's listing) and Spark: a local directory, made absolute; pyarrow's
    `s3://bucket/prefix` (its `?option=` part dropped) as `s3a://bucket/prefix`, the scheme
    of Hadoop's S3 connector (Hadoop has no `s3://` of its own); any other URI as it is."""
    if "://" not in history_dir:
        return os.path.abspath(history_dir)
    location = history_dir.split("?", 1)[0].rstrip("/")
    return "s3a" + location[2:] if location.startswith("s3://") else location


def s3a_conf(history_dir: str, env: dict[str, str] | None = None) -> dict[str, str]:
    """Spark settings that make S3A reach the server pyarrow reaches for an `s3://` archive:
    pyarrow takes the endpoint from AWS_ENDPOINT_URL_S3 or AWS_ENDPOINT_URL (or the URI's
    endpoint_override and scheme options) and the region from AWS_REGION or
    AWS_DEFAULT_REGION; S3A reads neither, so they become fs.s3a.endpoint (path-style
    access, as S3-compatible servers need; SSL as the endpoint's scheme says) and
    fs.s3a.endpoint.region. Credentials need nothing here: S3A's default chain reads
    AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY and AWS_SESSION_TOKEN itself (and no secret
    lands in the settings that --json shows)."""
    from urllib.parse import parse_qs, urlsplit

    if not history_dir.startswith("s3://"):
        return {}
    env = dict(os.environ) if env is None else env
    options = {k: v[-1] for k, v in parse_qs(urlsplit(history_dir).query).items()}
    endpoint = env.get("AWS_ENDPOINT_URL_S3") or env.get("AWS_ENDPOINT_URL")
    if "endpoint_override" in options:
        endpoint = options["endpoint_override"]
        if "://" not in endpoint:
            endpoint = f"{options.get('scheme', 'https')}://{endpoint}"
    conf = {}
    if endpoint:
        conf = {"spark.hadoop.fs.s3a.endpoint": endpoint, "spark.hadoop.fs.s3a.path.style.access": "true",
                "spark.hadoop.fs.s3a.connection.ssl.enabled": str(not endpoint.startswith("http://")).lower()}
    region = options.get("region") or env.get("AWS_REGION") or env.get("AWS_DEFAULT_REGION")
    if region:
        conf["spark.hadoop.fs.s3a.endpoint.region"] = region
    return conf


def require_filesystem(spark: Any, location: str) -> None:
    """TaskRunnerError (one line) when Spark's driver has no Hadoop filesystem for
    `location`'s scheme: asked before reading, instead of a Java stack trace midway. For
    s3a:// that is the hadoop-aws jar of Spark's Hadoop version and the AWS SDK bundle it
    depends on; PySpark does not ship them."""
    from py4j.protocol import Py4JJavaError

    scheme = location.split("://", 1)[0] if "://" in location else "file"
    if scheme == "file":
        return
    jvm = spark._jvm
    try:
        jvm.org.apache.hadoop.fs.FileSystem.getFileSystemClass(scheme, spark._jsc.hadoopConfiguration())
        return
    except Py4JJavaError:
        pass
    hadoop = jvm.org.apache.hadoop.util.VersionInfo.getVersion()
    hint = (f"add the hadoop-aws jar of Hadoop {hadoop} and the AWS SDK bundle it depends on, e.g. --conf "
            f"spark.jars.packages=org.apache.hadoop:hadoop-aws:{hadoop} (from Maven Central) or --conf "
            "spark.jars=/path/hadoop-aws.jar,/path/bundle.jar" if scheme == "s3a"
            else f"add the jar of a Hadoop filesystem for {scheme}:// (--conf spark.jars=...)")
    raise TaskRunnerError(f"Spark cannot read {location}: its Hadoop {hadoop} has no filesystem for "
                          f"{scheme}:// on the classpath: {hint}")


def _spark_schema() -> Any:
    from pyspark.sql import types as T

    ts = T.TimestampType()
    return T.StructType([T.StructField("id", T.StringType()), T.StructField("task", T.StringType()),
                         T.StructField("queue", T.StringType()), T.StructField("state", T.StringType()),
                         T.StructField("attempt", T.LongType()), T.StructField("enqueued_at", ts),
                         T.StructField("started_at", ts), T.StructField("finished_at", ts),
                         T.StructField("runtime", T.DoubleType()), T.StructField("wait", T.DoubleType()),
                         T.StructField("worker", T.StringType()), T.StructField("host", T.StringType()),
                         T.StructField("pid", T.LongType()), T.StructField("error_type", T.StringType()),
                         T.StructField("stream_id", T.StringType())])


def analyze(history_dir: str | None = None, since: float = 7 * 86400, master: str | None = None,
            now: float | None = None, progress: Callable[[str], Any] = lambda _: None,
            spark: Any = None, conf: dict[str, str] | None = None) -> dict[str, Any]:
    """Compute the summary (see the module doc) over records finished in the last `since` s,
    with Spark settings `conf` (default spark_conf()) unless `spark` is a running session."""
    from pyspark.sql import functions as F

    history_dir = history_dir or default_dir()
    now = now if now is not None else time.time()
    started = time.monotonic()
    progress("starting Spark")
    conf = {**s3a_conf(history_dir), **(conf if conf is not None else spark_conf())}
    spark = spark or spark_session(master, conf)
    root = spark_location(history_dir)
    require_filesystem(spark, root)
    progress(f"reading {root}")
    for tries_left in (2, 1, 0):  # a compaction may delete files listed (merged): list again
        files, read = plan(history_dir, now - since)
        try:
            df = _load(spark, root, files, now - since, F)
            progress("per task, queue, host and hour")
            groups = _groups(spark, df)
            progress("top error types")
            errors = _errors(spark, df)
            break
        except Exception as e:
            if not tries_left or not _vanished(e):
                raise
            progress("a file was compacted away while read: reading again")
    summary: dict[str, Any] = {"generated_at": now, "since": since,
                               "records": sum(r["count"] for r in groups["tasks"]), "history_dir": root,
                               "read": read, "accuracy": ACCURACY,
                               "spark": {"master": spark.sparkContext.master,
                                         "conf": {k: spark.conf.get(k, None) for k in sorted(conf)}}}
    for name, key in GROUPS.items():
        summary[name] = groups[name]
        for row in summary[name]:
            row["top_errors"] = [{"error_type": e, "count": c}
                                 for c, e in sorted(errors.get((key, row[key]), []), key=lambda x: (-x[0], x[1]))
                                 [:TOP_ERRORS]]
    summary["errors"] = [{"error_type": e, "count": c}
                         for c, e in sorted(errors.get(("error_type", None), []), key=lambda x: (-x[0], x[1]))[:20]]
    progress("writing results")
    out = f"{root}/_analysis"
    for name in GROUPS:
        rows = [{k: v for k, v in r.items() if k != "top_errors"} for r in summary[name]]
        if rows:
            spark.createDataFrame(rows).coalesce(1).write.mode("overwrite").parquet(f"{out}/{name}")
    summary["seconds"] = round(time.monotonic() - started, 2)
    return summary


def _load(spark: Any, root: str, files: list[str], start: float, F: Any) -> Any:
    """The records of `files` finished at `start` or later: only the columns the figures
    need (Parquet reads no other), the hour as a number (hours since 1970, UTC; made text
    for its 168 or so groups, not for each record). Not cached: the two jobs that read it
    read different columns, and a cache of 10M records does not fit a 1 GB driver."""
    if not files:
        df = spark.createDataFrame([], _spark_schema())
    else:
        df = spark.read.schema(_spark_schema()).option("basePath", root).parquet(*(root + f for f in files))
    return (df.where(F.col("finished_at") >= F.to_timestamp(F.lit(start)))
            .select("task", "queue", "host", "state", "runtime", "wait", "error_type",
                    F.floor(F.unix_seconds("finished_at") / 3600).alias("hour")))


#: Which grouping set a row of GROUPING SETS is of: grouping(c) is 0 where the set groups by c.
_GROUPING = ", ".join(f"grouping({k}) AS grouping_{k}" for k in GROUPS.values())


def _groups(spark: Any, df: Any) -> dict[str, list[dict[str, Any]]]:
    """Counts, outcome counts and rates and percentiles per task, queue, host and hour: one
    job, one read (GROUPING SETS), whatever the number of groups."""
    outcomes = ", ".join(f"count_if(state = '{s}') AS {s}" for s in OUTCOMES)
    rows = spark.sql(f"""
        SELECT {_GROUPING}, task, queue, host, hour, count(1) AS count, {outcomes},
               percentile_approx(runtime, array(0.5, 0.95, 0.99), {ACCURACY}) AS runtime_pct,
               percentile_approx(wait, array(0.5, 0.95), {ACCURACY}) AS wait_pct
        FROM {{df}} GROUP BY GROUPING SETS ((task), (queue), (host), (hour))""", df=df).collect()
    out: dict[str, list[dict[str, Any]]] = {name: [] for name in GROUPS}
    for r in rows:
        name, key = next((n, k) for n, k in GROUPS.items() if not r[f"grouping_{k}"])
        n = r["count"]
        rp, wp = r["runtime_pct"] or [None] * 3, r["wait_pct"] or [None] * 2
        row: dict[str, Any] = {key: _key(key, r[key]), "count": n}
        for s in OUTCOMES:
            row[s] = int(r[s])
            row[f"{s}_rate"] = round(r[s] / n, 6) if n else 0.0
        row.update(runtime_p50=rp[0], runtime_p95=rp[1], runtime_p99=rp[2], wait_p50=wp[0], wait_p95=wp[1])
        out[name].append(row)
    for name, key in GROUPS.items():  # as Spark orders: nulls first
        out[name].sort(key=lambda row: (row[key] is not None, row[key]))
    return out


def _errors(spark: Any, df: Any) -> dict[tuple[str, Any], list[tuple[int, str]]]:
    """(count, error type) of the records that have one, per (column, value) of each group
    and overall (("error_type", None)): one job over those records' few columns."""
    rows = spark.sql(f"""
        SELECT {_GROUPING}, task, queue, host, hour, error_type, count(1) AS count
        FROM {{df}} WHERE error_type IS NOT NULL
        GROUP BY GROUPING SETS ((task, error_type), (queue, error_type), (host, error_type), (hour, error_type),
                                (error_type))""", df=df).collect()
    out: dict[tuple[str, Any], list[tuple[int, str]]] = {}
    for r in rows:
        key = next((k for k in GROUPS.values() if not r[f"grouping_{k}"]), None)  # None: the set (error_type)
        where = (key, _key(key, r[key])) if key else ("error_type", None)
        out.setdefault(where, []).append((r["count"], r["error_type"]))
    return out


def _key(column: str, value: Any) -> Any:
    """A group's value as shown: an hour as `2026-11-26T01:00Z`."""
    if column == "hour" and value is not None:
        return datetime.fromtimestamp(value * 3600, timezone.utc).strftime("%Y-%m-%dT%H:00Z")
    return value


def _vanished(e: Exception) -> bool:
    """Did Spark fail because a file it was given is gone?"""
    text = str(e)
    return any(s in text for s in ("FileNotFoundException", "PATH_NOT_FOUND", "FILE_NOT_EXIST"))


def plan(history_dir: str, start: float) -> tuple[list[str], dict[str, int]]:
    """The archive's files that may hold records finished at `start` or later, as paths
    relative to the archive ("/date=.../queue=.../x.parquet"), and what they are: the date
    partitions from `start`'s UTC day on (the archiver files a record under its finished_at
    day), read from one listing of the archive's root and one of each such day; no other
    day's files are listed."""
    from taskrunner.ops.history import dates, live_files, open_dir, queue_dirs

    fs, root = open_dir(history_dir)
    every = dates(fs, root)
    first = datetime.fromtimestamp(max(start, 0), timezone.utc).strftime("%Y-%m-%d")
    wanted = [d for d in every if d >= first]
    files = [f for d in wanted for q in queue_dirs(fs, root, d) for f in live_files(fs, q)]
    read = {"partitions": len(wanted), "partitions_total": len(every), "files": len(files),
            "bytes": sum(f.size for f in files)}
    return [f.path[len(root):] for f in files], read


def run_as_job(app: TaskRunner, since: str = "7d") -> dict[str, Any]:
    """The periodic job (TASKRUNNER_ANALYZE_CRON): analyse, publish, return the counts."""
    summary = analyze(since=parse_since(since))
    publish(app, summary)
    return {"records": summary["records"], "seconds": summary["seconds"]}


def publish(app: TaskRunner, summary: dict[str, Any]) -> None:
    """Keep the summary in Redis, where the dashboard reads it."""
    app.redis.set(app.keys.g + "history:summary", codec.dumps(summary))


def latest(app: TaskRunner) -> dict[str, Any] | None:
    raw = app.redis.get(app.keys.g + "history:summary")
    return codec.loads(raw) if raw else None
