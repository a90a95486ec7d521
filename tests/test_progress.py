"""Job progress and log lines: reported by a running task through current_job(), batched
by the worker into its syncs (progress.lua), shown by `status --json`, and capped."""

from __future__ import annotations

import json

import pytest

from taskrunner import TaskRunner
from taskrunner.protocol import scripts
from taskrunner.worker.context import LOG_LINES
from tests.conftest import wait_for


def release(app, key: str) -> None:
    app.redis.set(f"{app.settings.prefix}:release:{key}", 1)


def status(stack, job_id: str) -> dict:
    return json.loads(stack.cli("status", job_id, "--json", check=True).stdout)


def test_progress_and_logs_are_visible_while_the_job_runs_and_stay_after(app, stack):
    job = app.tasks["tests.apps.chatty"].delay("c1", 3)
    stack.worker()
    d = wait_for(lambda: (s := status(stack, job.id))["state"] == "running" and len(s["logs"]) == 4 and s,
                 what="the running job's progress and 4 log lines")
    assert d["progress"] == 1.0 and d["progress_note"] == "wrote 3"
    assert [x["line"] for x in d["logs"]] == ["line 1 of 3", "line 2 of 3", "line 3 of 3",
                                              "WARNING tests.chatty: through logging: c1"]
    assert {x["attempt"] for x in d["logs"]} == {1} and all(isinstance(x["t"], float) for x in d["logs"])
    release(app, "c1")
    assert job.wait(30) == 3
    d = status(stack, job.id)
    assert len(d["logs"]) == 4 and d["progress"] == 1.0
    human = stack.cli("status", job.id, check=True).stdout
    assert "progress  100%  wrote 3" in human and "line 2 of 3" in human


def test_logs_keep_the_last_lines_and_count_those_dropped(app, stack):
    job = app.tasks["tests.apps.chatty"].delay("c2", LOG_LINES + 30)
    release(app, "c2")
    stack.worker()
    assert job.wait(30) == LOG_LINES + 30
    d = status(stack, job.id)
    assert len(d["logs"]) == LOG_LINES and d["logs_dropped"] == 31  # 130 lines and the logging one
    assert d["logs"][0]["line"] == "line 32 of 130"


def test_progress_script_is_fenced_and_refuses_bad_values(app):
    job = app.tasks["tests.apps.add"].delay(1, 2)
    p = app.keys.q("default")
    r = app.redis
    # Claimed by hand: attempt 1 holds the job.
    r.hset(p + "running", job.id, "{}")
    r.hset(app.keys.job("default", job.id), mapping={"attempts": "1", "state": "running"})
    line = b'[1.5,1,"hello"]'
    assert scripts.PROGRESS(r, [p], [LOG_LINES, job.id, "2", "0.5", "", line, 0]) == [0]  # not its delivery
    assert scripts.PROGRESS(r, [p], [LOG_LINES, job.id, "1", "0.5", "half", line, 0]) == [1]
    rec = r.hgetall(app.keys.job("default", job.id))
    assert rec["progress"] == "0.5" and rec["progress_note"] == "half" and rec["logs"] == line.decode()
    for bad in (["1.5", "", line, 0], ["", "", b"not json", 0], ["", "", line, -1], ["0.1", ""]):
        with pytest.raises(ValueError):
            scripts.PROGRESS(r, [p], [LOG_LINES, job.id, "1", *bad])
    r.hdel(p + "running", job.id)
    assert scripts.PROGRESS(r, [p], [LOG_LINES, job.id, "1", "0.9", "", "", 0]) == [2]  # no longer running
    assert r.hget(app.keys.job("default", job.id), "progress") == "0.5"


def test_eager_mode_records_progress_and_logs():
    app = TaskRunner("eager-progress", eager=True)

    @app.task(name="work")
    def work(n: int) -> int:
        from taskrunner import current_job

        for i in range(n):
            current_job().log("step %d", i)
        current_job().progress(0.25, "a quarter")
        return n

    d = work.delay(LOG_LINES + 2).to_dict()
    assert d["progress"] == 0.25 and d["progress_note"] == "a quarter"
    assert len(d["logs"]) == LOG_LINES and d["logs_dropped"] == 2 and d["logs"][-1]["line"] == f"step {LOG_LINES + 1}"


def test_job_page_shows_progress_and_logs_escaped_and_refreshes_while_running(app, stack):
    from dashboard import create_app

    web = create_app(app, password="pw", token="tok").test_client()
    job = app.tasks["tests.apps.chatty"].delay("<script>alert(1)</script>", 2)
    stack.worker()
    wait_for(lambda: len(status(stack, job.id)["logs"]) == 3, what="3 log lines")
    page = web.get(f"/jobs/{job.id}").get_data(as_text=True)
    assert f'data-live="/jobs/{job.id}?fragment=1"' in page
    frag = web.get(f"/jobs/{job.id}?fragment=1").get_data(as_text=True)
    assert '<progress max="1" value="1.0">' in frag and "wrote 2" in frag and "line 2 of 2" in frag
    assert "<script>alert(1)</script>" not in frag and "&lt;script&gt;alert(1)&lt;/script&gt;" in frag
    assert "<html" not in frag  # a fragment, for live.js
    api = web.get(f"/api/jobs/{job.id}").get_json()
    assert api["progress"] == 1.0 and len(api["logs"]) == 3
    release(app, "<script>alert(1)</script>")
    job.wait(30)
    assert "data-live" not in web.get(f"/jobs/{job.id}").get_data(as_text=True)
