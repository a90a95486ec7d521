"""The dashboard through Flask's test client, on a real Redis (and real workers where a
page shows them): every page and endpoint, actions, pagination. Attacks on it (escaping,
CSRF, brute force, headers, binding) are in test_security.py."""

from __future__ import annotations

import json
import logging
import os
import re
import signal

import pytest

from dashboard import create_app
from taskrunner.errors import QueueClosed
from taskrunner.ops import queue
from taskrunner.ops.listing import DISPATCHER_FORGET, DISPATCHER_GONE
from tests import apps
from tests.conftest import wait_for


@pytest.fixture
def web(app):
    return create_app(app, password="pw", token="tok").test_client()


def csrf(client, path="/login") -> str:
    return re.search(r'name="csrf_token" value="([^"]+)"', client.get(path).get_data(as_text=True)).group(1)


def login(client) -> str:
    token = csrf(client)
    r = client.post("/login", data={"password": "pw", "csrf_token": token, "next": "/running"})
    assert r.status_code == 302 and r.headers["Location"] == "/running"
    return csrf(client, "/running")


def test_every_page_renders(app, stack, web):
    apps.add.delay(1, 2)
    apps.add.apply_async([1, 2], delay=100)
    failed = app.enqueue("tests.apps.boom", ["x"])
    stack.worker("-Q", "nothing", concurrency=1)  # a live worker on another queue
    wait_for(lambda: web.get("/api/workers").get_json(), what="worker heartbeat")
    for path in ["/", "/running", "/stuck", "/failed", "/failed?state=killed", "/queues/default",
                 "/queues/default?state=delayed", "/queues/default?state=completed", "/schedules",
                 f"/jobs/{failed.id}", "/login", "/?fragment=1", "/running?fragment=1", "/stuck?fragment=1"]:
        r = web.get(path)
        assert r.status_code == 200, path
        assert r.headers["Content-Security-Policy"].startswith("default-src 'self'")
    page = web.get("/").get_data(as_text=True)
    assert "default" in page and "alive" in page and "no dispatcher has run" in page


def test_json_api(app, stack, web):
    stack.dispatcher()
    stack.worker(concurrency=1)
    job = apps.hold.delay("api", 30)
    running = wait_for(lambda: web.get("/api/jobs?state=running").get_json(), what="running job")
    [row] = running
    for k in ("id", "task", "queue", "state", "stuck", "host", "ip", "pid", "started_at", "max_duration"):
        assert k in row, k
    assert row["id"] == job.id and row["state"] == "running" and row["stuck"] is False and row["pid"] > 0
    d = web.get(f"/api/jobs/{job.id}").get_json()
    assert d["state"] == "running" and d["timeline"][0]["event"] == "enqueued"
    q = web.get("/api/queues").get_json()
    assert q[0]["name"] == "default" and q[0]["running"] == 1
    w = web.get("/api/workers").get_json()
    assert w[0]["state"] == "alive" and w[0]["busy"] in (0, 1)
    wait_for(lambda: web.get("/api/overview").get_json()["dispatchers"], what="a dispatcher pass")
    assert web.get("/api/schedules").get_json() == []
    assert web.get("/api/jobs?state=pending&queue=default").get_json() == []
    assert web.get("/api/jobs?state=pending").status_code == 400
    assert web.get("/api/jobs/nope").status_code == 404
    assert web.get("/api/jobs?queue=no-such").status_code == 404
    app.redis.set(f"{app.settings.prefix}:release:api", 1)
    job.wait(30)


def test_stuck_page_says_why(app, stack, web):
    stack.worker(concurrency=1)
    job = app.enqueue("tests.apps.hold", ["st", 30], max_duration=0.2, timeout_policy="flag")
    wait_for(lambda: job.refresh().data.get("stuck") == "1", what="stuck")
    page = web.get("/stuck").get_data(as_text=True)
    assert job.id in page and "ran past its max duration" in page
    [row] = web.get("/api/jobs?state=stuck").get_json()
    assert row["stuck"] and row["why"]
    app.redis.set(f"{app.settings.prefix}:release:st", 1)
    job.wait(30)


def test_pagination(app, web):
    jobs = [apps.add.delay(i, 0).id for i in range(120)]
    page1 = web.get("/queues/default").get_data(as_text=True)
    page3 = web.get("/queues/default?page=3").get_data(as_text=True)
    assert jobs[0] in page1 and jobs[49] in page1 and jobs[50] not in page1
    assert jobs[100] in page3 and jobs[119] in page3 and jobs[99] not in page3
    assert "page 1 of 3 (120 jobs)" in page1
    r = web.get("/api/jobs?state=pending&queue=default&page=2")
    assert [j["id"] for j in r.get_json()] == jobs[50:100] and r.headers["X-Total-Count"] == "120"
    assert web.get("/queues/default?page=zero").status_code == 400
    assert web.get("/queues/default?page=0").status_code == 400


def test_actions_need_login_and_csrf(app, web):
    job = apps.add.delay(1, 2)
    assert web.post(f"/jobs/{job.id}/kill").status_code == 401  # not logged in
    token = login(web)
    assert web.post(f"/jobs/{job.id}/kill").status_code == 403  # no CSRF token
    assert web.post(f"/jobs/{job.id}/kill", data={"csrf_token": "forged"}).status_code == 403
    r = web.post(f"/jobs/{job.id}/kill", data={"csrf_token": token}, headers={"Sec-Fetch-Site": "cross-site"})
    assert r.status_code == 403
    r = web.post(f"/jobs/{job.id}/kill", data={"csrf_token": token}, headers={"Origin": "https://evil.example"})
    assert r.status_code == 403
    assert job.state == "pending"
    r = web.post(f"/jobs/{job.id}/kill", data={"csrf_token": token, "next": "//evil.example/x"},
                 headers={"Sec-Fetch-Site": "same-origin"})
    assert r.status_code == 302 and r.headers["Location"] == f"/jobs/{job.id}"
    assert job.state == "killed"
    assert job.refresh().data["killed_by"].startswith("admin@")
    r = web.post(f"/jobs/{job.id}/retry", data={"csrf_token": token})
    assert r.status_code == 302 and job.state == "pending"
    assert any("retried by admin@" in e["event"] for e in job.refresh().to_dict()["timeline"])
    assert web.post(f"/jobs/{job.id}/explode", data={"csrf_token": token}).status_code == 404
    r = web.post("/queues/default/purge", data={"csrf_token": token})
    assert r.status_code == 302 and app.redis.llen(app.keys.q("default") + "pending") == 0
    audit = app.redis.lrange(app.keys.g + "audit", 0, -1)
    assert any('"what":"purge default' in a for a in audit) and any('"what":"kill' in a for a in audit)
    assert web.post("/logout", data={"csrf_token": token}).status_code == 302
    assert web.post(f"/jobs/{job.id}/kill", data={"csrf_token": token}).status_code == 401


def test_retrying_a_canceled_step_names_the_step_to_retry(app, web):
    """A canceled workflow step is not retried; the step whose end canceled it can be, and
    brings it back: the answer said only "only failed or killed jobs can be retried"."""
    handle = (apps.add.s(1, 2) | apps.add.s(1)).delay()
    first = app.job(handle.id).data["parents"].split()[1]
    assert app.job(first).kill() == "killed"
    r = web.post(f"/api/jobs/{handle.id}/retry", headers={"Authorization": "Bearer tok"})
    assert r.status_code == 409 and f"taskrunner retry {first}" in r.get_json()["message"], r.get_json()
    r = web.post(f"/api/jobs/{first}/retry", headers={"Authorization": "Bearer tok"})
    assert r.status_code == 200 and app.job(handle.id).state == "waiting"


def test_a_kill_of_an_ended_job_says_it_had_ended_and_is_audited_as_refused(app, stack, web):
    """The Kill action (page and API) on a job that had already ended says so, 409, and
    audits a refused kill: for a killed job it said "killed" and audited it as done (found by
    the newcomer sweep)."""
    token = login(web)
    jobs = stack.ended_jobs()
    for state, job in jobs.items():
        r = web.post(f"/jobs/{job.id}/kill", data={"csrf_token": token}, follow_redirects=True)
        assert f"{job.id}: already ended: {state}" in r.get_data(as_text=True)
        r = web.post(f"/api/jobs/{job.id}/kill", headers={"Authorization": "Bearer tok"})
        assert (r.status_code, r.get_json()) == (
            409, {"id": job.id, "action": "kill", "done": False, "message": f"already ended: {state}"})
        assert job.refresh().state == state
    audit = [json.loads(a) for a in app.redis.lrange(app.keys.g + "audit", 0, -1)]
    assert sorted((a["what"], a["done"]) for a in audit) == sorted(
        (f"kill {job.id} (default)", False) for job in jobs.values() for _ in ("page", "api"))


def test_api_actions_need_the_bearer_token(app, web):
    job = apps.add.delay(1, 2)
    assert web.post(f"/api/jobs/{job.id}/kill").status_code == 401
    assert web.post(f"/api/jobs/{job.id}/kill", headers={"Authorization": "Bearer nope"}).status_code == 401
    r = web.post(f"/api/jobs/{job.id}/kill", headers={"Authorization": "Bearer tok"})
    assert r.status_code == 200 and r.get_json()["done"] and job.state == "killed"
    r = web.post(f"/api/jobs/{job.id}/requeue", headers={"Authorization": "Bearer tok"})
    assert r.status_code == 409 and not r.get_json()["done"]
    r = web.post(f"/api/jobs/{job.id}/retry", headers={"Authorization": "Bearer tok"})
    assert r.status_code == 200 and job.state == "pending"
    r = web.post("/api/queues/default/purge", headers={"Authorization": "Bearer tok"})
    assert r.get_json() == {"queue": "default", "action": "purge", "deleted": 1, "message": "1 pending jobs deleted"}
    r = web.post("/api/queues/default/close", headers={"Authorization": "Bearer tok"})
    assert r.status_code == 200 and queue.info(app, "default")["closed"]
    r = web.post("/api/queues/default/open", headers={"Authorization": "Bearer tok"})
    assert r.status_code == 200 and not queue.info(app, "default")["closed"]
    assert web.post("/api/queues/default/explode", headers={"Authorization": "Bearer tok"}).status_code == 404


def test_read_only_without_password_or_token(app):
    client = create_app(app, password="", token="").test_client()
    job = apps.add.delay(1, 2)
    assert "read-only" in client.get("/").get_data(as_text=True)
    assert 'data-action="kill"' not in client.get("/queues/default").get_data(as_text=True)
    assert client.get("/login").status_code == 404
    assert client.post(f"/jobs/{job.id}/kill").status_code == 403
    assert client.post(f"/api/jobs/{job.id}/kill", headers={"Authorization": "Bearer x"}).status_code == 403
    assert job.state == "pending"


def test_queue_settings_and_counters_show(app, web):
    queue.create(app, "shown", bound=7, exclusive=True)
    apps.add.apply_async([1, 2], queue="shown")
    queue.close(app, "shown")
    page = web.get("/queues/shown").get_data(as_text=True)
    assert "bound 7" in page and "closed" in page and "exclusive" in page and "produced 1 jobs" in page
    assert "bound 7" in web.get("/").get_data(as_text=True)
    [q] = [q for q in web.get("/api/queues").get_json() if q["name"] == "shown"]
    assert q["bound"] == 7 and q["closed"] and q["exclusive"] and q["produced_messages"] == 1


def test_close_and_open_a_queue_from_its_page(app, web):
    apps.add.delay(1, 2)
    token = login(web)
    page = web.get("/queues/default").get_data(as_text=True)
    assert 'data-action="close"' in page and 'data-action="open"' not in page
    r = web.post("/queues/default/close", data={"csrf_token": token})
    assert r.status_code == 302 and queue.info(app, "default")["closed"]
    with pytest.raises(QueueClosed):
        apps.add.delay(1, 2)
    page = web.get("/queues/default").get_data(as_text=True)
    assert "takes no new jobs" in page and 'data-action="open"' in page
    r = web.post("/queues/default/open", data={"csrf_token": token})
    assert r.status_code == 302 and not queue.info(app, "default")["closed"]
    apps.add.delay(1, 2)
    audit = app.redis.lrange(app.keys.g + "audit", 0, -1)
    assert any('"what":"close default"' in a for a in audit) and any('"what":"open default"' in a for a in audit)
    assert web.post("/queues/default/close").status_code == 403  # no CSRF token


def test_pause_and_resume_a_queue_from_its_page_and_the_api(app, web):
    apps.add.delay(1, 2)
    apps.add.apply_async([1, 2], priority=9)
    token = login(web)
    page = web.get("/queues/default").get_data(as_text=True)
    assert 'data-action="pause"' in page and 'data-action="resume"' not in page and "priorities 9" in page
    assert web.post("/queues/default/pause").status_code == 403  # no CSRF token
    r = web.post("/queues/default/pause", data={"csrf_token": token})
    assert r.status_code == 302 and queue.info(app, "default")["paused"]
    page = web.get("/queues/default").get_data(as_text=True)
    assert "workers claim none of its jobs" in page and 'data-action="resume"' in page
    assert [q for q in web.get("/api/queues").get_json() if q["name"] == "default"][0]["paused"] is True
    assert "paused" in web.get("/").get_data(as_text=True)
    r = web.post("/queues/default/resume", data={"csrf_token": token})
    assert r.status_code == 302 and not queue.info(app, "default")["paused"]
    assert web.post("/api/queues/default/pause").status_code == 401
    r = web.post("/api/queues/default/pause", headers={"Authorization": "Bearer tok"})
    assert r.status_code == 200 and r.get_json()["action"] == "pause" and queue.info(app, "default")["paused"]
    r = web.post("/api/queues/default/resume", headers={"Authorization": "Bearer tok"})
    assert r.status_code == 200 and not queue.info(app, "default")["paused"]
    audit = app.redis.lrange(app.keys.g + "audit", 0, -1)
    assert sum('"what":"pause default"' in a for a in audit) == 2 and any('"what":"resume default"' in a for a in audit)


def test_overview_tells_the_truth(app, stack, web):
    """A dispatcher that stopped cleanly is gone, a dead worker runs nothing, and pending
    jobs that no live worker consumes are pointed out."""
    dispatcher = stack.dispatcher()
    wait_for(lambda: web.get("/api/overview").get_json()["dispatchers"], what="a dispatcher pass")
    dispatcher.send_signal(signal.SIGTERM)
    assert dispatcher.wait(30) == 0
    assert web.get("/api/overview").get_json()["dispatchers"] == []
    assert "no dispatcher has run" in web.get("/").get_data(as_text=True)

    # A SIGKILLed dispatcher never says goodbye. It showed "late" forever; now it is "gone"
    # once silent for DISPATCHER_GONE, and a live dispatcher forgets it after
    # DISPATCHER_FORGET. Its entry is aged by hand (as time would), with one older still.
    killed = stack.dispatcher()
    [d] = wait_for(lambda: web.get("/api/overview").get_json()["dispatchers"], what="a dispatcher pass")
    os.killpg(killed.pid, signal.SIGKILL)
    killed.wait()
    entry = json.loads(app.redis.hget(app.keys.dispatchers, d["name"]))
    entry["last_pass"] -= DISPATCHER_GONE + 1
    app.redis.hset(app.keys.dispatchers, d["name"], json.dumps(entry))
    app.redis.hset(app.keys.dispatchers, "ancient", json.dumps({**entry, "name": "ancient",
                                                               "last_pass": entry["last_pass"] - DISPATCHER_FORGET}))
    shown = web.get("/api/overview").get_json()["dispatchers"]
    assert [x["health"] for x in shown] == ["gone", "gone"]
    assert "no dispatcher is running now" in web.get("/").get_data(as_text=True)
    live = stack.dispatcher()
    wait_for(lambda: [x["name"] for x in web.get("/api/overview").get_json()["dispatchers"]
                      if x["health"] == "ok"], what="the new dispatcher's pass")
    shown = web.get("/api/overview").get_json()["dispatchers"]
    assert sorted(x["health"] for x in shown) == ["gone", "ok"] and "ancient" not in [x["name"] for x in shown]
    assert "no dispatcher is running now" not in web.get("/").get_data(as_text=True)
    live.send_signal(signal.SIGTERM)
    assert live.wait(30) == 0

    worker = stack.worker(concurrency=2, name="doomed")
    apps.hold.delay("truth", 60)
    wait_for(lambda: [w for w in web.get("/api/workers").get_json() if w.get("busy") == 1], what="a busy worker")
    os.killpg(worker.pid, signal.SIGKILL)
    [w] = wait_for(lambda: [w for w in web.get("/api/workers").get_json() if w["state"] == "dead"],
                   what="the worker seen dead")
    assert w["busy"] is None and w["cpu"] is None
    row = re.search(r'<tr class="dead">.*?</tr>', web.get("/").get_data(as_text=True), re.S).group(0)
    assert "doomed" in row and "1/2" not in row and "-/2" in row

    apps.add.apply_async([1, 2], queue="lonely")
    page = web.get("/").get_data(as_text=True)
    assert 'data-unserved="lonely"' in page and "no live worker consumes it" in page
    assert 'data-unserved="default"' not in page  # its one job is running, none pending
    [q] = [q for q in web.get("/api/overview").get_json()["queues"] if q["name"] == "lonely"]
    assert q["unserved"] is True
    stack.worker("-Q", "lonely", concurrency=1)
    wait_for(lambda: 'data-unserved="lonely"' not in web.get("/").get_data(as_text=True),
             what="the warning gone once a worker consumes the queue")


def test_pages_say_when_redis_is_down(tmp_path, caplog):
    """Redis stopped: every page answers 503 with one line saying so (not a bare 500), the
    dashboard starts anyway, and it serves again, logins included, once Redis is back. Its
    log says so once per outage (it said it at every request: a line every 2 s for each
    open live page), and once when Redis is back."""
    from taskrunner import TaskRunner
    from taskrunner.ops.redis_server import RedisServer

    def said(level: int) -> list[str]:  # about Redis (a login is logged too)
        return [r.getMessage() for r in caplog.records
                if r.name == "taskrunner.dashboard" and r.levelno == level and "Redis" in r.getMessage()]

    caplog.set_level(logging.INFO, logger="taskrunner.dashboard")
    server = RedisServer(tmp_path, appendonly=False)
    runner = TaskRunner("down", redis_url=server.url)
    try:
        web = create_app(runner, password="pw").test_client()  # Redis not started yet
        for path in ["/", "/running", "/stuck", "/failed", "/schedules", "/history", "/queues/default",
                     "/jobs/x", "/login"]:
            r = web.get(path)
            assert r.status_code == 503 and "cannot reach Redis at unix://" in r.get_data(as_text=True), path
        r = web.get("/api/overview")
        assert r.status_code == 503 and "cannot reach Redis" in r.get_json()["error"]
        [warning] = said(logging.WARNING)
        assert warning.startswith("dashboard: Redis unavailable (cannot reach Redis at unix://") and \
            warning.endswith("); trying again until it answers (at each request)"), warning
        assert web.get("/static/live.js").status_code == 200 and not said(logging.INFO)  # Redis still down
        server.start()
        assert web.get("/static/live.js").status_code == 200 and not said(logging.INFO)  # a static file asks not
        assert web.get("/").status_code == 200
        [back] = said(logging.INFO)
        assert back.startswith("dashboard: Redis answers again (unavailable for "), back
        login(web)
        server.stop()
        r = web.get("/running")
        assert r.status_code == 503 and "works again once Redis answers" in r.get_data(as_text=True)
        assert web.get("/api/overview").status_code == 503
        assert len(said(logging.WARNING)) == 2 and len(said(logging.INFO)) == 1  # the second outage's warning
    finally:
        server.stop()


def test_a_jobs_headers_show_as_json_and_escaped(app, web):
    job = apps.add.apply_async([1, 2], headers={"trace": "<script>alert(1)</script>", "n": 1})
    page = web.get(f"/jobs/{job.id}").get_data(as_text=True)
    assert ("<tr><th>headers</th><td><code>{&#34;trace&#34;: &#34;&lt;script&gt;alert(1)&lt;/script&gt;&#34;, "
            "&#34;n&#34;: 1}</code></td></tr>") in page  # JSON (not a Python repr), escaped


def test_a_workflow_steps_page_links_its_parents_and_children_and_waiting_is_listed(app, web):
    handle = (apps.add.s(1, 2) | apps.mul.s(10) | apps.mul.s(2)).delay()
    middle = app.redis.hget(app.keys.job("default", handle.id), "parents").split()[1]
    first = app.redis.hget(app.keys.job("default", middle), "parents").split()[1]
    page = web.get(f"/jobs/{middle}").get_data(as_text=True)
    assert '<span class="badge waiting">waiting</span>' in page
    assert f'<tr><th>parents</th><td><a href="/jobs/{first}">' in page
    assert f'<tr><th>children</th><td><a href="/jobs/{handle.id}">' in page
    listed = web.get("/queues/default?state=waiting").get_data(as_text=True)
    assert middle in listed and handle.id in listed and first not in listed
    assert '<th class="n">waiting</th>' in web.get("/").get_data(as_text=True)
    assert web.get("/api/jobs?state=waiting&queue=default").headers["X-Total-Count"] == "2"


def test_hints_to_start_a_worker_name_the_dashboards_app(app, monkeypatch):
    """The overview's "no live worker consumes it", the empty Workers table and the empty Tasks
    page tell the command to start a worker: with the app the dashboard was started with
    (TASKRUNNER_APP, as `taskrunner up` and the Procfile give it), not a placeholder
    ("-A yourapp" whatever the app was), escaped as everything else."""
    apps.add.apply_async([1, 2], queue="lonely")
    monkeypatch.setenv("TASKRUNNER_APP", "shop.tasks:app<b>")
    web = create_app(app).test_client()
    hint = "taskrunner worker -A shop.tasks:app&lt;b&gt;"
    assert f"{hint} -Q lonely</code>" in web.get("/").get_data(as_text=True)
    assert f"{hint}</code>" in web.get("/workers").get_data(as_text=True)
    assert f"{hint}</code>" in web.get("/tasks").get_data(as_text=True)
    monkeypatch.delenv("TASKRUNNER_APP")
    assert "taskrunner worker -A yourapp -Q lonely" in create_app(app).test_client().get("/").get_data(as_text=True)
