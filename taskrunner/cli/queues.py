"""`taskrunner queue` (create, rate, close/open, pause/resume, delete, info) and what acts on a
queue's jobs: purge, harvest, recover."""

from __future__ import annotations

import json
import os
from typing import Any

import click

from taskrunner.cli.base import app_from, common, confirm_or_stop, emit_json, known_queues, main, progress_bar
from taskrunner.ops import listing
from taskrunner.protocol import codec
from taskrunner.protocol import shards as sharding


@main.group()
def queue() -> None:
    """Create, close, open, pause, resume or delete a queue (bounded, exclusive, rate-limited); see also `queues`."""


@queue.command("create")
@click.argument("name")
@click.option("--bound", type=click.IntRange(min=0), help="Most pending jobs; producers then wait for room (0: no "
              "bound; not given: the queue's bound stays, none for a new queue).")
@click.option("--exclusive/--no-exclusive", default=None, help="At most one job of the queue runs at a time, in "
              "order (not given: as it is; a new queue is not exclusive).")
@click.option("--rate", callback=lambda _c, _p, v: v and _rate(v, none=False),
              help='Most job starts, across all workers: "50/s", "N/m" or "N/h" (not given: the '
              "queue's limit, if any, stays; `queue rate` changes or removes it).")
@click.option("--shards", type=click.IntRange(1, 64), help="Spread the queue over this many shards, each in its own "
              "hash slot (over a Redis Cluster's primaries); FIFO holds per shard. Bound and rate are split "
              "evenly over them. Changes only while the queue has no unfinished job (not given: as it is); "
              "fewer shards drop the removed shards' finished records (results, failures, history).")
@common
def queue_create(name: str, bound: int | None, exclusive: bool | None, rate: str | None, shards: int | None,
                 app_spec: str | None, redis_url: str | None) -> None:
    """Create queue NAME, or change its bound, exclusivity, rate limit and shards: a
    setting not given stays as it is. Prints the queue's settings after. On a Redis
    Cluster, a sharded queue's shards per primary, and a warning when they fall unevenly
    (CRC16 of each shard's name decides), naming the counts that would spread evenly."""
    from taskrunner.ops import queue as queues

    app = app_from(app_spec, redis_url)
    now = queues.create(app, name, bound, exclusive, rate, shards)
    n, limit = now["shards"], now["rate"]
    click.echo(f"queue {name}: bound {now['bound'] or 'none'}{', exclusive' if now['exclusive'] else ''}"
               f"{f', rate {limit}' if limit else ''}{f', {n} shards' if n > 1 else ''}")
    place = queues.placement(app, name, n) if n > 1 else None
    if place is not None:
        click.echo(f"shards per primary: {', '.join(map(str, place.per_primary))} ({', '.join(place.primaries)})")
        if place.uneven:
            counts = ", ".join(map(str, place.even))
            # more shards rather than fewer, which drop the removed shards' finished records
            to = next((k for k in place.even if k >= n), place.even[0]) if place.even else 0
            drop = ("; fewer shards drop the removed shards' finished records and unarchived history"
                    if to < n else "")
            fix = (f"{counts} shards would spread this name evenly (taskrunner queue create {name} --shards "
                   f"{to}, while it has no unfinished job{drop})" if place.even else
                   f"no shard count up to {sharding.MAX} spreads this name evenly")
            click.echo(f"warning: the {n} shards of queue {name} fall unevenly on the {len(place.primaries)} "
                       f"primaries: {fix}", err=True)


def _rate(value: str, none: bool = True) -> str:
    """A rate limit (or "none", where `none`) checked as the arguments are read: a mistake
    in one exits 2 whether or not Redis can be reached."""
    try:
        return value if none and value == "none" else codec.rate("rate", value)
    except ValueError as e:
        raise click.BadParameter(str(e)) from None


@queue.command("rate")
@click.argument("name")
@click.argument("rate", callback=lambda _c, _p, v: _rate(v))
@common
def queue_rate(name: str, rate: str, app_spec: str | None, redis_url: str | None) -> None:
    """Limit how many jobs of queue NAME start, across all workers: RATE "50/s", "N/m" or
    "N/h" (evenly spaced), or "none" to remove the limit."""
    from taskrunner.ops import queue as queues

    queues.set_rate(app_from(app_spec, redis_url), name, None if rate == "none" else rate)
    click.echo(f"queue {name}: {'no rate limit' if rate == 'none' else 'rate ' + rate}")


def _queue_switch(how: str, doc: str, said: str) -> None:
    """`queue close` and `queue open`, `queue pause` and `queue resume`: one setting of a
    queue, each way; with --json, the queue's settings after it (as `queue info --json`)."""
    from taskrunner.ops import queue as queues

    @queue.command(how, help=doc)
    @click.argument("name")
    @click.option("--json", "as_json", is_flag=True, help="Print the queue's settings after the change, as JSON.")
    @common
    def switch(name: str, as_json: bool, app_spec: str | None, redis_url: str | None) -> None:
        app = app_from(app_spec, redis_url)
        getattr(queues, how)(app, name)
        if as_json:
            return emit_json({"name": name, **queues.info(app, name)})
        click.echo(f"queue {name}: {said.format(name=name)}")


_queue_switch("close", "Take no new jobs (enqueue fails with QueueClosed); queued jobs still run.",
              "closed (`taskrunner queue open {name}` undoes it)")


_queue_switch("open", "Take new jobs again after `queue close`.", "open")


_queue_switch("pause", "Workers claim nothing from the queue (and sleep on it); it still takes new jobs, and "
              "running ones go on.", "paused (`taskrunner queue resume {name}` undoes it)")


_queue_switch("resume", "Workers claim from the queue again after `queue pause`.", "resumed")


@queue.command("delete")
@click.argument("name")
@click.option("--force", is_flag=True, help="Even while jobs of it run (their results are then dropped).")
@click.option("--yes", is_flag=True, help="Do not ask (needed where nobody can answer: stdin not a terminal).")
@common
def queue_delete(name: str, force: bool, yes: bool, app_spec: str | None, redis_url: str | None) -> None:
    """Remove every key of queue NAME: its jobs, records and counters. Asks first."""
    from taskrunner.ops import queue as queues

    app = app_from(app_spec, redis_url)
    jobs = queues.deletable(app, name, force)
    confirm_or_stop(f"delete queue {name} and its {', '.join(f'{n} {s}' for s, n in jobs.items())} jobs?", yes)
    n = queues.delete(app, name, force)
    click.echo(f"queue {name}: deleted ({n} keys)")


@queue.command("info")
@click.argument("name")
@click.option("--json", "as_json", is_flag=True, help="Its counts, counters and settings as JSON, as one entry of "
              "`queues --json`.")
@common
def queue_info(name: str, as_json: bool, app_spec: str | None, redis_url: str | None) -> None:
    """Whether queue NAME exists, its length, settings and counters (exit 1 if it does not
    exist); on a Redis Cluster, a sharded queue's shards per primary (as `queue create` says)."""
    from taskrunner.ops import queue as queues

    app = app_from(app_spec, redis_url)
    known_queues(app, name)
    found = [s for s in listing.queue_stats(app) if s["name"] == name]
    if not found:
        raise click.ClickException(f"queue {name!r} was deleted meanwhile")
    place = queues.placement(app, name, found[0]["shards"]) if found[0]["shards"] > 1 else None
    if place is not None:  # on a cluster
        found[0]["placement"] = place.to_dict()
    if as_json:
        return emit_json(found[0])
    for k, v in found[0].items():
        click.echo(f"{k:>18}  {json.dumps(v) if isinstance(v, (dict, list)) else v}")  # JSON, not Python's repr


@main.command()
@click.option("-q", "--queue", "queue_name", required=True, help="The queue to empty.")
@click.option("--yes", is_flag=True, help="Do not ask (needed where nobody can answer: stdin not a terminal).")
@common
def purge(queue_name: str, yes: bool, app_spec: str | None, redis_url: str | None) -> None:
    """Delete every pending job of a queue (running, delayed and finished ones stay). Asks first."""
    app = app_from(app_spec, redis_url)
    known_queues(app, queue_name)
    from taskrunner.ops.queue import backlog

    total = backlog(app, queue_name)
    confirm_or_stop(f"delete {total} pending jobs of {queue_name}?", yes)
    with progress_bar(total, "purging") as progress:
        n = app.purge(queue_name, progress=progress)
    click.echo(f"{n} pending jobs deleted from {queue_name}")


@main.command()
@click.option("-q", "--queue", "queue_list", help="Queues, comma-separated (default: all).")
@common
def harvest(queue_list: str | None, app_spec: str | None, redis_url: str | None) -> None:
    """Return the running jobs of dead workers to their queues now."""
    from taskrunner.ops.dispatcher import Dispatcher
    from taskrunner.ops.queue import shards_of

    app = app_from(app_spec, redis_url)
    if queue_list:
        named = [q for q in queue_list.split(",") if q]
        known_queues(app, *named)
        qs = [s for q in named for s in shards_of(app, q)]
    else:
        qs = app.queue_names()  # every physical queue, shards included
    stats = Dispatcher(app).harvest(qs)
    click.echo(" ".join(f"{k}={v}" for k, v in stats.items()))


class Age(click.ParamType):
    """A duration as `recover --older-than` takes it: seconds, or a number with a unit (90s,
    5m, 2h, 1d), finite and >= 0. Read before anything runs: a negative age (a cutoff in the
    future) would put back every running job, even one its live worker has just started."""

    name = "DURATION"
    UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> float:
        text = str(value)  # a number given as one (a default) is read, and checked, as its text
        try:
            n = float(text[:-1]) * self.UNITS[text[-1]] if text and text[-1] in self.UNITS else float(text)
            return codec.seconds("age", n)
        except ValueError:
            self.fail(f"{text!r}: expected seconds (a number >= 0), or e.g. 90s, 5m, 2h", param, ctx)


@main.command()
@click.option("-q", "--queue", "queue_name", required=True, help="The queue whose running jobs to look at.")
@click.option("--older-than", type=Age(), required=True,
              help="Put back jobs delivered longer ago than this (e.g. 60s, 5m).")
@click.option("--count", type=click.IntRange(min=1), default=1000, show_default=True, help="At most this many.")
@common
def recover(queue_name: str, older_than: float, count: int, app_spec: str | None, redis_url: str | None) -> None:
    """Put running jobs delivered too long ago back in line (whatever their workers do);
    their next delivery is counted. Prints the ids."""
    import socket

    from taskrunner.ops.queue import shards_of
    from taskrunner.protocol import scripts

    app = app_from(app_spec, redis_url)
    known_queues(app, queue_name)
    ids = [i for shard in shards_of(app, queue_name)  # each shard of a sharded queue
           for i in scripts.RECOVER(app.redis, [app.keys.q(shard)],
                                    [older_than, count, f"{socket.gethostname()}:{os.getpid()}"])]
    click.echo("\n".join(ids) if ids else "nothing to recover")
