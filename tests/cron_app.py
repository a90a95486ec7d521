"""A separate app for schedule tests, so other tests' dispatchers fire nothing."""

from __future__ import annotations

from taskrunner import TaskRunner, current_job

app = TaskRunner("cron")


@app.periodic("* * * * * *", queue="cron")  # every second (croniter's sixth field)
def every_second() -> None:
    """Counts its runs per tick, the tick read from its job id (cron.<schedule>.<tick>): a
    count per second of the clock counted two ticks' jobs as one tick's twice when a late
    job ran in the next one's second."""
    tick = current_job().id.rsplit(".", 1)[1]
    app.redis.incr(f"{app.settings.prefix}:ledger:cron:{tick}")
