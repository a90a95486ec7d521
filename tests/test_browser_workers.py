"""The worker page in a real browser (issue 21): its children and running job, and Stop
gracefully, confirmed by name. Chromium as in tests/test_browser.py; screenshots (desktop
and 420 px wide) go to test-artifacts/."""

from __future__ import annotations

from urllib.parse import urlparse

from playwright.sync_api import Page, expect

from tests import apps
from tests.conftest import wait_for
from tests.test_browser import accept_next_dialog, browser, dashboard, login, page, row_of, screenshots  # noqa: F401 (fixtures)
from tests.test_failures import release, started_pid


def test_stop_a_worker_gracefully_from_its_page(app, stack, dashboard, page: Page):  # noqa: F811
    w = stack.worker(concurrency=2, name="w-browser")
    job = apps.hold.delay("wb", 60)
    started_pid(app, "wb")
    login(page, dashboard, "/workers")
    with page.expect_navigation():
        page.click('a[href="/workers/w-browser"]')
    expect(page.locator("h1")).to_contain_text("w-browser")
    expect(row_of(page, job.id)).to_have_count(1)
    wait_for(lambda: page.reload() or page.locator("section:has(h2:text('Children')) tbody tr td.n").count() == 4,
             what="its two children with PID and RSS")
    screenshots(page, "worker", ("stop", "stop-now"))
    dialogs = accept_next_dialog(page)
    with page.expect_navigation():
        page.click('button[data-action="stop"]')
    assert dialogs == ["Stop worker w-browser gracefully? It runs no new job; its running jobs may finish."]
    assert urlparse(page.url).path == "/workers/w-browser"
    expect(page.locator("p.flash")).to_contain_text("stopping: its running jobs have its shutdown grace")
    release(app, "wb")
    assert job.wait(30) == "released" and w.wait(30) == 0
