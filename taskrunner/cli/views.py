"""What is there now, read-only: queues, workers, a queue's jobs with their deliveries, Prometheus
metrics."""

from __future__ import annotations

import click

from taskrunner.cli.base import app_from, bound_text, column_width, common, emit_json, known_queues, main, timestamp
from taskrunner.ops import listing
from taskrunner.protocol.connection import server_time


@main.command()
@click.option("--json", "as_json", is_flag=True, help="Every queue's counts and settings as JSON (a list), with "
              "`duplicates` per task.")
@click.option("--shards", "by_shard", is_flag=True, help="A sharded queue's shards each on a line of its own "
              "(NAME~i; shard 0 is NAME), not their totals; on a Redis Cluster, with the primary that serves each.")
@common
def queues(as_json: bool, by_shard: bool, app_spec: str | None, redis_url: str | None) -> None:
    """Every queue (topic) with its counts, counters and settings; a sharded queue once,
    with its shards' totals (--shards: each shard, and on a Redis Cluster the primary that
    serves it). Finished counts cover the result TTL; produced/consumed count messages since
    the queue was created."""
    from taskrunner.ops.queue import primaries_of

    app = app_from(app_spec, redis_url)
    stats = listing.queue_stats(app, shards=by_shard)
    placed = primaries_of(app, [s["name"] for s in stats]) if by_shard else None  # None off a cluster
    for s, primary in zip(stats, placed or ()):
        s["primary"] = primary
    if as_json:
        return emit_json(stats)
    cols = ("waiting", "pending", "delayed", "running", "completed", "failed", "killed", "canceled",
            "produced_messages", "consumed_messages")
    click.echo(f"{'QUEUE':20}" + "".join(f"{c.split('_')[0].upper():>11}" for c in cols) + "  SETTINGS")
    for s in stats:
        flags = " ".join(f for f, on in ((bound_text(s), s["bound"]), ("closed", s["closed"]),
                                         ("exclusive", s["exclusive"]), ("paused", s["paused"]),
                                         ("priorities=" + ",".join(map(str, s["priorities"])), s["priorities"]),
                                         (f"rate={s['rate']} used={s['rate_used']}", s["rate"]),
                                         (f"shards={s['shards']}", s["shards"] > 1),
                                         (f"primary={s.get('primary')}", "primary" in s)) if on)
        click.echo(f"{s['name']:20}" + "".join(f"{s[c]:>11}" for c in cols) + f"  {flags}")


@main.command()
@common
def metrics(app_spec: str | None, redis_url: str | None) -> None:
    """Print the Prometheus metrics, read from Redis now: what the dashboard serves at
    GET /metrics (queue depths and ages, stuck jobs, workers and their slots, dispatchers'
    last pass). For a scrape without the dashboard, or a look by eye."""
    from taskrunner.ops.metrics import exposition

    click.echo(exposition(app_from(app_spec, redis_url)).decode(), nl=False)


@main.command()
@click.option("--json", "as_json", is_flag=True, help="Every worker's record as JSON (a list), with its state "
              "and heartbeat age.")
@common
def workers(as_json: bool, app_spec: str | None, redis_url: str | None) -> None:
    """Workers: alive ones with their heartbeat, and those found dead in the last hour. BUSY:
    children running a job, of all; BEAT: since the last heartbeat; CPU %: of one core, the
    worker and its children together, since the heartbeat before."""
    ws = listing.workers(app_from(app_spec, redis_url))
    if as_json:
        return emit_json(ws)
    click.echo(f"{'NAME':28} {'STATE':6} {'HOST':16} {'IP':15} {'PID':>7} {'BUSY':>6} {'BEAT':>6} "
               f"{'RSS MB':>7} {'CPU %':>6}  QUEUES")
    for w in ws:
        beat = f"{w['heartbeat_age']:.1f}s" if w.get("heartbeat_age") is not None else "-"
        busy = "-" if w.get("busy") is None else f"{w['busy']}/{w.get('concurrency', '?')}"
        cpu = "-" if w.get("cpu") is None else f"{w['cpu']:.1f}"
        rss = "-" if w.get("rss") is None else f"{w['rss'] / 1e6:.1f}"  # a consumer (consume, Node) says none
        click.echo(f"{w['name'][:28]:28} {w['state']:6} {str(w.get('host', '-'))[:16]:16} {w.get('ip', '-'):15} "
                   f"{w.get('pid', '-'):>7} {busy:>6} {beat:>6} {rss:>7} {cpu:>6}  "
                   f"{','.join(w.get('queues', []))}")


@main.command()
@click.option("-q", "--queue", "queue_name", required=True, help="The queue to look into.")
@click.option("--running", is_flag=True, help="In-flight jobs instead of waiting ones.")
@click.option("--limit", type=click.IntRange(min=1), default=50, show_default=True,
              help="At most this many jobs.")
@click.option("--json", "as_json", is_flag=True, help="The jobs as JSON (a list).")
@common
def inspect(queue_name: str, running: bool, limit: int, as_json: bool, app_spec: str | None,
            redis_url: str | None) -> None:
    """Jobs with their delivery count, last delivery time and age."""
    app = app_from(app_spec, redis_url)
    known_queues(app, queue_name)
    now = server_time(app.redis)
    if running:
        _, rows = listing.running(app, queue_name, 0, limit)
        out = [{"id": r["id"], "task": r["task"], "deliveries": r["attempt"], "last_delivery": r["started_at"],
                "age": round(now - r["started_at"], 3), "worker": r["worker"], "pid": r["pid"]} for r in rows]
    else:
        _, rows = listing.page_of(app, queue_name, "pending", 0, limit)
        out = [{"id": r["id"], "task": r["task"], "deliveries": r["attempts"] or 0,
                "last_delivery": r["started_at"], "age": round(now - (r["enqueued_at"] or now), 3)} for r in rows]
    if as_json:
        return emit_json(out)
    iw = column_width(26, [r["id"] for r in out])
    click.echo(f"{'ID':{iw}}  {'TASK':30} {'DELIVERIES':>10}  {'LAST DELIVERY':23}  {'AGE':>9}")
    for r in out:
        click.echo(f"{r['id']:{iw}}  {(r['task'] or '?')[:30]:30} {r['deliveries']:>10}  "
                   f"{timestamp(r['last_delivery']):23}  {r['age']:>8.1f}s")
