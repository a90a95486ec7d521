"""Job history: archive it to Parquet, compact and look at the archive, reindex failures, analyze
it with PySpark."""

from __future__ import annotations

import os
from datetime import datetime

import click

from taskrunner.cli.base import Finite, app_from, common, emit_json, main, progress_bar
from taskrunner.errors import (
    TaskRunnerError,
    require_extra,
)


@main.group()
def history() -> None:
    """Job history: archive it to Parquet (the dispatcher does so every few seconds)."""


@history.command("archive")
@click.option("--history-dir", envvar="TASKRUNNER_HISTORY_DIR", help="Where (default ./var/history; any "
              "pyarrow filesystem URI, e.g. s3://bucket/path). Env: TASKRUNNER_HISTORY_DIR.")
@click.option("--batch", type=click.IntRange(min=1), default=10_000, show_default=True, help="Records per file.")
@common
def history_archive(history_dir: str | None, batch: int, app_spec: str | None, redis_url: str | None) -> None:
    """Move every history record now; safe to interrupt and run again (exactly once)."""
    from taskrunner.ops.history import Archiver, backlog

    app = app_from(app_spec, redis_url)
    archiver = Archiver(app, history_dir, batch)
    waiting = sum(backlog(app).values())
    with progress_bar(waiting, "archiving") as progress:
        n = archiver.archive(progress=progress)
    click.echo(f"{n} records archived to {archiver.directory}")


@history.command("compact")
@click.option("--history-dir", envvar="TASKRUNNER_HISTORY_DIR", help="The archive (default ./var/history). "
              "Env: TASKRUNNER_HISTORY_DIR.")
@click.option("--date", "day", type=click.DateTime(["%Y-%m-%d"]), help="Only this day's partitions (YYYY-MM-DD; "
              "default: every day but today, UTC).")
@click.option("--target-mb", type=Finite(min=1), default=128, show_default=True,
              help="About how large each merged file is.")
@click.option("--json", "as_json", is_flag=True, help="What it did (partitions, files merged and written) as JSON.")
@common
def history_compact(history_dir: str | None, day: datetime | None, target_mb: float, as_json: bool,
                    app_spec: str | None, redis_url: str | None) -> None:
    """Merge each (date, queue) partition's small files into files of about --target-mb;
    safe to interrupt and run again (every record stays exactly once; readers never see a
    half state). The dispatcher does it once a day."""
    from taskrunner.ops.compact import Compactor

    c = Compactor(app_from(app_spec, redis_url), history_dir, target_mb)
    stats = c.run([day.strftime("%Y-%m-%d")] if day else None)
    if as_json:
        return emit_json(stats)
    click.echo(f"{stats['merged']} files merged into {stats['written']} in {stats['partitions']} partitions "
               f"of {c.directory}")


@history.command("status")
@click.option("--json", "as_json", is_flag=True, help="The records waiting, per queue, as JSON.")
@common
def history_status(as_json: bool, app_spec: str | None, redis_url: str | None) -> None:
    """Records waiting to be archived, per queue."""
    from taskrunner.ops.history import backlog as history_backlog

    backlog = history_backlog(app_from(app_spec, redis_url))
    if as_json:
        return emit_json(backlog)
    if not backlog:  # a blank output would read as a command that did nothing, or failed
        click.echo("no queues: no job history to archive")
    for q, n in backlog.items():
        click.echo(f"{q:20} {n:>10} waiting")


@main.group()
def failures() -> None:
    """The failure indexes the dashboard's Failed and Killed filters read (docs/PROTOCOL.md,
    Failure indexes)."""


@failures.command("reindex")
@click.option("-q", "--queue", "queue_name", help="Only this queue (a sharded one: each shard); default: every queue.")
@click.option("--batch", type=click.IntRange(1, 10_000), default=500, show_default=True,
              help="Jobs read and indexed per step (one ZSCAN and one script call).")
@click.option("--json", "as_json", is_flag=True, help="Print the counts per queue and state as JSON.")
@common
def failures_reindex(queue_name: str | None, batch: int, as_json: bool, app_spec: str | None,
                     redis_url: str | None) -> None:
    """Index the failed and killed jobs that ended before the indexes existed (an upgrade
    from a version without them): they then show in the filters. Safe beside live workers,
    to interrupt and to run again."""
    from taskrunner.ops import failures as failing

    app = app_from(app_spec, redis_url)
    if queue_name is not None and queue_name not in app.queue_names():  # a queue, or one shard's name
        from taskrunner.ops.queue import must_exist

        must_exist(app, queue_name)  # no such queue, or not a name: says so

    def progress(q: str, state: str, seen: int, total: int, last: bool) -> None:
        if not as_json:
            click.echo(f"\r{q} {state}: {seen}/{total}", nl=last, err=True)

    out = failing.reindex(app, queue_name, batch, progress)
    if as_json:
        return emit_json(out)
    indexed = sum(c["indexed"] for states in out.values() for c in states.values())
    skipped = sum(c["skipped"] for states in out.values() for c in states.values())
    click.echo(f"{indexed} jobs indexed, {skipped} no longer failed or killed left as they are; queues: "
               f"{', '.join(out) or 'none'}")


@main.command()
@click.option("--since", default="7d", show_default=True, help="Records finished within this (e.g. 7d, 12h).")
@click.option("--master", envvar="TASKRUNNER_SPARK_MASTER", help="Spark master (default local[2]; e.g. "
              "spark://host:7077). Env: TASKRUNNER_SPARK_MASTER.")
@click.option("--history-dir", envvar="TASKRUNNER_HISTORY_DIR", help="The archive (default ./var/history; "
              "s3://bucket/path is read as s3a://, which needs the hadoop-aws jars: README).")
@click.option("--conf", "conf", multiple=True, metavar="KEY=VALUE",
              help="A Spark setting, repeatable (e.g. --conf spark.driver.memory=4g); over TASKRUNNER_SPARK_CONF, "
                   "comma-separated KEY=VALUE pairs (e.g. spark.sql.shuffle.partitions=8,spark.driver.memory=2g), "
                   "over the defaults: spark.sql.shuffle.partitions=4, spark.driver.memory=1g, UI off, UTC "
                   "(and two of listing and aggregation: README).")
@click.option("--json", "as_json", is_flag=True, help="Print the summary as JSON.")
@common
def analyze(since: str, master: str | None, history_dir: str | None, conf: tuple[str, ...], as_json: bool,
            app_spec: str | None, redis_url: str | None) -> None:
    """Statistics of the archived job history, with PySpark: per task, queue, worker host
    and hour (counts, outcome rates, runtime and wait percentiles, top errors). Writes them
    next to the archive and into Redis for the dashboard's History page."""
    require_extra("spark", "analyze (PySpark)", "pyspark", "pyarrow")
    from taskrunner.ops import analyze as analysis
    from taskrunner.ops.history import default_dir

    try:
        seconds = analysis.parse_since(since)
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="--since") from None
    settings = analysis.spark_conf(list(conf))  # a bad entry: ValueError, one line, exit 2
    app = app_from(app_spec, redis_url)
    where = history_dir or default_dir()
    if "://" not in where and not os.path.isdir(where):  # a typo, or another directory than the dispatcher's
        raise TaskRunnerError(f"no job history at {os.path.abspath(where)}: the dispatcher archives finished jobs "
                              "into ./var/history of its directory (or TASKRUNNER_HISTORY_DIR) every 5 s; "
                              "`taskrunner history archive` does it now; or give --history-dir")
    summary = analysis.analyze(history_dir, seconds, master, conf=settings,
                               progress=lambda stage: click.echo(f"analyze: {stage}...", err=True))
    analysis.publish(app, summary)
    if as_json:
        return emit_json(summary)
    click.echo(f"{summary['records']} records in the last {since}, analysed in {summary['seconds']} s")
    click.echo(f"{'TASK':40} {'COUNT':>8} {'OK %':>6} {'FAIL %':>7} {'P50 s':>8} {'P95 s':>8} {'P99 s':>8}")
    for t in summary["tasks"]:
        p = [f"{v:8.3f}" if v is not None else "       -" for v in (t["runtime_p50"], t["runtime_p95"],
                                                                    t["runtime_p99"])]
        click.echo(f"{str(t['task'])[:40]:40} {t['count']:>8} {100 * t['completed_rate']:>6.1f} "
                   f"{100 * t['failed_rate']:>7.1f} {' '.join(p)}")
