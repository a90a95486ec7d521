"""The queue and job pages in a real browser (issue 21): pause and resume a queue from its
page, "Enqueue now" for a delayed job, a Kill confirmation that names the job; and how the
pages look, light and dark (prefers-color-scheme), at desktop width and 420 px. Chromium as
in tests/test_browser.py; screenshots go to test-artifacts/ (<name>[-420][-dark].png)."""

from __future__ import annotations

import re
from urllib.parse import urlparse

from playwright.sync_api import Page, expect

from taskrunner.ops import queue
from tests import apps
from tests.conftest import wait_for
from tests.test_browser import browser, dashboard, login, page, row_of, screenshot  # noqa: F401 (fixtures)
from tests.test_dashboard_looks import publish_summary
from tests.test_failures import release


def looks(pg: Page, name: str, buttons: tuple[str, ...] = ()) -> None:
    """Screenshots light and dark, at desktop width and 420 px wide; at 420 px each of these
    buttons (data-action) is on screen, and no page is wider than the window."""
    for scheme in ("light", "dark"):
        pg.emulate_media(color_scheme=scheme)
        suffix = "" if scheme == "light" else "-dark"
        screenshot(pg, f"{name}{suffix}.png")
        pg.set_viewport_size({"width": 420, "height": 900})
        screenshot(pg, f"{name}-420{suffix}.png")
        assert pg.evaluate("document.documentElement.scrollWidth") <= 420, name
        for b in buttons:
            # A live page (a delayed or running job's) redraws every 2 s: a button measured as
            # its part is swapped has no box for that moment; then the new one is measured.
            button = pg.locator(f'button[data-action="{b}"]').first
            box = wait_for(button.bounding_box, timeout=10, what=f"the {b} button on screen")
            assert box["x"] + box["width"] <= 420, (b, box)
        pg.set_viewport_size({"width": 1400, "height": 900})
    pg.emulate_media(color_scheme="light")


def test_pause_resume_a_queue_and_enqueue_a_delayed_job_now(app, dashboard, page: Page):  # noqa: F811
    queue.create(app, "shop", rate="120/m", shards=2)
    for i in range(5):
        apps.add.apply_async([i, i], queue="shop")
    later = apps.add.apply_async([7, 8], queue="shop", delay=3600)
    soon = apps.add.apply_async([9, 9], queue="shop", delay=3600)
    login(page, dashboard, "/queues/shop")
    expect(page.locator("[data-queue-state]")).to_have_text("Running: workers claim its jobs")
    expect(page.locator('.tabs a[data-state="pending"] .n')).to_have_text("5")
    expect(page.locator('.tabs a[data-state="delayed"] .n')).to_have_text("2")
    expect(page.locator("tr[data-shard]")).to_have_count(2)
    looks(page, "queue", ("pause", "close", "purge"))

    with page.expect_navigation():
        page.click('button[data-action="pause"]')
    assert urlparse(page.url).path == "/queues/shop"
    expect(page.locator("p.flash")).to_contain_text("queue shop: paused")
    expect(page.locator("[data-queue-state]")).to_contain_text("Paused: workers claim none of its jobs")
    assert queue.info(app, "shop")["paused"]
    looks(page, "queue-paused", ("resume",))
    with page.expect_navigation():
        page.click('button[data-action="resume"]')
    expect(page.locator("p.flash")).to_contain_text("queue shop: resumed")
    expect(page.locator('button[data-action="pause"]')).to_have_count(1)
    assert not queue.info(app, "shop")["paused"]

    # Enqueue now from the Delayed tab: that row's job is pending, the other still delayed.
    page.click('.tabs a[data-state="delayed"]')
    expect(row_of(page, later.id)).to_have_count(1)
    looks(page, "queue-delayed", ("enqueue-now", "kill"))
    with page.expect_navigation():
        row_of(page, later.id).locator('button[data-action="enqueue-now"]').click()
    expect(page.locator("p.flash")).to_contain_text(f"{later.id}: enqueued now: next in line")
    expect(row_of(page, later.id)).to_have_count(0)
    expect(page.locator('.tabs a[data-state="delayed"] .n')).to_have_text("1")
    assert later.state == "pending" and soon.state == "delayed"

    # And from the job page, after a Kill that names the job is called off.
    page.goto(f"{dashboard}/jobs/{soon.id}")
    expect(page.locator('tr[data-field="due_at"]')).to_contain_text(re.compile(r"in (59|60) min"))
    looks(page, "job-delayed", ("enqueue-now", "kill", "delete"))
    dialogs: list[str] = []
    page.once("dialog", lambda d: (dialogs.append(d.message), d.dismiss()))  # called off
    page.click('button[data-action="kill"]')
    assert dialogs == [f"Kill job {soon.id[:8]}… (tests.apps.add)? It ends killed; if it runs, it is stopped."]
    assert soon.state == "delayed"
    with page.expect_navigation():
        page.click('button[data-action="enqueue-now"]')
    expect(page.locator("p.flash")).to_contain_text(f"{soon.id}: enqueued now: next in line")
    expect(page.locator("h1 .badge")).to_have_text("pending")
    expect(page.locator('button[data-action="enqueue-now"]')).to_have_count(0)
    assert soon.state == "pending"
    looks(page, "job-pending", ("kill",))


def test_pages_look_right_in_both_schemes(app, stack, dashboard, page: Page):  # noqa: F811
    """The overview, a finished job, the history charts and a workflow graph: screenshots to
    look at, light and dark; in dark mode the page's background is dark and its text light."""
    stack.worker(concurrency=2)
    handle = (apps.add.s(1, 2) | apps.mul.s(10) | apps.mul.s(2)).delay()
    assert handle.wait(30) == 60
    failed = app.enqueue("tests.apps.boom", ["it broke"])
    wait_for(lambda: failed.state == "failed", what="the failed job")
    publish_summary(app, ("shop.reindex", "mail.send"), hours=24)
    page.goto(dashboard + "/")
    expect(page.locator('.tabs a[data-tab="workers"] .n')).to_have_text("1")
    looks(page, "overview-tabs")
    page.emulate_media(color_scheme="dark")
    colours = page.evaluate("[getComputedStyle(document.body).backgroundColor, getComputedStyle(document.body).color]")
    assert colours == ["rgb(15, 18, 24)", "rgb(221, 227, 238)"], colours
    page.emulate_media(color_scheme="light")
    page.goto(f"{dashboard}/jobs/{handle.id}")
    expect(page.locator('tr[data-field="claimed_at"]')).to_have_count(1)
    looks(page, "job-completed")
    page.goto(f"{dashboard}/history")
    expect(page.locator("svg.chart")).to_have_count(3)
    expect(page.locator("svg.chart").nth(1)).to_contain_text("29 µs")
    looks(page, "history-charts")
    page.goto(f"{dashboard}/workflows/{handle.id}")
    expect(page.locator("svg.workflow rect")).to_have_count(3)
    page.emulate_media(color_scheme="dark")
    fill = page.evaluate("getComputedStyle(document.querySelector('svg.workflow rect.completed')).fill")
    assert fill == "rgb(20, 51, 34)", fill  # the dark palette's, not the SVG's own light fill
    page.emulate_media(color_scheme="light")
    looks(page, "workflow-graph")


#: In dark mode, elements whose background is light (luminance over a half), as CSS selectors.
LIGHT_BACKGROUNDS = """[...document.querySelectorAll('body *')].filter(e => {
  const m = getComputedStyle(e).backgroundColor.match(/[\\d.]+/g);
  if (!m || (m.length > 3 && +m[3] === 0)) return false;
  return (0.2126 * m[0] + 0.7152 * m[1] + 0.0722 * m[2]) / 255 > 0.5;
}).map(e => e.tagName.toLowerCase() + (e.className && typeof e.className === 'string' ? '.' + e.className : ''))"""


def test_every_page_is_dark_in_dark_mode(app, stack, dashboard, page: Page):  # noqa: F811
    """Each page in dark mode has no light background left (a colour written outside the
    variables would show here); screenshots of each, dark, at desktop width and 420 px."""
    w = stack.worker(concurrency=2, name="w-dark")
    held = apps.hold.delay("dark", 60)
    failed = app.enqueue("tests.apps.boom", ["it broke"])
    wait_for(lambda: failed.state == "failed" and held.state == "running", what="a failed and a running job")
    login(page, dashboard, "/running")
    page.emulate_media(color_scheme="dark")
    for name, path in [("running", "/running"), ("failed", "/failed"), ("workers", "/workers"),
                       ("worker", "/workers/w-dark"), ("schedules", "/schedules"), ("tasks", "/tasks"),
                       ("search", "/search?q=boom"), ("job-failed", f"/jobs/{failed.id}"),
                       ("job-running", f"/jobs/{held.id}")]:
        page.goto(dashboard + path)
        page.mouse.move(0, 0)
        assert page.evaluate(LIGHT_BACKGROUNDS) == [], path
        screenshot(page, f"dark-{name}.png")
        page.set_viewport_size({"width": 420, "height": 900})
        screenshot(page, f"dark-{name}-420.png")
        assert page.evaluate("document.documentElement.scrollWidth") <= 420, path
        page.set_viewport_size({"width": 1400, "height": 900})
    page.goto(dashboard + "/running")
    page.click("header .who button")  # log out: the login form, dark too
    page.goto(dashboard + "/login")
    assert page.evaluate(LIGHT_BACKGROUNDS) == []
    screenshot(page, "dark-login.png")
    release(app, "dark")
    assert held.wait(30) == "released" and w.poll() is None
