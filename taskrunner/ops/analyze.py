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

import math
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
            groups, errors = _figures(spark, df)
            break
        except Exception as e:
            if not tries_left or not _vanished(e):
                raise
            progress("a file was compacted away while read: reading again")
    summary: dict[str, Any] = {"generated_at": now, "since": since,
                               "records": sum(r["count"] for r in groups["tasks"]), "history_dir": root,
                               "read": read, "percentiles": {"method": "histogram", "precision": PRECISION,
                                                             "min_value": MIN_VALUE},
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


#: Error types (count, type) per (column, value) of each group, and overall: ("error_type", None).
Errors = dict[tuple[str, Any], list[tuple[int, str]]]


def _figures(spark: Any, df: Any) -> tuple[dict[str, list[dict[str, Any]]], Errors]:
    """Counts, outcome counts and rates and percentiles per task, queue, host and hour, and
    the error types (count, type) per (column, value) of each group and overall
    (("error_type", None)): two jobs, each one read of the records (see _counts and
    _histograms)."""
    counts, errors, names = _counts(spark, df)
    percentiles = _histograms(spark, df)
    out: dict[str, list[dict[str, Any]]] = {name: [] for name in GROUPS}
    for (name, value), row in counts.items():
        key = GROUPS[name]
        n = row.pop("count")
        figures: dict[str, Any] = {key: _key(key, value), "count": n}
        for s in OUTCOMES:
            figures[s] = row.get(s, 0)
            figures[f"{s}_rate"] = round(figures[s] / n, 6) if n else 0.0
        found = percentiles.get((name, value if key == "hour" else names[name, value]), {})
        for metric, ps in PERCENTILES.items():
            for p in ps:
                figures[f"{metric}_p{p}"] = found.get((metric, p))
        out[name].append(figures)
    for name, key in GROUPS.items():  # as Spark orders: nulls first
        out[name].sort(key=lambda row: (row[key] is not None, row[key]))
    return out, errors


#: The percentiles computed, per column.
PERCENTILES = {"runtime": (50, 95, 99), "wait": (50, 95)}
#: Percentiles come from a histogram of fixed, log-spaced buckets, exact counts: the bucket
#: that holds a group's p-th value (its nearest rank, the ceil(p/100 * n)-th smallest) is
#: found exactly, and its geometric middle reported, within PRECISION of that value
#: (relative: 0.5%); a value under MIN_VALUE (1 µs: the history keeps 6 decimals) counts
#: as 0 (absolute error < 1 µs). Buckets: [r^i, r^(i+1)) with r = (1 + PRECISION)^2.
PRECISION = 0.005
MIN_VALUE = 1e-6
_LN_R = 2 * math.log1p(PRECISION)
_FIRST = math.floor(math.log(MIN_VALUE) / _LN_R)  # the bucket of MIN_VALUE: numbered 1
_BUCKET_BITS = 20  # |bucket number| < 2^19 for any finite double: (709.8 + 13.9) / _LN_R < 73,000


def _bucket(column: str) -> str:
    """SQL of the bucket number of a value: 0 under MIN_VALUE; n > 0 for [r^(n-1+_FIRST),
    r^(n+_FIRST)); -n for the negative values mirrored (a wait of a clock skewed between
    hosts); NULL for NULL, NaN and infinities (no bucket: not counted)."""
    return (f"CASE WHEN NOT abs({column}) <= 1.7976931348623157E308D THEN NULL "
            f"WHEN abs({column}) < {MIN_VALUE!r}D THEN 0 "
            f"ELSE CAST(signum({column}) * (floor(ln(abs({column})) / {_LN_R!r}D) - ({_FIRST}) + 1) AS INT) END")


def _value(bucket: int) -> float:
    """The value a bucket number stands for: its geometric middle (0 for bucket 0)."""
    if not bucket:
        return 0.0
    return math.copysign(math.exp((abs(bucket) - 0.5 + _FIRST) * _LN_R), bucket)


#: The (grouping, column) histograms: the grouping (task, queue, host, hour) by index.
_HISTOGRAMS = [(g, metric) for g in range(len(GROUPS)) for metric in PERCENTILES]


def _histograms(spark: Any, df: Any) -> dict[tuple[str, Any], dict[tuple[str, int], float]]:
    """The percentiles of each group: {(grouping, key): {(column, p): value}}, the key an
    hour's number or xxhash64 of a task, queue or host (see _counts). One job: each record
    gives 8 (key, code) pairs (4 groupings x runtime and wait; the code: which histogram and
    the bucket), all primitive, counted in one hash aggregation (GROUPING SETS of the string
    columns with the sketches of percentile_approx took 3-4 times the CPU: docs/PERFORMANCE.md);
    then per histogram a running count over its buckets in order finds each percentile's
    bucket (a few thousand rows per group)."""
    keys = ["xxhash64(task)", "xxhash64(queue)", "xxhash64(host)", "hour"]
    half = 1 << (_BUCKET_BITS - 1)
    pairs = ", ".join(f"struct({keys[g]} AS k, {(i << _BUCKET_BITS) + half} + {metric}_bucket AS c)"
                      for i, (g, metric) in enumerate(_HISTOGRAMS))
    found = ", ".join(f"min(b) FILTER (WHERE below * 100 >= n * {p}) AS p{p}" for p in (50, 95, 99))
    rows = spark.sql(f"""
        WITH counted AS (
            SELECT k, c, count(1) AS n FROM (
                SELECT inline(array({pairs})) FROM (
                    SELECT hour, task, queue, host, {_bucket("runtime")} AS runtime_bucket,
                           {_bucket("wait")} AS wait_bucket FROM {{df}}))
            WHERE c IS NOT NULL GROUP BY k, c),
        running AS (
            SELECT k, shiftright(c, {_BUCKET_BITS}) AS h, (c & {(1 << _BUCKET_BITS) - 1}) - {half} AS b,
                   sum(n) OVER (PARTITION BY k, shiftright(c, {_BUCKET_BITS}) ORDER BY c) AS below,
                   sum(n) OVER (PARTITION BY k, shiftright(c, {_BUCKET_BITS})) AS n
            FROM counted)
        SELECT k, h, {found} FROM running GROUP BY k, h""", df=df).collect()
    out: dict[tuple[str, Any], dict[tuple[str, int], float]] = {}
    names = list(GROUPS)
    for r in rows:
        g, metric = _HISTOGRAMS[r["h"]]
        group = out.setdefault((names[g], r["k"]), {})
        for p in PERCENTILES[metric]:
            group[metric, p] = _value(r[f"p{p}"])
    return out


def _counts(spark: Any, df: Any) -> tuple[dict[tuple[str, Any], dict[str, int]], Errors, dict[tuple[str, Any], int]]:
    """Per group, {(grouping, value): {"count": n, <state>: n}}; the error types (count,
    type) per (column, value) and overall (("error_type", None)); and the xxhash64 of each
    task, queue and host, {(grouping, value): hash}, by which _histograms knows them. One
    job: the records counted per (task, queue, host, hour, state, error type), a few rows per
    hour and task, then those counts summed per grouping (GROUPING SETS over them, not over
    the records)."""
    rows = spark.sql(f"""
        WITH fine AS (
            SELECT task, queue, host, hour, state, error_type, count(1) AS n FROM {{df}}
            GROUP BY task, queue, host, hour, state, error_type)
        SELECT {", ".join(f"grouping({k}) AS grouping_{k}" for k in GROUPS.values())},
               task, queue, host, hour, xxhash64(task) AS task_hash, xxhash64(queue) AS queue_hash,
               xxhash64(host) AS host_hash, state, error_type, sum(n) AS n
        FROM fine GROUP BY state, error_type, GROUPING SETS ((task), (queue), (host), (hour), ())""",
                     df=df).collect()
    counts: dict[tuple[str, Any], dict[str, int]] = {}
    errors: dict[tuple[str, Any], dict[str, int]] = {}
    names: dict[tuple[str, Any], int] = {}
    for r in rows:
        name, key = next(((n, k) for n, k in GROUPS.items() if not r[f"grouping_{k}"]), (None, None))
        where = (key, _key(key, r[key])) if key else ("error_type", None)
        if r["error_type"] is not None:  # one row per state: failed, killed
            types = errors.setdefault(where, {})
            types[r["error_type"]] = types.get(r["error_type"], 0) + r["n"]
        if name is None:
            continue
        group = counts.setdefault((name, r[key]), {"count": 0})
        group["count"] += r["n"]
        group[r["state"]] = group.get(r["state"], 0) + r["n"]
        if key != "hour":
            names[name, r[key]] = r[f"{key}_hash"]
    for name in ("tasks", "queues", "workers"):  # 64-bit hashes: a collision would merge two groups' percentiles
        hashes = [h for (n, _), h in names.items() if n == name]
        if len(set(hashes)) < len(hashes):
            raise TaskRunnerError(f"two {name} of the archive have the same xxhash64: their percentiles cannot "
                                  "be told apart")
    return counts, {w: [(c, e) for e, c in types.items()] for w, types in errors.items()}, names


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
