"""The Failed page in a real browser (issue 21): find a job by id from the header's search
box, filter failed jobs by error type, retry all matching in batches with the progress
display. Chromium as in tests/test_browser.py; screenshots (desktop and 420 px wide) go to
test-artifacts/."""

from __future__ import annotations

from urllib.parse import urlparse

from playwright.sync_api import Page, expect

from tests.conftest import wait_for
from tests.test_browser import accept_next_dialog, browser, dashboard, login, page, row_of, screenshot, screenshots  # noqa: F401 (fixtures)
from tests.test_dashboard_find import fail


def test_filter_failed_by_error_type_and_retry_all_matching(app, dashboard, page: Page):  # noqa: F811
    values = fail(app, "tests.apps.add", "ValueError", 5)
    values += fail(app, "tests.apps.boom", "ValueError", 2, queue="other")
    keys = fail(app, "tests.apps.boom", "KeyError", 2)
    login(page, dashboard, "/failed")
    expect(page.locator("p.pager")).to_have_text("9 jobs")

    # Find one by id from the header: straight to its page.
    page.fill("header form.find input", keys[0])
    with page.expect_navigation():
        page.press("header form.find input", "Enter")
    assert urlparse(page.url).path == f"/jobs/{keys[0]}"
    page.go_back()

    # Filter by error type: the select lists each type with its count.
    page.select_option('select[name="error"]', "ValueError")
    with page.expect_navigation():
        page.click("form.filters button")
    assert "error=ValueError" in page.url
    expect(page.locator("p.pager")).to_have_text("7 jobs")
    for i in keys:
        expect(row_of(page, i)).to_have_count(0)
    expect(page.locator('button[data-action="retry-all"]')).to_have_text("Retry all 7 matching")
    screenshots(page, "failed-filtered", ("retry-all", "delete-all", "retry-selected", "retry"))

    # Retry all matching: confirmed, run in batches (the script sends 200 at a time), with progress.
    dialogs = accept_next_dialog(page)
    page.click('button[data-action="retry-all"]')
    expect(page.locator(".progress-text")).to_contain_text("Done: 7 retried, 0 refused, 0 gone", timeout=30_000)
    assert dialogs == ["Retry all 7 matching?"]
    expect(page.locator("form.bulk progress")).to_have_attribute("value", "7")
    screenshot(page, "failed-retried-all.png")
    assert all(app.job(i).state == "pending" for i in values)
    assert all(app.job(i).state == "failed" for i in keys)

    with page.expect_navigation():
        page.click(".progress-text a")
    expect(page.locator("tbody td.muted")).to_have_text("no failed jobs match this filter")
    audit = app.redis.lrange(app.keys.g + "audit", 0, -1)
    assert any("retry 7 jobs matching state=failed error=ValueError" in a for a in audit)


def test_retry_selected_in_the_browser(app, dashboard, page: Page):  # noqa: F811
    ids = fail(app, "tests.apps.add", "ValueError", 3)
    login(page, dashboard, "/failed")
    dialogs: list[str] = []
    page.on("dialog", lambda d: (dialogs.append(d.message), d.accept()))
    page.click('button[data-action="retry-selected"]')  # nothing ticked: says so, sends nothing
    wait_for(lambda: dialogs, what="the alert")
    assert dialogs == ["Tick the jobs first."]
    row_of(page, ids[0]).locator('input[type="checkbox"]').check()
    row_of(page, ids[2]).locator('input[type="checkbox"]').check()
    with page.expect_navigation():
        page.click('button[data-action="retry-selected"]')
    expect(page.locator("p.flash")).to_have_text("2 retried, 0 refused, 0 gone")
    assert [app.job(i).state for i in ids] == ["pending", "failed", "pending"]
    page.locator("[data-check-all]").check()
    expect(row_of(page, ids[1]).locator('input[type="checkbox"]')).to_be_checked()
    with page.expect_navigation():
        page.click('button[data-action="delete-selected"]')
    assert dialogs[-1] == "Delete 1 selected job? This cannot be undone."
    assert not app.redis.exists(app.keys.job("default", ids[1]))
