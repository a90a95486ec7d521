"""Live list pages and the workflow graph in a real browser (issue 21): the Failed page says
"N new — reload" while a box is ticked and its reload keeps the selection and the scroll;
the Workers page redraws itself; a workflow's graph opens from its job. Chromium as in
tests/test_browser.py; screenshots (desktop and 420 px wide) go to test-artifacts/."""

from __future__ import annotations

import time
from urllib.parse import urlparse

from playwright.sync_api import Page, expect

from taskrunner import chord
from taskrunner.ops import listing
from tests import apps
from tests.conftest import wait_for
from tests.test_browser import ARTIFACTS, accept_next_dialog, browser, dashboard, login, page, row_of  # noqa: F401 (fixtures)
from tests.test_browser_looks import looks
from tests.test_dashboard_find import fail

#: live.js polls every 5 s: a change shows within two polls.
SHOWS_MS = 15_000


def in_view(page: Page, name: str) -> None:  # noqa: F811
    """Screenshots of what a 420 px wide screen shows, scrolled down the list, light and dark
    (<name>.png, <name>-dark.png): the note stays in view."""
    page.set_viewport_size({"width": 420, "height": 900})
    page.evaluate("window.scrollTo(0, 1500)")
    for scheme, suffix in (("light", ""), ("dark", "-dark")):
        page.emulate_media(color_scheme=scheme)
        page.screenshot(path=str(ARTIFACTS / f"{name}{suffix}.png"))
    page.emulate_media(color_scheme="light")
    page.set_viewport_size({"width": 1400, "height": 900})


def test_failed_page_says_n_new_and_keeps_the_selection(app, dashboard, page: Page):  # noqa: F811
    ids = fail(app, "tests.apps.add", "ValueError", 50)  # a full page: the oldest is last
    login(page, dashboard, "/failed")
    page.evaluate("window.__same_document = true")
    row_of(page, ids[25]).locator('input[type="checkbox"]').check()
    row_of(page, ids[0]).locator('input[type="checkbox"]').check()  # the last row: the next page once 2 come
    page.evaluate("window.scrollTo(0, 600)")
    note = page.locator("p.live-note")
    expect(note).to_be_hidden()

    new = fail(app, "tests.apps.boom", "KeyError", 2)
    expect(note).to_be_visible(timeout=SHOWS_MS)
    expect(note).to_contain_text("2 new — reload")
    expect(row_of(page, new[0])).to_have_count(0)  # nothing moved under the user yet
    looks(page, "failed-live-new", ("retry-selected",))
    in_view(page, "failed-live-new-420-scrolled")
    page.evaluate("window.scrollTo(0, 600)")

    note.locator("button").click()  # redrawn in place: no navigation, the scroll kept
    expect(row_of(page, new[1])).to_have_count(1)
    expect(note).to_be_hidden()
    expect(row_of(page, ids[25]).locator('input[type="checkbox"]')).to_be_checked()
    expect(row_of(page, ids[0])).to_have_count(0)  # now on page 2, still selected:
    expect(page.locator("form.bulk .kept")).to_have_text(" (1 selected not on this page)")
    assert page.evaluate("window.__same_document") is True and page.evaluate("window.scrollY") == 600
    expect(page.locator("p.pager")).to_contain_text("52 jobs")

    dialogs = accept_next_dialog(page)  # and "Retry selected" sends both
    with page.expect_navigation():
        page.click('button[data-action="retry-selected"]')
    expect(page.locator("p.flash")).to_have_text("2 retried, 0 refused, 0 gone")
    assert dialogs == [] and app.job(ids[0]).state == "pending" and app.job(ids[25]).state == "pending"
    assert app.job(ids[1]).state == "failed"


def test_workers_page_redraws_itself(app, stack, dashboard, page: Page):  # noqa: F811
    stack.worker(concurrency=1, name="w-first")
    wait_for(lambda: any(w["name"] == "w-first" for w in listing.workers(app)), what="w-first's heartbeat")
    page.goto(f"{dashboard}/workers")
    expect(page.locator('a[href="/workers/w-first"]')).to_have_count(1)
    page.evaluate("window.__same_document = true")
    page.mouse.move(0, 0)  # a page redraws itself only while the user is not on its table
    stack.worker(concurrency=1, name="w-second")
    expect(page.locator('a[href="/workers/w-second"]')).to_have_count(1, timeout=SHOWS_MS + 10_000)
    expect(page.locator("p.live-note")).to_be_hidden()
    assert page.evaluate("window.__same_document") is True
    looks(page, "workers-live")


def test_open_a_workflow_graph_from_its_job(app, stack, dashboard, page: Page):  # noqa: F811
    callback = chord([apps.add.s(1, 1), apps.add.s(2, 2), apps.add.s(3, 3)], apps.tsum.s()).delay()
    members = callback.refresh().data["parents"].split()[1::2]
    page.goto(f"{dashboard}/jobs/{callback.id}")
    with page.expect_navigation():
        page.click(f'a[href="/workflows/{callback.id}"]')
    expect(page.locator("h1")).to_contain_text(callback.id)
    svg = page.locator("main svg")
    expect(svg.locator("rect")).to_have_count(4)
    expect(svg.locator("line")).to_have_count(3)
    expect(svg).to_contain_text("tests.apps.tsum")
    expect(page.locator("tbody tr")).to_have_count(4)
    looks(page, "workflow")
    page.evaluate("window.__same_document = true")
    page.mouse.move(0, 0)
    stack.worker(concurrency=2)
    assert callback.wait(30) == 12
    expect(page.locator("tbody .badge.completed")).to_have_count(4, timeout=SHOWS_MS)  # redrawn: no reload
    assert page.evaluate("window.__same_document") is True
    with page.expect_navigation():
        page.click(f'main a[href="/jobs/{members[1]}"]')
    assert urlparse(page.url).path == f"/jobs/{members[1]}"


def test_a_waiting_page_polls_every_few_seconds_and_not_while_hidden(app, dashboard, page: Page):  # noqa: F811
    fail(app, "tests.apps.add", "ValueError")
    polls: list[float] = []
    page.on("request", lambda r: polls.append(time.monotonic()) if "/api/version/failed" in r.url else None)
    page.goto(f"{dashboard}/failed")
    page.wait_for_timeout(11_000)  # how often it polls in a while: the fixed time is the measure
    assert 1 <= len(polls) <= 3, polls
    page.evaluate("Object.defineProperty(document, 'hidden', {value: true, configurable: true});"
                  "document.dispatchEvent(new Event('visibilitychange'))")
    page.wait_for_timeout(1_000)  # a poll already sent may still be on its way
    hidden_at = len(polls)
    page.wait_for_timeout(11_000)
    assert len(polls) == hidden_at  # hidden: no poll at all
    page.evaluate("Object.defineProperty(document, 'hidden', {value: false, configurable: true});"
                  "document.dispatchEvent(new Event('visibilitychange'))")
    shown = time.monotonic()
    while len(polls) == hidden_at and time.monotonic() < shown + 4:  # sooner than the 5 s period
        page.wait_for_timeout(50)
    assert len(polls) == hidden_at + 1  # at once when the tab shows again
