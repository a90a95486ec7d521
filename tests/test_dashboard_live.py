"""Live list pages (issue 21): each watched page carries its poll (the note base.html draws)
and /api/version/<page> answers what changed since, from counts and ids alone."""

from __future__ import annotations

import re

import pytest

from dashboard import create_app
from tests import apps
from tests.test_dashboard_find import fail


@pytest.fixture
def web(app):
    return create_app(app, password="pw", token="tok").test_client()


def poll_of(web, path: str) -> tuple[str, str, bool]:
    """The note a page draws: (its poll URL, the version it was drawn with, auto)."""
    page = web.get(path).get_data(as_text=True)
    m = re.search(r'<p class="live-note" data-watch="([^"]+)" data-version="([^"]+)"( data-auto)?', page)
    assert m, f"{path} has no live note"
    return m[1].replace("&amp;", "&"), m[2], bool(m[3])


def since(web, url: str, version: str) -> dict:
    return web.get(url + ("&" if "?" in url else "?") + "since=" + version).get_json()


def test_failed_page_counts_what_failed_since_it_was_drawn(app, web):
    fail(app, "tests.apps.add", "ValueError", 2)
    fail(app, "tests.apps.boom", "KeyError")
    url, version, auto = poll_of(web, "/failed?error=ValueError&page=1")
    assert url == "/api/version/failed?error=ValueError&page=1" and not auto
    assert since(web, url, version) == {"version": version, "total": 2, "new": 0}
    fail(app, "tests.apps.boom", "KeyError")  # not this filter's
    assert since(web, url, version)["version"] == version
    fail(app, "tests.apps.add", "ValueError", 3, queue="other")
    d = since(web, url, version)
    assert d["new"] == 3 and d["total"] == 5 and d["version"] != version
    newest = web.get("/api/failed?error=ValueError").get_json()["jobs"][0]["id"]
    assert app.job(newest).retry("t")
    assert since(web, url, version)["new"] == 2  # counted by finish time, not by the total
    _, killed_version, _ = poll_of(web, "/failed?state=killed")
    apps.add.delay(1, 2).kill("t")
    assert since(web, "/api/version/failed?state=killed", killed_version)["new"] == 1


def test_queue_workers_search_and_history_pages_are_watched(app, web):
    apps.add.delay(1, 2)
    url, version, auto = poll_of(web, "/queues/default")
    assert url == "/api/version/queues/default" and auto
    apps.add.delay(3, 4)
    d = since(web, url, version)
    assert d["total"] == 2 and d["new"] == 1 and d["version"] != version
    url, version, auto = poll_of(web, "/queues/default?state=completed")
    assert not since(web, url, version)["new"] and auto
    url, version, auto = poll_of(web, "/workers")
    assert url == "/api/version/workers" and auto and since(web, url, version)["version"] == version
    url, version, auto = poll_of(web, "/search?q=add")
    assert url == "/api/version/search?q=add" and not auto
    apps.add.delay(5, 6)
    assert since(web, url, version)["new"] == 1
    handle = (apps.add.s(1, 2) | apps.mul.s(10)).delay()
    url, version, auto = poll_of(web, f"/workflows/{handle.id}")
    assert url == f"/api/version/workflows/{handle.id}" and auto
    app.job(handle.id).kill("t")  # and its child canceled
    assert since(web, url, version)["version"] != version
    assert web.get("/api/version/workflows/nope").status_code == 404
    url, version, auto = poll_of(web, "/history")
    app.redis.set(app.keys.g + "history:summary", '{"generated_at": 5, "records": 7, "tasks": [], "hours": []}')
    assert since(web, url, version)["new"] == 7


def test_pages_that_refresh_from_fragments_and_error_pages_have_no_note(app, web):
    for path in ("/", "/running", "/stuck", "/schedules", "/tasks", "/failed?state=nope", "/queues/nope"):
        assert 'class="live-note"' not in web.get(path).get_data(as_text=True), path


@pytest.mark.parametrize("path, status, message", [
    ("/api/version/nope", 404, "was not found"),
    ("/api/version/queues", 404, "was not found"),
    ("/api/version/queues/nope", 404, "no queue 'nope'"),
    ("/api/version/failed?state=completed", 400, "state must be failed or killed"),
    ("/api/version/queues/default?state=running", 400, "state must be pending"),
    ("/api/version/queues/default?page=0", 400, "page must be 1 or more"),
    ("/api/version/search", 400, "q must be a job id"),
    ("/api/version/workers/nobody", 404, "no worker 'nobody'"),
    ("/api/version/failed?since=garbage", 200, '"total"'),
])
def test_version_refusals(app, web, path, status, message):
    apps.add.delay(1, 2)  # queue default exists
    r = web.get(path)
    assert r.status_code == status and message in r.get_data(as_text=True), r.get_data(as_text=True)


def round_trips(app, web, path: str) -> int:
    """The socket reads Redis served for one GET of `path` (a pipeline is one, however many
    commands it carries), less the INFO that reads the counter."""
    before = app.redis.info("stats")["total_reads_processed"]
    assert web.get(path).status_code == 200
    return int(app.redis.info("stats")["total_reads_processed"]) - int(before) - 1


def test_the_search_poll_reads_its_counts_in_a_fixed_number_of_round_trips(app, web):
    """The Search page's poll counts the jobs of each searched state of each queue: in
    pipelines, so that its round trips do not grow with the queues (they were one command,
    and for pending two, per queue and state)."""
    apps.add.delay(1, 2)
    path = "/api/version/search?q=add&state=pending&state=delayed&state=failed"
    web.get(path)  # the first request reads the session secret
    one = round_trips(app, web, path)
    for i in range(8):
        apps.add.apply_async([i, 0], queue=f"q{i}", priority=5 if i % 2 else None)
    assert round_trips(app, web, path) == one
    assert web.get(path).get_json()["total"] == 9
