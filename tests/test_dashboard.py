"""The first dashboard: read-only pages and JSON (the full dashboard is a later issue)."""

from __future__ import annotations

from dashboard import create_app
from tests import apps


def test_overview_and_api(app, stack):
    apps.add.delay(1, 2)
    web = create_app(app).test_client()
    page = web.get("/")
    assert page.status_code == 200 and b"default" in page.data
    assert web.get("/api/queues").get_json()[0]["pending"] == 1
    assert web.get("/api/workers").get_json() == []
    jobs = web.get("/api/jobs?state=pending").get_json()
    assert jobs[0]["task"] == "tests.apps.add" and jobs[0]["args"] == [1, 2]
