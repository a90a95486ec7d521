"""The dashboard's pages and looks (issue 21): "Enqueue now" for a delayed job (atomic in
requeue.lua), the queue page's tabs with counts, rate limit and shards, the job page's
fields in order with units, confirmations that name the job, charts in readable units,
the overview's tabs with counts and the workflow graph's colour classes. Real Redis; the
job page's times from a real worker."""

from __future__ import annotations

import html
import re
import time

import pytest

from dashboard import create_app, duration
from dashboard.charts import bars, columns, count, nice, per, percent, seconds
from taskrunner.ops import queue
from taskrunner.protocol import codec, scripts
from tests import apps
from tests.test_dashboard import login
from tests.test_scripts import claim

API = {"Authorization": "Bearer tok"}


@pytest.fixture
def web(app):
    return create_app(app, password="pw", token="tok").test_client()


def text(web, path: str) -> str:
    r = web.get(path)
    assert r.status_code == 200, (path, r.status_code)
    return r.get_data(as_text=True)


def pending_ids(app, name: str = "default") -> list[str]:
    return app.redis.lrange(app.keys.q(name) + "pending", 0, -1)


# -- Enqueue now -----------------------------------------------------------------------


def test_enqueue_now_from_the_job_page_and_the_queue_page(app, web):
    job = apps.add.apply_async([1, 2], delay=3600)
    other = apps.add.apply_async([3, 4], delay=3600)
    token = login(web)
    page = text(web, f"/jobs/{job.id}")
    assert 'data-action="enqueue-now"' in page and 'data-action="requeue"' not in page  # requeue: running only
    assert 'data-action="enqueue-now"' in text(web, "/queues/default?state=delayed")
    r = web.post(f"/jobs/{job.id}/enqueue-now", data={"csrf_token": token, "next": "/queues/default?state=delayed"})
    assert r.status_code == 302 and r.headers["Location"] == "/queues/default?state=delayed"
    assert job.state == "pending" and pending_ids(app) == [job.id] and other.state == "delayed"
    assert app.redis.zscore(app.keys.q("default") + "delayed", job.id) is None
    assert "due_at" not in job.refresh().data
    assert f"{job.id}: enqueued now: next in line" in text(web, "/queues/default?state=delayed")
    audit = app.redis.lrange(app.keys.g + "audit", 0, -1)
    assert any(f'"what":"enqueue-now {job.id} (default)"' in a and '"done":true' in a for a in audit)
    events = [e["event"] for e in job.refresh().to_dict()["timeline"]]
    assert any(e.startswith("enqueued now by admin") for e in events) and not any("requeued" in e for e in events)
    assert "enqueued now by admin" in text(web, f"/jobs/{job.id}")
    # Again: it is pending now, so it is refused with the reason, and not put in line twice.
    r = web.post(f"/jobs/{job.id}/enqueue-now", data={"csrf_token": token})
    assert r.status_code == 302 and r.headers["Location"] == f"/jobs/{job.id}"
    assert "it is pending, not delayed: only a delayed job can be enqueued now" in text(web, f"/jobs/{job.id}")
    assert pending_ids(app) == [job.id]
    assert 'data-action="enqueue-now"' not in text(web, f"/jobs/{job.id}")


def test_enqueue_now_refusals(app, web):
    job = apps.add.apply_async([1, 2], delay=3600)
    assert web.post(f"/jobs/{job.id}/enqueue-now", data={"csrf_token": "x"}).status_code == 401  # not logged in
    assert web.get(f"/jobs/{job.id}/enqueue-now").status_code == 405  # never by a link
    token = login(web)
    assert web.post(f"/jobs/{job.id}/enqueue-now").status_code == 403  # no CSRF token
    assert web.post("/jobs/nosuchjob/enqueue-now", data={"csrf_token": token}).status_code == 404
    assert web.post("/api/jobs/nosuchjob/enqueue-now", headers=API).status_code == 404
    assert web.post(f"/api/jobs/{job.id}/enqueue-now").status_code == 401  # a session is no API credential
    assert web.post(f"/api/jobs/{job.id}/enqueue-now", headers={"Authorization": "Bearer nope"}).status_code == 401
    assert job.state == "delayed" and pending_ids(app) == []
    done = apps.add.delay(5, 6)
    claim(app)
    for state in ("running",):
        r = web.post(f"/api/jobs/{done.id}/enqueue-now", headers=API)
        assert r.status_code == 409 and r.get_json() == {
            "id": done.id, "action": "enqueue-now", "done": False,
            "message": f"it is {state}, not delayed: only a delayed job can be enqueued now"}
    assert done.state == "running" and done.refresh().data.get("requeues") is None  # its run was not cut short


def test_enqueue_now_through_the_api(app, web):
    job = apps.add.apply_async([1, 2], delay=3600, priority=5)
    r = web.post(f"/api/jobs/{job.id}/enqueue-now", headers=API)
    assert r.status_code == 200 and r.get_json() == {"id": job.id, "action": "enqueue-now", "done": True,
                                                     "message": "enqueued now: next in line"}
    assert job.state == "pending"
    assert app.redis.lrange(app.keys.q("default") + "pending:5", 0, -1) == [job.id]  # its priority's list
    r = web.post(f"/api/jobs/{job.id}/enqueue-now", headers=API)
    assert r.status_code == 409 and "it is pending, not delayed" in r.get_json()["message"]


def test_enqueue_now_and_the_dispatchers_promotion_never_enqueue_twice(app):
    """Either order of "Enqueue now" and the dispatcher's promotion of the due job (sweep.lua)
    leaves it in line once; a claim in between leaves its run alone."""
    p = app.keys.q("default")
    sweep = [1000, 100, 3600, 86400]
    first = apps.add.apply_async([1, 2], delay=0.01)
    time.sleep(0.05)  # due: the next sweep promotes it
    scripts.SWEEP(app.redis, [p], sweep)
    assert first.state == "pending"
    assert first.enqueue_now("op") == "pending"
    assert pending_ids(app) == [first.id]
    second = apps.add.apply_async([3, 4], delay=0.01)
    assert second.enqueue_now("op") == "delayed"
    time.sleep(0.05)
    scripts.SWEEP(app.redis, [p], sweep)  # nothing left to promote
    assert sorted(pending_ids(app)) == sorted([first.id, second.id])  # each once
    claim(app, pids=(1, 2))
    assert second.enqueue_now("op") == "running" and second.state == "running"
    assert app.redis.hexists(p + "running", second.id)


def test_requeue_script_refuses_a_bad_state_list(app):
    job = apps.add.apply_async([1, 2], delay=3600)
    with pytest.raises(Exception, match=r"requeue: ARGV\[3\] lists the states it may requeue"):
        scripts.REQUEUE(app.redis, [app.keys.q("default")], [job.id, "op", "delayed pending"])
    assert job.state == "delayed"
    for empty in ("", "  "):  # no state: it would requeue nothing, silently
        with pytest.raises(Exception, match=r"requeue: ARGV\[3\] lists no state"):
            scripts.REQUEUE(app.redis, [app.keys.q("default")], [job.id, "op", empty])
    assert scripts.REQUEUE(app.redis, [app.keys.q("default")], ["nosuch", "op", "delayed"]) == ""
    assert job.requeue("op") and job.state == "pending"  # without the list: delayed or running, as before


def test_the_timeline_words_each_operators_requeue_by_what_it_did(app, web):
    """A delayed job made pending is "enqueued now by <who>" (the dashboard's Enqueue now, or
    Job.requeue of a delayed job), a running one sent back in line "requeued by <who>"; an
    event recorded before (a delayed job's "requeued by") reads as it was written."""
    later = apps.add.apply_async([1, 2], delay=3600)
    assert later.requeue("op") and later.state == "pending"
    [(_, running_id, *_)] = claim(app)
    assert running_id == later.id and later.requeue("ops2")
    events = [e["event"] for e in later.refresh().to_dict()["timeline"]]
    by = [e for e in events if " by " in e]
    assert by[0] == "enqueued now by op" and sorted(by[1:]) == ["delivery 1 requeued by ops2", "requeued by ops2"]
    old = apps.add.apply_async([3, 4], delay=3600)
    app.redis.hset(app.keys.job("default", old.id), "action:1700000000.5", "requeued by admin")
    assert "requeued by admin" in text(web, f"/jobs/{old.id}")


# -- The queue page ---------------------------------------------------------------------


def test_queue_page_tabs_show_each_states_count(app, web):
    for i in range(3):
        apps.add.delay(i, i)
    apps.add.apply_async([1, 1], delay=3600)
    claim(app)  # one runs now: 2 stay pending
    page = text(web, "/queues/default")
    tabs = dict(re.findall(r'data-state="(\w+)">\w+<span class="n[^"]*">(\d+)</span>', page))
    assert tabs == {"pending": "2", "waiting": "0", "delayed": "1", "completed": "0", "failed": "0", "killed": "0",
                    "canceled": "0", "running": "1"}
    assert 'aria-current="page" data-state="pending"' in page


def test_queue_page_shows_the_rate_limit_its_use_and_shards(app, web):
    queue.create(app, "paced", rate="120/m", shards=2)
    for i in range(6):
        apps.add.apply_async([i, i], queue="paced")
    page = text(web, "/queues/paced")
    assert "120/m" in page and "Each of its 2 shards takes 60/m" in page and "Next start allowed now" in page
    rows = dict(re.findall(r'<tr data-shard="([^"]+)"><td class="nowrap">\d+ <span class="muted">[^<]+</span></td>'
                           r'<td class="n">(\d+)</td>', page))
    assert set(rows) == {"paced", "paced~1"} and sum(map(int, rows.values())) == 6
    for shard in ("paced", "paced~1"):
        assert int(rows[shard]) == app.redis.llen(app.keys.q(shard) + "pending")
    claim(app, ("paced", "paced~1"), pids=(1, 2))  # one start per shard: the limit spent for a second
    page = text(web, "/queues/paced")
    assert re.search(r'data-rate-used>2</span> of 120/m started this minute', page), page
    assert re.search(r"Next start allowed in \d+(\.\d)? (ms|s)\.", page), page
    apps.add.delay(1, 2)
    unlimited = text(web, "/queues/default")
    assert "None: its jobs start as fast as workers claim them" in unlimited and "(not sharded)" in unlimited


def test_queue_page_pause_and_resume_buttons_say_the_state(app, web):
    apps.add.delay(1, 2)
    page = text(web, "/queues/default")
    assert "Running: workers claim its jobs" in page and 'data-action="pause"' not in page  # not logged in
    token = login(web)
    assert '<button data-action="pause"' in text(web, "/queues/default")
    assert web.post("/queues/default/pause", data={"csrf_token": token}).status_code == 302
    page = text(web, "/queues/default")
    assert "Paused: workers claim none of its jobs" in page and '<button data-action="resume"' in page
    assert web.post("/queues/default/resume", data={"csrf_token": token}).status_code == 302
    assert not queue.info(app, "default")["paused"]
    assert web.post("/queues/nosuch/pause", data={"csrf_token": token}).status_code == 404
    assert web.post("/queues/default/explode", data={"csrf_token": token}).status_code == 404


# -- The job page -----------------------------------------------------------------------


def test_job_page_fields_in_order_with_units_and_claim_explained(app, stack, web):
    stack.worker(concurrency=1)
    job = apps.add.apply_async([2, 3], max_duration=90)
    assert job.wait(30) == 5
    d = job.refresh().to_dict()
    assert d["claimed_at"] <= d["started_at"] <= d["finished_at"]
    page = text(web, f"/jobs/{job.id}")
    order = [page.index(f'data-field="{k}"') for k in ("enqueued_at", "claimed_at", "started_at", "finished_at",
                                                     "waited", "ran", "max_duration", "attempts")]
    assert order == sorted(order), order
    # How the job's max_duration setting (90 s) is written, not a time measured:
    assert re.search(r'data-field="max_duration"><th><abbr [^>]+>max duration</abbr></th><td>1\.5 min|'
                     r'data-field="max_duration"><th><abbr [^>]+>max duration</abbr></th><td>2 min', page)
    assert re.search(r'data-field="ran">.*?<td>\d+(\.\d+)? (µs|ms|s)</td>', page)
    assert "e-0" not in page
    assert html.escape("when a worker took it from the queue") in page
    assert "<b>claimed</b>: a worker took it from the queue. <b>started</b>: its child process began" in page
    assert "delivery 1 claimed" in page


def test_job_page_while_it_runs_says_when_started_is_known(app, web):
    job = apps.add.delay(1, 2)
    claim(app)
    page = text(web, f"/jobs/{job.id}")
    assert "known when this delivery ends" in page and 'data-field="running_for"' in page
    assert web.get(f"/api/jobs/{job.id}").get_json()["claimed_at"] > 0


def test_confirmations_name_the_job_and_its_task(app, web):
    job = apps.add.apply_async([1, 2], delay=3600)
    login(web)
    short = job.id[:8] + "…" if len(job.id) > 12 else job.id
    page = html.unescape(text(web, f"/jobs/{job.id}"))
    assert f'data-confirm="Kill job {short} (tests.apps.add)? It ends killed; if it runs, it is stopped."' in page
    assert f'data-confirm="Delete job {short} (tests.apps.add)? Its record goes: this cannot be undone."' in page
    queue_page = html.unescape(text(web, "/queues/default?state=delayed"))
    assert f"Kill job {short} (tests.apps.add)?" in queue_page


def test_a_hostile_task_name_in_a_confirmation_is_escaped(app, web):
    x = "\"'><script>x()</script>"
    apps.add.delay(1, 2)  # the queue exists
    p = app.keys.q("default")
    app.redis.hset(p + "job:evil", mapping={"task": x, "state": "delayed", "args": "[]", "kwargs": "{}",
                                            "due_at": time.time() + 60, "enqueued_at": time.time()})
    app.redis.zadd(p + "delayed", {"evil": time.time() + 60})
    login(web)
    for path in ("/jobs/evil", "/queues/default?state=delayed"):
        page = text(web, path)
        assert "<script>x()" not in page and "&#34;&#39;&gt;&lt;script&gt;x()&lt;/script&gt;" in page, path


# -- Charts, units, overview, workflow ---------------------------------------------------


def test_units_read_as_people_write_them():
    assert [seconds(v) for v in (0, 2.9e-05, 0.0042, 0.5, 2.5, 12.34, 90, 720, 11200, 190080)] == [
        "0 s", "29 µs", "4.2 ms", "500 ms", "2.5 s", "12.3 s", "1.5 min", "12 min", "3.11 h", "2.2 d"]
    assert [count(v) for v in (7, 1250, 12500, 3.4e6)] == ["7", "1,250", "12.5k", "3.4M"]
    assert per("h")(1200) == "1,200/h" and percent(0.5) == "0.5%"
    assert [nice(v) for v in (0, 0.9, 7, 12, 99, 3e-5)] == [1, 1, 10, 20, 100, 5e-5]
    assert [duration(v) for v in (2.9e-05, 0.25, 5, 42, 600)] == ["29 µs", "250 ms", "5.0 s", "42 s", "10 min"]
    assert [duration(v) for v in (75, 3000)] == ["1.2 min", "50 min"]
    assert [duration(v) for v in (None, "", 0)] == ["-", "-", "0 s"]  # none is not zero


def test_charts_write_units_and_escape_labels():
    svg = bars([("<b>t</b>", [2.9e-05, 0.004, None])], ["p50", "p95", "p99"], "Runtime", seconds)
    assert "29 µs" in svg and "4 ms" in svg and "e-05" not in svg and "&lt;b&gt;t&lt;/b&gt;" in svg and "<b>" not in svg
    assert 'class="s0"' in svg and "fill=" not in svg  # colours from the stylesheet (dark mode)
    svg = columns([("01 00h", 1200.0), ("01 01h", 30.0)], "Throughput", per("h"), axis="jobs finished")
    assert "1,200/h" in svg and "2,000/h" in svg and "1,000/h" in svg and "jobs finished" in svg


def publish_summary(app, tasks: tuple[str, ...] = ("shop.reindex",), hours: int = 1) -> None:
    """An analysis as `taskrunner analyze` publishes it (without Spark): runtimes from 29 µs
    to 1.5 s, waits from 300 µs to 75 s, 30 jobs an hour more each hour."""
    row = {"count": 3, "completed": 2, "failed": 1, "killed": 0, "requeued": 0, "canceled": 0,
           "completed_rate": 2 / 3, "failed_rate": 1 / 3, "killed_rate": 0.0, "requeued_rate": 0.0,
           "canceled_rate": 0.0, "runtime_p50": 2.9e-05, "runtime_p95": 0.0042, "runtime_p99": 1.5,
           "wait_p50": 0.0003, "wait_p95": 75.0, "top_errors": [{"error_type": "ValueError", "count": 1}]}
    app.redis.set(app.keys.g + "history:summary", codec.dumps({
        "records": 3 * len(tasks), "since": 3600 * hours, "generated_at": time.time(), "seconds": 1,
        "history_dir": "/var/history",
        "tasks": [{**row, "task": t, "runtime_p99": 1.5 * (i + 1)} for i, t in enumerate(tasks)],
        "queues": [{**row, "queue": "default"}], "workers": [{**row, "host": "h1"}],
        "hours": [{**row, "hour": f"2026-11-26T{h:02d}", "count": 3 + 30 * h} for h in range(hours)]}))


def test_history_page_charts_in_readable_units(app, web):
    publish_summary(app)
    page = text(web, "/history")
    assert "e-05" not in page and "e-04" not in page
    for shown in ("29 µs", "4.2 ms", "1.5 s", "300 µs", "1.2 min", "33.3%", "3/h", "jobs finished (UTC hour)"):
        assert shown in page, shown


def test_overview_tabs_count_each_state(app, web):
    apps.add.delay(1, 2)
    apps.add.apply_async([1, 2], delay=3600)
    queue.create(app, "other")
    apps.add.apply_async([1, 2], queue="other")
    page = text(web, "/")
    tabs = dict(re.findall(r'data-tab="(\w+)"[^>]*>\w+<span class="n[^"]*">(\d+)</span>', page))
    assert tabs == {"pending": "2", "running": "0", "stuck": "0", "delayed": "1", "failed": "0", "killed": "0",
                    "workers": "0"}
    fragment = text(web, "/?fragment=1")  # live.js refreshes the tabs with the tables
    assert tabs == dict(re.findall(r'data-tab="(\w+)"[^>]*>\w+<span class="n[^"]*">(\d+)</span>', fragment))


def test_workflow_graph_takes_its_colours_from_the_page(app, web):
    from taskrunner.ops.workflow import COLOURS, graph, svg

    first = apps.add.delay(1, 2)
    d = svg(graph(app, first.id))
    assert 'class="pending root"' in d and 'class="state state-pending"' in d
    assert f'fill="{COLOURS["pending"]}"' in d  # on its own, without the stylesheet
    css = web.get("/static/style.css").get_data(as_text=True)
    assert "@media (prefers-color-scheme: dark)" in css and "svg.workflow rect.pending" in css
    assert "svg.workflow text { fill: var(--fg); }" in css


def test_every_colour_of_the_stylesheet_is_a_variable_dark_mode_sets(web):
    """A colour written outside the variables would stay light in dark mode; each variable
    has its dark value."""
    css = web.get("/static/style.css").get_data(as_text=True)
    light, dark, rest = css.split("@media (prefers-color-scheme: dark)", 1)[0], css.split(
        "@media (prefers-color-scheme: dark)", 1)[1].split("\n}\n", 1)[0], css.split(
        "@media (prefers-color-scheme: dark)", 1)[1].split("\n}\n", 1)[1]
    names = set(re.findall(r"(--[\w-]+):", light))
    assert names and names == set(re.findall(r"(--[\w-]+):", dark))
    body = light.split("}", 1)[1] + rest
    # Only the header, dark in both schemes, writes white text.
    assert set(re.findall(r"#[0-9a-fA-F]{3,6}\b", body)) <= {"#fff", "#8fb0ff"}


def test_the_tasks_page_gives_durations_in_units_and_a_running_job_runs_on_its_worker(app, web):
    """Found using the pages: the Tasks page gave a max duration of 300 s as "300.0 s" (the
    job page: "5.0 min"), and a running job's page said it "ran on" its worker."""
    from taskrunner.client import declarations
    from tests.test_scripts import finish

    declarations.publish(app, ["default"], "w-decl", time.time())
    page = text(web, "/tasks")
    assert "<td>5.0 min</td>" in page and "300.0 s" not in page and "<td>1.0 s</td>" in page
    job = apps.add.delay(1, 2)
    claim(app, worker="w-runs")
    assert "<th>runs on</th>" in text(web, f"/jobs/{job.id}")
    assert finish(app, job.id, "1", "completed", "3") == 1
    assert "<th>ran on</th>" in text(web, f"/jobs/{job.id}")
