"""The dashboard's search box, the Failed and Killed pages' filters (and the failure indexes
the scripts keep for them), and bulk retry and delete (issue 21), through Flask's test
client on a real Redis. Jobs fail through the claim and finish scripts, as a worker's do."""

from __future__ import annotations

import pytest

from dashboard import create_app
from taskrunner.ops import failures, queue
from taskrunner.protocol import scripts
from tests import apps
from tests.conftest import wait_for
from tests.test_dashboard import login
from tests.test_scripts import claim, finish

API = {"Authorization": "Bearer tok"}


@pytest.fixture
def web(app):
    return create_app(app, password="pw", token="tok").test_client()


def fail(app, task: str, error_type: str, n: int = 1, queue: str = "default", args: list | None = None,
         **options) -> list[str]:
    """Jobs that ran and failed with `error_type`, as a worker reports it (each in the shard
    it was put in, of a sharded queue). Their arguments fit the task (the enqueue checks)."""
    ids = []
    for _ in range(n):
        given = args if args is not None else ["went wrong"] if task == "tests.apps.boom" else [1, 2]
        job = app.enqueue(task, given, queue=queue, **options)
        [row] = claim(app, queues=(job.queue,))
        assert row[1] == job.id
        assert finish(app, job.id, str(row[2]), "error", error_type, f"{error_type} went wrong", "Traceback",
                      queue=job.queue) == 1
        ids.append(job.id)
    return ids


def index(app, state: str, what: str, queue: str = "default") -> set[str]:
    return set(app.redis.zrange(f"{app.keys.q(queue)}{state}:{what}", 0, -1))


# -- the failure indexes (scripts) ---------------------------------------------------------


def test_the_indexes_follow_a_job_through_fail_retry_delete_and_kill(app):
    a = fail(app, "tests.apps.add", "ValueError", 2)
    b = fail(app, "tests.apps.boom", "ValueError")
    c = fail(app, "tests.apps.boom", "KeyError")
    p = app.keys.q("default")
    assert index(app, "failed", "task:tests.apps.add") == set(a)
    assert index(app, "failed", "error:ValueError") == set(a + b)
    assert index(app, "failed", "te:tests.apps.boom KeyError") == set(c)
    assert app.redis.smembers(p + "failed:facets") == {
        "tests.apps.add ValueError", "tests.apps.boom ValueError", "tests.apps.boom KeyError"}
    # The same score as the failed set: the sweep trims both by the same time.
    assert app.redis.zscore(p + "failed:task:tests.apps.add", a[0]) == app.redis.zscore(p + "failed", a[0])

    assert app.job(c[0]).retry("t")  # retried: out of every index, its pair out of the facets
    assert not index(app, "failed", "te:tests.apps.boom KeyError")
    assert index(app, "failed", "task:tests.apps.boom") == set(b)
    assert "tests.apps.boom KeyError" not in app.redis.smembers(p + "failed:facets")
    assert app.job(a[0]).delete()  # deleted: the same
    assert index(app, "failed", "task:tests.apps.add") == {a[1]}
    assert a[0] not in index(app, "failed", "error:ValueError")

    pending = apps.add.delay(1, 1)  # killed while pending: the killed indexes
    assert app.job(pending.id).kill("t") == "killed"
    assert index(app, "killed", "te:tests.apps.add Killed") == {pending.id}
    assert app.job(pending.id).retry("t") and not app.redis.exists(p + "killed:facets")


def test_the_sweep_trims_the_indexes_with_the_failed_set(app):
    a = fail(app, "tests.apps.add", "ValueError")
    keep = fail(app, "tests.apps.add", "OSError")
    p = app.keys.q("default")
    app.redis.zadd(p + "failed", {keep[0]: 1e12})  # not old enough, whatever the TTL
    for what in ("task:tests.apps.add", "error:OSError", "te:tests.apps.add OSError"):
        app.redis.zadd(f"{p}failed:{what}", {keep[0]: 1e12})

    def swept() -> bool:
        scripts.SWEEP(app.redis, [p], [100, 100, 3600, 1])
        return not app.redis.exists(p + "failed:error:ValueError")

    wait_for(swept, what="the sweep's trim (failed TTL 1 s)")
    assert index(app, "failed", "task:tests.apps.add") == set(keep)
    assert a[0] not in app.redis.zrange(p + "failed", 0, -1)
    assert app.redis.smembers(p + "failed:facets") == {"tests.apps.add OSError"}


def test_a_job_without_a_task_or_with_a_long_error_type_is_indexed_as_the_scripts_say(app):
    [long] = fail(app, "tests.apps.add", "E" * 300)
    p = app.keys.q("default")
    assert index(app, "failed", "error:" + "E" * 200) == {long}
    job = apps.add.delay(1, 2)
    app.redis.hdel(p + "job:" + job.id, "task")  # a corrupt record: the claim fails it
    assert claim(app) == []
    assert job.state == "failed" and index(app, "failed", "te:? CorruptJob") == {job.id}
    assert app.job(job.id).delete() and app.job(long).delete() and not app.redis.exists(p + "failed:facets")


def test_a_long_error_type_is_cut_on_a_character_boundary(app, web):
    """An error type past 200 bytes is cut before the character that crosses byte 200, not
    inside it: the index key, the facet and the page's filter stay valid UTF-8."""
    name = "E" * 199 + "é"  # 200 characters; "é" is bytes 200-201
    [job] = fail(app, "tests.apps.add", name)
    p = app.keys.q("default")
    members = app.redis.smembers(p + "failed:facets")
    assert members == {"tests.apps.add " + "E" * 199}
    assert index(app, "failed", "error:" + "E" * 199) == {job}
    d = web.get("/api/failed", query_string={"error": name}).get_json()
    assert [j["id"] for j in d["jobs"]] == [job] and d["facets"]["errors"] == {"E" * 199: 1}
    assert app.job(job).delete() and not app.redis.exists(p + "failed:facets")


def test_reindex_builds_the_indexes_of_jobs_that_failed_before_them(app, stack, web):
    """Jobs that failed or were killed before the scripts kept the failure indexes (their
    keys gone here) are not in the filters until `taskrunner failures reindex`, which builds
    them in batches, with progress, again and again the same."""
    import json

    a = fail(app, "tests.apps.add", "ValueError", 3)
    b = fail(app, "tests.apps.boom", "KeyError", 2, queue="other")
    killed = apps.add.delay(1, 1)
    killed.kill("t")
    gone = fail(app, "tests.apps.add", "ValueError")  # listed in the failed set, its record expired
    app.redis.delete(app.keys.job("default", gone[0]))
    for q in ("default", "other"):  # as before the indexes: only the state sets
        for state in ("failed", "killed"):
            for k in app.redis.scan_iter(f"{app.keys.q(q)}{state}:*"):
                app.redis.delete(k)
    assert web.get("/api/failed?error=ValueError").get_json()["total"] == 0

    r = stack.cli("failures", "reindex", "--queue", "default", "--batch", "2")
    assert r.returncode == 0, r.stderr
    assert "default failed: 4/4" in r.stderr and "default killed: 1/1" in r.stderr
    assert r.stdout == "4 jobs indexed, 1 no longer failed or killed left as they are; queues: default\n"
    d = web.get("/api/failed?error=ValueError").get_json()
    assert d["total"] == 3 and {j["id"] for j in d["jobs"]} == set(a)
    assert web.get("/api/failed?state=killed&task=tests.apps.add").get_json()["total"] == 1
    assert web.get("/api/failed?task=tests.apps.boom").get_json()["total"] == 0  # queue other: not asked
    assert app.redis.zscore(app.keys.q("default") + "failed:task:tests.apps.add", a[0]) == \
        app.redis.zscore(app.keys.q("default") + "failed", a[0])

    out = json.loads(stack.cli("failures", "reindex", "--json", check=True).stdout)  # every queue, again
    assert out["default"]["failed"] == {"total": 4, "indexed": 3, "skipped": 1}
    assert out["default"]["killed"] == {"total": 1, "indexed": 1, "skipped": 0}
    assert out["other"]["failed"] == {"total": 2, "indexed": 2, "skipped": 0}
    d = web.get("/api/failed?task=tests.apps.boom").get_json()
    assert {j["id"] for j in d["jobs"]} == set(b) and d["facets"]["errors"]["KeyError"] == 2
    assert app.redis.smembers(app.keys.q("default") + "failed:facets") == {"tests.apps.add ValueError"}
    assert app.job(a[0]).retry("t") and a[0] not in index(app, "failed", "error:ValueError")  # unindexed as usual

    r = stack.cli("failures", "reindex", "--queue", "nope")
    assert r.returncode == 1 and "no queue 'nope' (see `taskrunner queues`)" in r.stderr
    r = stack.cli("failures", "reindex", "--queue", "bad name")
    assert r.returncode == 2 and "invalid queue name 'bad name'" in r.stderr
    with pytest.raises(ValueError, match="must be failed or killed"):
        scripts.REINDEX(app.redis, [app.keys.q("default")], ["completed", a[1]])


# -- Failed and Killed pages: filters ------------------------------------------------------


def test_failed_page_filters_by_queue_task_and_error(app, web):
    a = fail(app, "tests.apps.add", "ValueError", 3)
    b = fail(app, "tests.apps.boom", "KeyError", 2)
    c = fail(app, "tests.apps.boom", "ValueError", 1, queue="other")
    page = web.get("/failed").get_data(as_text=True)
    assert all(i in page for i in a + b + c) and "6 jobs" in page
    assert '<option value="ValueError">ValueError (4)</option>' in page
    page = web.get("/failed?error=ValueError").get_data(as_text=True)
    assert all(i in page for i in a + c) and not any(i in page for i in b)
    page = web.get("/failed?task=tests.apps.boom&error=ValueError").get_data(as_text=True)
    assert c[0] in page and not any(i in page for i in a + b) and "1 job" in page
    page = web.get("/failed?queue=default&task=tests.apps.boom").get_data(as_text=True)
    assert all(i in page for i in b) and c[0] not in page
    page = web.get("/failed?queue=other&error=KeyError").get_data(as_text=True)
    assert "no failed jobs match this filter" in page
    d = web.get("/api/failed?error=ValueError&queue=default").get_json()
    assert d["total"] == 3 and {j["id"] for j in d["jobs"]} == set(a) and d["facets"]["errors"] == {
        "KeyError": 2, "ValueError": 3}
    assert d["filter"] == {"state": "failed", "queue": "default", "error": "ValueError"}


def test_failed_filter_pages_newest_first(app, web):
    ids = fail(app, "tests.apps.add", "ValueError", 55)
    fail(app, "tests.apps.add", "KeyError", 3)
    page1 = web.get("/failed?error=ValueError").get_data(as_text=True)
    page2 = web.get("/failed?error=ValueError&page=2").get_data(as_text=True)
    assert ids[54] in page1 and ids[5] in page1 and ids[4] not in page1
    assert all(i in page2 for i in ids[:5]) and "page 2 of 2 (55 jobs)" in page2
    assert 'href="/failed?state=failed&amp;error=ValueError&amp;page=1"' in page2
    [newest] = fail(app, "tests.apps.add", "ValueError", queue="other")  # two queues: pages merged
    page1 = web.get("/failed?error=ValueError").get_data(as_text=True)
    page2 = web.get("/failed?error=ValueError&page=2").get_data(as_text=True)
    assert newest in page1 and ids[6] in page1 and ids[5] not in page1
    assert all(i in page2 for i in ids[:6]) and "page 2 of 2 (56 jobs)" in page2


def test_killed_page_filters_too(app, web):
    jobs = [apps.add.delay(1, i) for i in range(3)]
    for j in jobs[:2]:
        j.kill("t")
    page = web.get("/failed?state=killed&error=Killed&task=tests.apps.add").get_data(as_text=True)
    assert jobs[0].id in page and jobs[1].id in page and jobs[2].id not in page and "Killed (2)" in page


@pytest.mark.parametrize("query, status, message", [
    ("state=completed", 400, "state must be failed or killed"),
    ("task=bad%20name", 400, "invalid task name"),
    ("queue=no-such", 404, "no queue"),
    ("error=" + "x" * 201, 400, "longer than 200"),
    ("colour=red", 400, "unknown filter field"),
    ("page=0", 400, "page must be 1 or more"),
])
def test_failed_filter_refusals(app, web, query, status, message):
    apps.add.delay(1, 2)
    for path in ("/failed?", "/api/failed?"):
        r = web.get(path + query)
        assert r.status_code == status and message in r.get_data(as_text=True), (path, query)


def test_hostile_error_types_and_tasks_are_escaped(app, web):
    evil = '<script>alert(1)</script>"\'&'
    fail(app, "tests.apps.add", evil, args=[evil, 1])
    page = web.get("/failed").get_data(as_text=True)
    assert "<script>alert" not in page and "&lt;script&gt;alert(1)&lt;/script&gt;" in page
    from urllib.parse import quote
    page = web.get("/failed?error=" + quote(evil)).get_data(as_text=True)
    assert "1 job" in page and "<script>alert" not in page
    page = web.get("/search?q=" + quote("<script>")).get_data(as_text=True)
    assert "<script>alert" not in page and "&lt;script&gt;" in page


# -- search ----------------------------------------------------------------------------------


def test_search_by_id_opens_the_job(app, web):
    job = apps.add.delay(1, 2)
    r = web.get(f"/search?q={job.id}")
    assert r.status_code == 302 and r.headers["Location"] == f"/jobs/{job.id}"
    r = web.get(f"/search?q=%20{job.id}%20")  # pasted with spaces
    assert r.status_code == 302
    assert web.get(f"/api/search?q={job.id}").get_json() == {"job": job.id}


def test_search_finds_tasks_and_arguments(app, web, stack):
    stack.worker("-Q", "nothing", concurrency=1)  # declares the tasks
    wait_for(lambda: web.get("/api/tasks").get_json(), what="task declarations")
    [hit] = fail(app, "tests.apps.add", "ValueError", args=["customer-4711", 1])
    fail(app, "tests.apps.add", "ValueError", args=["customer-1", 1])
    pending = apps.add.delay("Customer-4711", 2)
    page = web.get("/search?q=customer-4711").get_data(as_text=True)
    assert hit in page and pending.id in page and "customer-1&#34;" not in page
    d = web.get("/api/search?q=CUSTOMER-4711").get_json()
    assert {j["id"] for j in d["jobs"]} == {hit, pending.id} and d["after"] is None
    d = web.get("/api/search?q=customer-4711&state=failed").get_json()
    assert [j["id"] for j in d["jobs"]] == [hit]
    d = web.get("/api/search?q=apps.bo").get_json()
    assert "tests.apps.boom" in d["tasks"]
    assert '/failed?task=tests.apps.boom' in web.get("/search?q=apps.bo").get_data(as_text=True)


def test_search_is_bounded_and_goes_on_with_a_cursor(app, web, monkeypatch):
    from taskrunner.ops import search

    monkeypatch.setattr(search, "BUDGET", 30)
    monkeypatch.setattr(search, "CHUNK", 10)
    ids = [apps.add.delay("needle" if i % 10 == 0 else "hay", i).id for i in range(100)]
    seen, after, calls = [], None, 0
    while True:
        d = web.get("/api/search?q=needle&state=pending" + (f"&after={after}" if after else "")).get_json()
        calls += 1
        assert d["examined"] <= 30
        seen += [j["id"] for j in d["jobs"]]
        after = d["after"]
        if after is None:
            break
    assert seen == ids[::10] and calls >= 4
    page = web.get("/search?q=needle&state=pending").get_data(as_text=True)
    assert "look further" in page and "after=0.0.30" in page


@pytest.mark.parametrize("query, message", [
    ("", "q must be"), ("q=", "q must be"), ("q=" + "x" * 201, "at most 200"),
    ("q=x&state=running", "state must be among"), ("q=x&after=1.2.3.4", "after must be"),
    ("q=x&after=a.b.c", "after must be"), ("q=x&after=-1.0.0", "after must be"),
])
def test_search_refusals(app, web, query, message):
    for path in ("/search?", "/api/search?"):
        r = web.get(path + query)
        assert r.status_code == 400 and message in r.get_data(as_text=True), (path, query)


def test_the_header_has_the_search_box(app, web):
    page = web.get("/").get_data(as_text=True)
    assert '<form method="get" action="/search" class="find" role="search">' in page


def test_a_sharded_queue_is_filtered_and_acted_on_as_one_queue(app, web):
    queue.create(app, "sq", shards=3)
    ids = fail(app, "tests.apps.add", "ValueError", 3, queue="sq")
    by_shard = {app.job(i).queue: i for i in ids}
    assert set(by_shard) == {"sq", "sq~1", "sq~2"}  # round robin: one job in each shard
    d = web.get("/api/failed?queue=sq").get_json()
    assert d["total"] == 3 and {j["id"] for j in d["jobs"]} == set(ids)
    assert d["facets"] == {"tasks": {"tests.apps.add": 3}, "errors": {"ValueError": 3}}
    page = web.get("/failed").get_data(as_text=True)
    assert '<option value="sq">sq</option>' in page and "sq~1" not in page.split("</select>")[0]
    # A shard's name (a job's page names the shard it is in): that shard alone.
    d = web.get("/api/failed?queue=sq~1").get_json()
    assert d["total"] == 1 and [j["id"] for j in d["jobs"]] == [by_shard["sq~1"]]
    assert '<option value="sq~1" selected>sq~1</option>' in web.get("/failed?queue=sq~1").get_data(as_text=True)
    r = web.post("/api/failed/retry", json={"filter": {"queue": "sq"}}, headers=API)
    assert r.get_json()["done"] == 3 and all(app.job(i).state == "pending" for i in ids)


# -- bulk retry and delete -----------------------------------------------------------------


def test_bulk_forms_need_login_and_csrf(app, web):
    ids = fail(app, "tests.apps.add", "ValueError", 2)
    assert web.post("/failed/retry", data={"id": ids}).status_code == 401
    token = login(web)
    assert web.post("/failed/retry", data={"id": ids}).status_code == 403
    r = web.post("/failed/retry", data={"id": ids, "csrf_token": token}, headers={"Sec-Fetch-Site": "cross-site"})
    assert r.status_code == 403
    assert all(app.job(i).state == "failed" for i in ids)
    page = web.get("/failed").get_data(as_text=True)
    assert 'data-action="retry-all"' in page and f'name="id" value="{ids[0]}" form="bulk"' in page
    r = web.post("/failed/explode", data={"id": ids, "csrf_token": token})
    assert r.status_code == 404
    ro = create_app(app, password="", token="").test_client()
    assert ro.post("/failed/retry", data={"id": ids}).status_code == 403
    assert 'data-action="retry-all"' not in ro.get("/failed").get_data(as_text=True)


def test_retry_and_delete_selected_from_the_page(app, web):
    ids = fail(app, "tests.apps.add", "ValueError", 3)
    pending = apps.add.delay(1, 2)
    token = login(web)
    r = web.post("/failed/retry", data={"id": ids[:2], "csrf_token": token, "state": "failed"})
    assert r.status_code == 302 and r.headers["Location"] == "/failed?state=failed"
    assert [app.job(i).state for i in ids] == ["pending", "pending", "failed"]
    assert "2 retried, 0 refused, 0 gone" in web.get("/failed").get_data(as_text=True)
    r = web.post("/failed/delete", data={"id": [ids[2], pending.id, "nope"], "csrf_token": token})
    assert r.status_code == 302 and pending.state == "pending"  # not failed: left alone
    assert "1 deleted, 1 refused, 1 gone" in web.get("/failed").get_data(as_text=True)
    audit = app.redis.lrange(app.keys.g + "audit", 0, -1)
    assert any('"what":"retry 2 failed jobs (selected)"' in a for a in audit)


def test_retry_all_matching_in_batches_with_a_cursor(app, web):
    vals = fail(app, "tests.apps.add", "ValueError", 7)
    keys = fail(app, "tests.apps.add", "KeyError", 2)
    token = login(web)
    form = {"csrf_token": token, "state": "failed", "error": "ValueError", "all": "1", "limit": "3"}
    done, cursor, calls = 0, {}, 0
    while True:
        r = web.post("/failed/retry", data={**form, **{"cursor_" + k: str(v) for k, v in cursor.items()}},
                     headers={"Accept": "application/json"})
        out = r.get_json()
        calls += 1
        done += out["done"]
        if not out["cursor"]:
            break
        cursor = out["cursor"]
        assert out["left"] == 7 - done
    assert done == 7 and calls == 3
    assert all(app.job(i).state == "pending" for i in vals) and all(app.job(i).state == "failed" for i in keys)
    assert not app.redis.exists(app.keys.q("default") + "failed:error:ValueError")


def test_all_matching_without_script_runs_and_redirects(app, web):
    ids = fail(app, "tests.apps.add", "ValueError", 4)
    other = fail(app, "tests.apps.boom", "ValueError")
    token = login(web)
    r = web.post("/failed/delete", data={"csrf_token": token, "state": "failed", "task": "tests.apps.add",
                                         "all": "1"})
    assert r.status_code == 302 and r.headers["Location"] == "/failed?state=failed&task=tests.apps.add"
    assert "4 deleted, 0 refused, 0 gone" in web.get(r.headers["Location"]).get_data(as_text=True)
    assert not any(app.redis.exists(app.keys.job("default", i)) for i in ids) and app.job(other[0]).state == "failed"


def test_bulk_api_with_the_bearer_token(app, web):
    ids = fail(app, "tests.apps.add", "ValueError", 3)
    killed = apps.add.delay(1, 2)
    killed.kill("t")
    body = {"ids": ids[:1]}
    assert web.post("/api/failed/retry", json=body).status_code == 401
    assert web.post("/api/failed/retry", json=body, headers={"Authorization": "Bearer nope"}).status_code == 401
    r = web.post("/api/failed/retry", json=body, headers=API)
    assert r.status_code == 200 and r.get_json() == {"done": 1, "refused": 0, "gone": 0, "left": 0, "cursor": None,
                                                     "errors": []}
    r = web.post("/api/failed/delete", json={"filter": {"queue": "default"}}, headers=API)
    assert r.get_json()["done"] == 2 and killed.state == "killed"
    r = web.post("/api/failed/retry", json={"filter": {"state": "killed"}, "limit": 5}, headers=API)
    assert r.get_json()["done"] == 1 and killed.state == "pending"
    ro = create_app(app, password="", token="").test_client()
    assert ro.post("/api/failed/retry", json=body, headers=API).status_code == 403


@pytest.mark.parametrize("body, status, message", [
    ({}, 400, "send {"),
    ({"ids": ["a"], "filter": {}}, 400, "send {"),
    ({"ids": "abc"}, 400, "ids must be a list"),
    ({"ids": ["x"] * 1001}, 400, "ids must be a list"),
    ({"ids": ["x"], "state": "completed"}, 400, "state must be failed or killed"),
    ({"filter": {"state": "pending"}}, 400, "state must be failed or killed"),
    ({"filter": {"queue": "no-such"}}, 404, "no queue"),
    ({"filter": []}, 400, "filter must be an object"),
    ({"filter": {}, "limit": "many"}, 400, "limit must be a whole number"),
    ({"filter": {}, "limit": 5000}, 400, "limit must be 1 to 1000"),
    ({"filter": {}, "cursor": {"queue": 0}}, 400, "cursor must be"),
    ({"filter": {}, "cursor": {"before": 1, "skip": -1}}, 400, "cursor must be"),
    ([1, 2], 400, "send {"),
])
def test_bulk_api_refusals(app, web, body, status, message):
    [job_id] = fail(app, "tests.apps.add", "ValueError")
    r = web.post("/api/failed/retry", json=body, headers=API)
    assert r.status_code == status and message in r.get_json()["error"], r.get_json()
    assert app.job(job_id).state == "failed"
    assert web.post("/api/failed/explode", json={"ids": []}, headers=API).status_code == 404
    r = web.post("/api/failed/retry", data="not json", headers={**API, "Content-Type": "application/json"})
    assert r.status_code == 400


def test_a_bulk_action_goes_on_from_its_cursor_when_others_act_meanwhile(app):
    ids = fail(app, "tests.apps.add", "ValueError", 3)
    out = failures.act_on_filter(app, "delete", failures.Filter(error="ValueError"), None, 1, "t")
    assert out["done"] == 1 and out["left"] == 2
    cursor = failures.Cursor.parse(out["cursor"])
    app.job(ids[1]).retry("t")  # retried by someone else before the next batch
    out = failures.act_on_filter(app, "delete", failures.Filter(error="ValueError"), cursor, 10, "t")
    assert out["done"] == 1 and out["cursor"] is None and app.job(ids[1]).state == "pending"
    later = fail(app, "tests.apps.add", "ValueError", queue="other")  # failed after the first call: not taken
    out = failures.act_on_filter(app, "delete", failures.Filter(error="ValueError"), cursor, 10, "t")
    assert out["done"] == 0 and app.job(later[0]).state == "failed"


def test_delete_lua_leaves_a_job_in_another_state_than_asked(app):
    [job_id] = fail(app, "tests.apps.add", "ValueError")
    app.job(job_id).retry("t")
    p = app.keys.q("default")
    assert scripts.DELETE(app.redis, [p], [job_id, 600, "failed killed"]) == "pending"
    assert app.job(job_id).state == "pending"
    with pytest.raises(ValueError, match="ARGV.3. lists the states it may delete"):
        scripts.DELETE(app.redis, [p], [job_id, 600, "failed running"])
    assert scripts.DELETE(app.redis, [p], [job_id, 600]) == "pending" and not app.redis.exists(p + "job:" + job_id)


def test_the_failed_page_has_no_stale_rows_after_a_bulk_delete(app, web):
    fail(app, "tests.apps.add", "ValueError", 3)
    token = login(web)
    web.post("/failed/delete", data={"csrf_token": token, "state": "failed", "all": "1"})
    page = web.get("/failed?error=ValueError").get_data(as_text=True)
    assert "no failed jobs match this filter" in page and "ValueError (0)</option>" in page  # the filter stays
    assert web.get("/api/failed").get_json()["facets"] == {"tasks": {}, "errors": {}}


@pytest.mark.parametrize("action", ["delete", "retry"])
def test_a_bulk_action_gets_past_jobs_whose_record_expired(app, web, action):
    """A task's own failed_ttl shorter than the setting: its record expires while the
    indexes keep its id until the sweep trims them. Such an id is gone (not refused), leaves
    the indexes, and the cursor goes past it: a batch of them must not be read for ever."""
    live = fail(app, "tests.apps.add", "ValueError", 2)
    ghosts = fail(app, "tests.apps.add", "ValueError", 2, failed_ttl=1)  # the newest: the first batch
    wait_for(lambda: not any(app.redis.exists(app.keys.job("default", i)) for i in ghosts), 10, "the records expire")
    counts, cursor = {"done": 0, "refused": 0, "gone": 0}, None
    for _ in range(5):
        body = {"filter": {"error": "ValueError"}, "limit": 2, **({"cursor": cursor} if cursor else {})}
        out = web.post(f"/api/failed/{action}", json=body, headers=API).get_json()
        counts = {k: v + out[k] for k, v in counts.items()}
        cursor = out["cursor"]
        if cursor is None:
            break
    assert cursor is None and counts == {"done": 2, "refused": 0, "gone": 2}, counts
    assert all(app.job(i).state == "pending" for i in live) if action == "retry" else not any(
        app.redis.exists(app.keys.job("default", i)) for i in live)
    p = app.keys.q("default")
    for key in ("failed", "failed:task:tests.apps.add", "failed:error:ValueError",
                "failed:te:tests.apps.add ValueError", "failed:facets"):
        assert not app.redis.exists(p + key), key


def test_delete_and_retry_lua_take_a_gone_job_out_of_the_indexes(app):
    p = app.keys.q("default")
    kept = fail(app, "tests.apps.add", "ValueError")
    ghosts = fail(app, "tests.apps.boom", "ValueError", 2) + fail(app, "tests.apps.add", "KeyError")
    app.redis.delete(*(app.keys.job("default", i) for i in ghosts))  # what their records' expiry does
    assert scripts.DELETE(app.redis, [p], [ghosts[0], 600, "killed"]) == ""  # not a state it may touch
    assert ghosts[0] in index(app, "failed", "error:ValueError")
    assert scripts.DELETE(app.redis, [p], [ghosts[0], 600, "failed"]) == ""
    assert index(app, "failed", "te:tests.apps.boom ValueError") == {ghosts[1]}
    assert scripts.RETRY(app.redis, [p], [ghosts[1], "t"]) == ""
    assert scripts.DELETE(app.redis, [p], [ghosts[2], 600]) == ""  # any state it may delete
    assert index(app, "failed", "error:ValueError") == set(kept) and not index(app, "failed", "error:KeyError")
    assert set(app.redis.zrange(p + "failed", 0, -1)) == set(kept)
    assert app.redis.smembers(p + "failed:facets") == {"tests.apps.add ValueError"}
