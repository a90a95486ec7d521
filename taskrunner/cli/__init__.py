"""The `taskrunner` command. Every command takes --redis-url (default $REDIS_URL, else
the socket of a running `taskrunner up`, else localhost:6379) and -A/--app (default
$TASKRUNNER_APP): a module holding one TaskRunner, or module:attribute.

One module per concern; importing each registers its commands on `main` (base.py)."""

# Importing each registers its commands on `main`.
from taskrunner.cli import consume, history, jobs, processes, queues, schedules, views  # noqa: F401
from taskrunner.cli.base import main

__all__ = ["main"]
