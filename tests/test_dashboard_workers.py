"""The dashboard's Workers pages (issue 21): what a worker publishes (host, IP, PID, queues,
children with PIDs and RSS, jobs now and done, heartbeat) and its Stop actions, against real
worker processes."""

from __future__ import annotations

import psutil
import pytest

from dashboard import create_app, exact
from tests import apps
from tests.conftest import wait_for
from tests.test_dashboard import login
from tests.test_failures import release, started_pid

API = {"Authorization": "Bearer tok"}


@pytest.fixture
def web(app):
    return create_app(app, password="pw", token="tok").test_client()


def alive(web, name: str) -> dict:
    return wait_for(lambda: (web.get(f"/api/workers/{name}").get_json() or {}).get("state") == "alive"
                    and web.get(f"/api/workers/{name}").get_json(), what=f"worker {name} alive")


def test_worker_page_shows_its_process_children_and_jobs(app, stack, web):
    w = stack.worker(concurrency=2, name="w-page")
    d = alive(web, "w-page")
    job = apps.hold.delay("wp", 60)
    pid = started_pid(app, "wp")
    d = wait_for(lambda: (lambda x: x["jobs"] and x)(web.get("/api/workers/w-page").get_json()), what="its job")
    assert d["pid"] == w.pid and "default" in d["queues"] and d["concurrency"] == 2
    assert sorted(c["pid"] for c in d["children"]) == sorted(stack.children_of(w))
    assert all(c["rss"] > 1e6 for c in d["children"])
    [row] = d["jobs"]
    assert row["id"] == job.id and row["pid"] == pid
    page = web.get("/workers/w-page").get_data(as_text=True)
    assert job.id in page and str(pid) in page and "jobs done" in page
    assert "Stop gracefully" not in page  # not logged in
    assert '<a href="/workers/w-page">w-page</a>' in web.get("/workers").get_data(as_text=True)
    assert '<a href="/workers/w-page">w-page</a>' in web.get("/").get_data(as_text=True)
    release(app, "wp")
    job.wait(30)


def test_stop_gracefully_lets_the_running_job_finish(app, stack, web):
    w = stack.worker(concurrency=1, name="w-grace")
    alive(web, "w-grace")
    job = apps.hold.delay("wg", 60)
    started_pid(app, "wg")
    token = login(web)
    assert 'data-action="stop"' in web.get("/workers/w-grace").get_data(as_text=True)
    r = web.post("/workers/w-grace/stop", data={"csrf_token": token})
    assert r.status_code == 302 and r.headers["Location"] == "/workers/w-grace"
    assert "stopping: its running jobs have" in web.get("/workers/w-grace").get_data(as_text=True)
    release(app, "wg")  # within the grace: it completes, then the worker exits
    assert job.wait(30) == "released"
    assert w.wait(30) == 0
    audit = app.redis.lrange(app.keys.g + "audit", 0, -1)
    assert any('"what":"stop worker w-grace"' in a for a in audit)


def test_stop_now_requeues_the_running_job(app, stack, web):
    w = stack.worker(concurrency=1, name="w-now")
    alive(web, "w-now")
    job = apps.hold.delay("wn", 60)
    pid = started_pid(app, "wn")
    r = web.post("/api/workers/w-now/stop-now", headers=API)
    assert r.status_code == 200 and r.get_json()["action"] == "stop-now"
    assert w.wait(30) == 0
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    assert job.state == "pending" and job.refresh().data.get("requeues") == "1"
    assert web.get("/api/workers/w-now").status_code == 404  # a worker that stops cleanly leaves the list
    assert web.post("/api/workers/w-now/stop", headers=API).status_code == 404


def test_worker_refusals(app, stack, web):
    stack.worker(concurrency=1, name="w-ref")
    alive(web, "w-ref")
    assert web.get("/workers/nope").status_code == 404
    assert web.get("/workers/bad%20name").status_code == 404
    assert web.get("/api/workers/nope").status_code == 404
    assert web.post("/workers/w-ref/stop").status_code == 401
    token = login(web)
    assert web.post("/workers/w-ref/stop").status_code == 403  # no CSRF token
    r = web.post("/workers/w-ref/stop", data={"csrf_token": token}, headers={"Sec-Fetch-Site": "cross-site"})
    assert r.status_code == 403
    assert web.post("/workers/w-ref/explode", data={"csrf_token": token}).status_code == 404
    assert web.post("/api/workers/w-ref/stop").status_code == 401
    assert web.post("/api/workers/w-ref/explode", headers=API).status_code == 404
    assert web.post("/api/workers/nope/stop", headers=API).status_code == 404
    ro = create_app(app, password="", token="").test_client()
    assert ro.post("/api/workers/w-ref/stop", headers=API).status_code == 403
    assert "Stop gracefully" not in ro.get("/workers/w-ref").get_data(as_text=True)
    assert web.get("/api/workers/w-ref").get_json()["state"] == "alive"  # still running


def test_hostile_worker_info_is_escaped(app, web):
    from taskrunner.protocol import codec, scripts

    evil = "<script>alert(1)</script>"
    info = {"name": "w-evil", "host": evil, "pid": 1, "ip": evil, "queues": [evil], "children": [evil, 5],
            "children_rss": {"5": evil}}
    scripts.HEARTBEAT(app.redis, [app.keys.g], ["w-evil", codec.dumps(info), 60])
    page = web.get("/workers/w-evil").get_data(as_text=True)
    assert "<script>alert" not in page and "&lt;script&gt;" in page
    d = web.get("/api/workers/w-evil").get_json()
    assert d["children"] == [{"pid": 5, "rss": None}]
    app.redis.zadd(app.keys.workers, {"w-evil": 1})  # its heartbeat long ago: dead
    assert web.post("/api/workers/w-evil/stop", headers=API).status_code == 409
    assert "<script>alert" not in web.get("/workers").get_data(as_text=True)


def test_stop_is_refused_for_a_consumer(app, web):
    """A `taskrunner consume` consumer is listed with the workers but reads kill messages
    only: a stop would be dropped, so the dashboard refuses it and says what to do."""
    from taskrunner.client.consumer import Consumer

    c = Consumer(app, ["default"], name="c-ref")
    c.heartbeat()
    token = login(web)
    page = web.get("/workers/c-ref").get_data(as_text=True)
    assert "taskrunner consume" in page and 'data-action="stop"' not in page
    r = web.post("/api/workers/c-ref/stop", headers=API)
    assert r.status_code == 409 and "consumer, not a worker" in r.get_json()["error"]
    r = web.post("/workers/c-ref/stop-now", data={"csrf_token": token})
    assert r.status_code == 409 and not app.redis.llen(app.keys.control("c-ref"))


def test_a_consumer_of_another_language_is_refused_a_stop_and_its_page_lists_its_jobs(app, web):
    """The Node client's heartbeat says kind "node" and lists no jobs: a stop is refused as
    for ours, and its page finds the jobs it holds in the holding lists, by name."""
    from taskrunner.protocol import codec, scripts
    from tests.test_scripts import claim

    job = apps.add.delay(1, 2)
    claim(app, worker="node-1")
    info = {"name": "node-1", "host": "h", "ip": "1.2.3.4", "pid": 7, "queues": ["default"], "concurrency": 1,
            "busy": 1, "kind": "node"}
    scripts.HEARTBEAT(app.redis, [app.keys.g], ["node-1", codec.dumps(info), 60])
    r = web.post("/api/workers/node-1/stop", headers=API)
    assert r.status_code == 409 and "node consumer, not a worker" in r.get_json()["error"]
    assert not app.redis.llen(app.keys.control("node-1"))
    assert [j["id"] for j in web.get("/api/workers/node-1").get_json()["jobs"]] == [job.id]
    page = web.get("/workers/node-1").get_data(as_text=True)
    assert job.id in page and 'data-action="stop"' not in page


def test_a_worker_page_lists_only_the_jobs_the_holding_lists_give_it(app, web):
    """The page reads the jobs the worker's heartbeat lists (not every running job): one
    another worker holds, one that ended and entries that are not [queue, id] are left out."""
    from taskrunner.protocol import codec, scripts
    from tests.test_scripts import claim

    apps.add.delay(1, 2)
    [row] = claim(app)  # held by the claim helper's worker, not by w-list
    info = {"name": "w-list", "host": "h", "pid": 1, "queues": ["default"],
            "running": [["default", row[1]], ["default", "01NOSUCHJOB"], "junk", [1, 2], ["default"]]}
    scripts.HEARTBEAT(app.redis, [app.keys.g], ["w-list", codec.dumps(info), 60])
    d = web.get("/api/workers/w-list").get_json()
    assert d["state"] == "alive" and d["jobs"] == []
    assert "running" not in web.get("/api/workers").get_json()[0]
    holder = app.redis.hget(app.keys.q("default") + "running", row[1])
    name = codec.loads(holder)["worker"]
    info["name"] = name
    scripts.HEARTBEAT(app.redis, [app.keys.g], [name, codec.dumps(info), 60])
    assert [j["id"] for j in web.get(f"/api/workers/{name}").get_json()["jobs"]] == [row[1]]


def test_a_gone_worker_page_says_so_and_lists_the_jobs_it_ran_that_are_known(app, web):
    """A worker that stopped (it leaves the list) or died over an hour ago has no record: its
    link on a job page ("ran on") opens a page that says it is gone, when it was last seen and
    the jobs it ran whose records are kept (a 404: there is no such worker now), not a bare
    404 page. Read from the records: the history stream is archived every few seconds."""
    from taskrunner.protocol import codec
    from tests.test_scripts import claim, finish

    kept, expired, other = (apps.add.delay(i, 0) for i in range(3))
    for job, worker in ((kept, "w-gone"), (expired, "w-gone"), (other, "w-other")):
        claim(app, worker=worker)
        assert finish(app, job.id, "1", "completed", "1") == 1
    app.redis.delete(app.keys.job("default", expired.id))  # its record expired: nothing to link to
    app.redis.delete(app.keys.q("default") + "history")  # archived
    ended = float(codec.loads(kept.refresh().data["finished_at"]))
    page = web.get(f"/jobs/{kept.id}").get_data(as_text=True)
    assert '<a href="/workers/w-gone">w-gone</a>' in page
    r = web.get("/workers/w-gone")
    page = r.get_data(as_text=True)
    assert r.status_code == 404 and "Worker <code class=\"id\">w-gone</code>" in page
    assert "is gone" in page and "last seen" in page and exact(ended) in page
    assert f'href="/jobs/{kept.id}"' in page and expired.id not in page and other.id not in page
    assert 'class="live-note"' not in page  # nothing to poll: /api/version/workers/w-gone is a 404
    page = web.get("/workers/w-never").get_data(as_text=True)
    assert "is gone" in page and "last seen</th><td>not known" in page
    r = web.get("/api/workers/w-gone")  # the twin: a 404 with what the page shows
    assert r.status_code == 404 and "no worker 'w-gone'" in r.get_json()["error"]
    gone = r.get_json()["gone"]
    assert gone["last_seen"] == ended and [j["id"] for j in gone["jobs"]] == [kept.id]


def test_a_gone_worker_page_reads_a_bounded_number_of_records_in_all(app, web, monkeypatch):
    """However many queues (and shards) there are, a gone worker's page (open to visitors
    not logged in, and its API twin to pollers) reads at most GONE_BUDGET records: fewer of
    each queue's newest when there are many. It read GONE_SCAN of each state of each queue
    (at 64 shards, ~38,000 records a request). The page says how many of each it looked at."""
    from dashboard import views
    from tests.test_scripts import claim, finish

    jobs = [apps.add.delay(i, 0) for i in range(5)]
    for job in jobs:
        claim(app, worker="w-gone")
        assert finish(app, job.id, "1", "completed", "1") == 1
    monkeypatch.setattr(views, "GONE_BUDGET", 6)  # 1 queue x 3 ended states: 2 of each
    gone = web.get("/api/workers/w-gone").get_json()["gone"]
    assert gone["scan"] == 2 and [j["id"] for j in gone["jobs"]] == [j.id for j in jobs[:2:-1]]
    assert "among the 2 newest completed" in web.get("/workers/w-gone").get_data(as_text=True)


def test_a_worker_page_lists_its_oldest_jobs_first(app, web):
    """The page lists the 100 jobs it has held longest, oldest first, whatever the order its
    heartbeat lists them in (its children's), and says how many it holds."""
    from taskrunner.protocol import codec, scripts
    from tests.test_scripts import claim

    p = app.keys.q("default")
    for i in range(101):
        apps.add.delay(i, 0)
    ids = [row[1] for row in claim(app, worker="w-old", pids=tuple(range(1, 102)))]
    oldest, newest = ids[50], ids[0]
    for k, job_id in enumerate(ids):  # started a second apart, ids[50] first, ids[0] last
        entry = codec.loads(app.redis.hget(p + "running", job_id))
        entry["started_at"] -= 1000 if job_id == oldest else k
        app.redis.hset(p + "running", job_id, codec.dumps(entry))
    info = {"name": "w-old", "host": "h", "pid": 1, "queues": ["default"], "concurrency": 101,
            "running": [["default", i] for i in ids]}
    scripts.HEARTBEAT(app.redis, [app.keys.g], ["w-old", codec.dumps(info), 60])
    jobs = web.get("/api/workers/w-old").get_json()["jobs"]
    assert [j["id"] for j in jobs] == [oldest] + [i for i in reversed(ids[1:]) if i != oldest]
    assert newest not in {j["id"] for j in jobs}
    page = web.get("/workers/w-old").get_data(as_text=True)
    assert page.index(oldest) < page.index(ids[100]) and newest not in page
    assert "the 100 it has held longest of 101, oldest first" in page


def test_a_consumer_that_reports_no_memory_nor_cpu_shows_dashes(app, web, stack):
    """A consumer (`taskrunner consume`, the Node client) sends no RSS nor CPU with its
    heartbeat: the Workers page, its own page and `taskrunner workers` say "-" for them; they
    said "0 MB", a bare "%" and "0.0", as if it used no memory."""
    from taskrunner.client.consumer import Consumer

    c = Consumer(app, ["default"], name="c-bare")
    c.heartbeat()
    row = web.get("/workers").get_data(as_text=True).split('href="/workers/c-bare"')[1].split("</tr>")[0]
    assert "MB" not in row and '<td class="n">-</td><td class="n">-</td>' in row, row
    page = web.get("/workers/c-bare").get_data(as_text=True)
    assert "<th>memory (RSS)</th><td>-</td>" in page and "<th>CPU</th><td>-</td>" in page
    line = next(x for x in stack.cli("workers", check=True).stdout.splitlines() if x.startswith("c-bare "))
    assert line.split()[-3:] == ["-", "-", "default"], line
    c.close()
