"""A separate app for schedule tests, so other tests' dispatchers fire nothing."""

from __future__ import annotations

import time

from taskrunner import TaskRunner

app = TaskRunner("cron")


@app.periodic("* * * * * *", queue="cron")  # every second (croniter's sixth field)
def every_second() -> None:
    app.redis.incr(f"{app.settings.prefix}:ledger:cron:{int(time.time())}")
