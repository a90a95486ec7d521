"""What every command shares: the `taskrunner` group, its options (-A, --redis-url), how errors
become exit codes, and small helpers for reading arguments and printing."""

from __future__ import annotations

import contextlib
import json
import logging
import math
import sys
from collections.abc import Callable, Iterator
from datetime import datetime, timezone
from typing import Any

import click
import redis
from click.core import ParameterSource

from taskrunner import logs
from taskrunner.client import steps
from taskrunner.client.app import TaskRunner
from taskrunner.client.loader import load_app
from taskrunner.errors import (
    AppNotFound,
    BadURL,
    Misconfigured,
    NameInUse,
    TaskRunnerError,
    Unreachable,
)
from taskrunner.ops.diagnose import explain
from taskrunner.protocol import codec

APP_HELP = "Module with your TaskRunner (module or module:attr). Env: TASKRUNNER_APP."


URL_HELP = ("redis://host:port/db, rediss://..., unix:///path, redis+sentinel://host[:port][,host...]/service[/db], "
            "redis+cluster://host[:port][,host...]. Env: REDIS_URL.")


class Finite(click.FloatRange):
    """click's FloatRange, less NaN and the infinities: it takes them (NaN compares false
    with either bound), and `wait --timeout nan` waited forever, `--max-memory-per-child nan`
    never replaced a child."""

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        number = super().convert(value, param, ctx)
        if not math.isfinite(number):
            self.fail(f"{value!r} is not a finite number.", param, ctx)
        return number


def or_before(ctx: click.Context, param: click.Parameter, value: Any) -> Any:
    """-A and --redis-url may come before the command too (`taskrunner --redis-url U
    jobs`): given after it they win, else the value given before it, else the environment's."""
    if ctx.get_parameter_source(param.name or "") is ParameterSource.COMMANDLINE:
        return value
    before = ctx.find_root().params.get(param.name or "")
    return before if before is not None else value


def common(f: Callable) -> Callable:
    f = click.option("-A", "--app", "app_spec", envvar="TASKRUNNER_APP", metavar="APP", callback=or_before,
                     help=APP_HELP)(f)
    f = click.option("--redis-url", envvar="REDIS_URL", metavar="URL", callback=or_before, help=URL_HELP)(f)
    return f


def app_from(app_spec: str | None, redis_url: str | None, check: bool = False) -> TaskRunner:
    """The app; with `check`, for processes that run until stopped, Redis is tried once
    first: a mistake in its configuration stops them here (exit 2), an outage they wait out."""
    app = load_app(app_spec, redis_url)
    click.get_current_context().meta["taskrunner.url"] = app.settings.redis_url
    if check:
        try:
            app.redis.ping()
        except (redis.RedisError, redis.exceptions.RedisClusterException) as e:
            problem = explain(e, app.settings.redis_url)
            if problem is None or problem.lasting:
                raise
            logging.getLogger("taskrunner").warning("%s; waiting for it", problem.message)  # in its --log-format
    return app


def json_arg(value: str | None, kind: type, what: str) -> Any:
    if value is None:
        return kind()
    try:
        parsed = json.loads(value)
    except (ValueError, RecursionError) as e:
        raise click.BadParameter(f"not valid JSON ({e}): {value[:80]!r}", param_hint=what) from None
    if not isinstance(parsed, kind):
        raise click.BadParameter(f"must be a JSON {'array' if kind is list else 'object'}", param_hint=what)
    return parsed


def timestamp(t: Any) -> str:
    if not t:
        return "-"
    try:
        return datetime.fromtimestamp(float(t), timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")
    except (TypeError, ValueError, OverflowError, OSError):
        return str(t)  # a corrupt record, shown as it is


def column_width(least: int, values: list[str]) -> int:
    """A table column as wide as its widest value: ids (a cron tick's, one given with --id)
    and queue names may be longer than the usual, and must not push the next columns."""
    return max([least, *map(len, values)])


def emit_json(obj: Any) -> None:
    click.echo(json.dumps(obj, indent=2, default=str))


def known_queues(app: TaskRunner, *queues: str) -> None:
    """Commands that read or change a named queue refuse a name no queue has: a typo
    must not look like an empty queue ("0 pending jobs deleted")."""
    from taskrunner.ops import queue

    for name in queues:
        queue.must_exist(app, name)


@contextlib.contextmanager
def progress_bar(length: int, label: str) -> Iterator[Callable[[int], Any] | None]:
    """A progress bar on stderr for a person at a terminal; elsewhere (a pipe, a log) none:
    click wrote its label alone there, a line before whatever came next (an error's)."""
    if not sys.stderr.isatty():
        yield None
        return
    with click.progressbar(length=length, label=label, file=sys.stderr) as bar:
        yield bar.update


def confirm_or_stop(question: str, yes: bool) -> None:
    """Ask before deleting. Where nobody can answer (stdin is not a terminal: a pipe, a
    script, cron) only --yes goes on: `echo n | taskrunner purge` must not delete."""
    if yes:
        return
    if not sys.stdin.isatty():
        raise click.UsageError(f"{question} Not asked, as stdin is not a terminal: add --yes to go on")
    click.confirm(question, abort=True)


#: The exit codes every command keeps to (README, CLI: *Exit codes*): a script tells a
#: refusal from a mistake in its own command line from a Redis it could not reach.
EXIT_REFUSED = 1  # ran, and the answer is no: no such job, a state that refuses the action, a job that failed


EXIT_USAGE = 2  # a mistake in what the command was given (click's usage errors too); nothing done


EXIT_UNREACHABLE = 3  # Redis could not be reached: what was done is unknown, try again


#: `wait --timeout` ran out, `consume` found no job: 2, as documented before the scheme (scripts test it).
EXIT_NOT_YET = EXIT_USAGE


class Main(click.Group):
    """Turns taskrunner and Redis errors into one clear line: exit 2 for a mistake in what
    the command was given (a value taskrunner refuses: an invalid name, a negative delay,
    arguments that are not JSON or too large; a bad URL, wrong database, TLS or Sentinel
    mismatch, refused password, an app that cannot be imported), 3 for a Redis that could
    not be reached (down, restarting, failing over), 1 for the rest (no such job or queue,
    a full or closed queue, an error Redis answered with, ...)."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except KeyboardInterrupt:  # Ctrl-C: 130, as a shell says it (click's Abort exited 1, a refusal)
            click.echo("interrupted", err=True)
            raise click.exceptions.Exit(130) from None
        except UnicodeError as e:  # a ValueError, but from what Redis holds (bytes that are not UTF-8)
            raise click.ClickException(str(e)) from None
        except (BadURL, AppNotFound, NameInUse, ValueError, TypeError) as e:
            raise Misconfigured(str(e)) from None
        except TaskRunnerError as e:
            raise click.ClickException(str(e)) from None
        except (redis.RedisError, redis.exceptions.RedisClusterException) as e:
            problem = explain(e, ctx.meta.get("taskrunner.url"))
            if problem is None:
                raise click.ClickException(f"Redis answered with an error: {e}") from None
            raise (Misconfigured if problem.lasting else Unreachable)(problem.message) from None


@click.group(cls=Main, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="taskrunner")
@click.option("-A", "--app", "app_spec", metavar="APP", help=APP_HELP + " Also after the command.")
@click.option("--redis-url", metavar="URL", help=URL_HELP + " Also after the command.")
def main(app_spec: str | None, redis_url: str | None) -> None:
    """taskrunner: reliable jobs on Redis, run in child processes, watched by a dispatcher.

    \b
    Run the whole stack locally with a demo:   taskrunner up --demo
    Run a worker for your app:                  taskrunner worker -A myapp -c 4
    Enqueue and wait from the shell:            id=$(taskrunner enqueue myapp.add --args '[1,2]')
                                                taskrunner wait $id

    Exit codes: 0 done; 1 refused or failed (no such job, a state that refuses the action,
    `wait`: the job failed); 2 a mistake in the arguments, the Redis URL or the app (and
    `wait --timeout` ran out, `consume` found no job); 3 Redis unreachable: try again; 130
    interrupted (Ctrl-C).
    """


def undeclared_tasks(app: TaskRunner, app_spec: str | None, tasks: list[str]) -> list[str]:
    """With -A, a task the app does not declare is an error (exit 2): it could only fail
    later, NotRegistered. Without, the tasks' declarations come from the workers: returns
    the names none declared, which are enqueued all the same (producers may be deployed
    first), then warned about."""
    for task in tasks:
        codec.check_name("task", task)
        if app_spec and task not in app.tasks:
            click.echo(f"Error: task {task!r} is not declared by app {app_spec} (its tasks: "
                       f"{', '.join(sorted(app.tasks)) or 'none'})", err=True)
            sys.exit(EXIT_USAGE)
    return [] if app_spec else [t for t in dict.fromkeys(tasks)
                                if steps.ride(app, steps.declared(app, t), f"enqueueing {t}") is None]


def warn_undeclared(task: str, queues: list[str], done: str = "enqueued into") -> None:
    click.echo(f"warning: no worker has declared task {task!r} (a typo, or none of its workers started yet): "
               f"{done} {', '.join(sorted(set(queues)))} with default settings", err=True)


def bound_text(s: dict[str, Any]) -> str:
    """A queue's bound as `queues` shows it: of a sharded queue (its total row) also what each
    shard enforces, ⌈B/N⌉, and so the most it holds, N × ⌈B/N⌉ (10 over 3 shards: 12)."""
    each = s.get("bound_each")
    if not each or s["shards"] < 2:
        return f"bound={s['bound']}"
    return f"bound={s['bound']} ({each} per shard: at most {each * s['shards']})"


LOG_LEVELS = click.Choice(["debug", "info", "warning", "error"], case_sensitive=False)


def log_options(f: Callable) -> Callable:
    """--log-level and --log-format, for the commands that run until stopped."""
    f = click.option("--log-format", type=click.Choice(logs.FORMATS), default="text", show_default=True,
                     envvar="TASKRUNNER_LOG_FORMAT", help=logs.FORMAT_HELP)(f)
    return click.option("--log-level", type=LOG_LEVELS, default="info", show_default=True,
                        help="The least severe records written.")(f)
