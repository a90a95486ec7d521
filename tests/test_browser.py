"""The dashboard in a real browser: headless Debian `chromium` driven by Playwright's sync API,
against the dashboard served in-process on 127.0.0.1 and real worker/dispatcher processes.

Needs the `chromium` binary (scripts/ensure-chromium.sh installs it) and the `playwright`
package; Playwright's own browser downloads are not used. Without them the tests are skipped,
except under CI (CI=true), where they fail: CI installs both. Screenshots go to test-artifacts/.
"""

from __future__ import annotations

import os
import shutil
import socket
import threading
from collections.abc import Iterator
from datetime import datetime, timedelta
from typing import Any
from urllib.parse import urlparse

import pytest
from werkzeug.serving import make_server

from dashboard import create_app
from tests import apps
from tests.conftest import ROOT, wait_for
from tests.test_failures import release, started_pid

try:
    from playwright.sync_api import Browser, Page, expect, sync_playwright
except ImportError as e:  # pragma: no cover - depends on the machine
    sync_playwright = None
    _IMPORT_ERROR: str | None = str(e)
else:
    _IMPORT_ERROR = None

PASSWORD = "s3cret-pw"
ARTIFACTS = ROOT / "test-artifacts"
#: Flags for Debian's chromium in a container: no sandbox (root), no GPU, no network chatter.
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
#: Milliseconds Playwright waits for a page, a locator or an expect(); live.js polls every 2 s.
TIMEOUT_MS = 30_000
HOSTILE = "<img src=x onerror=window.__xss=1>"


def on_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")


def missing() -> str | None:
    """Why the browser tests cannot run here, or None."""
    if _IMPORT_ERROR is not None:
        return f"playwright is not importable ({_IMPORT_ERROR}): pip install playwright (the [test] extra)"
    if shutil.which("chromium") is None:
        return "no `chromium` on PATH: run scripts/ensure-chromium.sh (apt-get install chromium)"
    return None


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    why = missing()
    if why:
        if on_ci():
            pytest.fail(f"CI is set, so the browser tests must run: {why}", pytrace=False)
        pytest.skip(why)
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=shutil.which("chromium"), headless=True, args=CHROMIUM_ARGS)
        try:
            yield b
        finally:
            b.close()


@pytest.fixture
def page(browser: Browser) -> Iterator[Page]:
    """A fresh browser context (no cookies) per test. JavaScript errors on the page fail the test."""
    context = browser.new_context(viewport={"width": 1400, "height": 900})
    context.set_default_timeout(TIMEOUT_MS)
    pg = context.new_page()
    errors: list[str] = []
    pg.on("pageerror", lambda e: errors.append(f"uncaught: {e}"))
    pg.on("console", lambda m: errors.append(f"console.{m.type}: {m.text} ({m.location.get('url')})")
          if m.type == "error" and not m.location.get("url", "").endswith("/favicon.ico") else None)
    try:
        yield pg
    finally:
        context.close()
    if errors:
        pytest.fail("errors in the browser:\n" + "\n".join(errors), pytrace=False)


@pytest.fixture
def dashboard(app) -> Iterator[str]:
    """The dashboard app served by werkzeug in a thread on 127.0.0.1; its base URL."""
    web = create_app(app, password=PASSWORD, token="t")
    server = make_server("127.0.0.1", 0, web, threaded=True)
    thread = threading.Thread(target=server.serve_forever, name="dashboard", daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_port}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(10)


def screenshot(page: Page, name: str) -> None:
    ARTIFACTS.mkdir(exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / name), full_page=True)


def screenshots(page: Page, name: str, buttons: tuple[str, ...]) -> None:
    """Screenshots at desktop width and 420 px wide (<name>.png, <name>-420.png); at 420 px
    each of these buttons (data-action) is on screen."""
    screenshot(page, f"{name}.png")
    page.set_viewport_size({"width": 420, "height": 900})
    screenshot(page, f"{name}-420.png")
    for b in buttons:
        box = page.locator(f'button[data-action="{b}"]').first.bounding_box()
        assert box is not None and box["x"] + box["width"] <= 420, (b, box)
    page.set_viewport_size({"width": 1400, "height": 900})


def accept_next_dialog(page: Page) -> list[str]:
    """Accept the page's next dialog (live.js's confirm()); the list gets its message."""
    dialogs: list[str] = []

    def accept(d: Any) -> None:
        dialogs.append(d.message)
        d.accept()

    page.once("dialog", accept)
    return dialogs


def row_of(page: Page, job_id: str) -> Any:
    return page.locator(f'tr[data-job="{job_id}"]')


def cell(row: Any, column: str) -> Any:
    """A row's cell under the header `column` of the Running table."""
    headers = ["job", "task", "args", "queue", "host", "ip", "pid", "started", "elapsed", "try", "actions"]
    return row.locator("td").nth(headers.index(column))


def wait_for_live_refresh(page: Page, selector: str = "[data-live]") -> None:
    """Tag the live element's children, then wait until live.js replaced them (innerHTML),
    without reloading the page."""
    page.mouse.move(0, 0)  # live.js does not refresh under the pointer
    page.eval_on_selector(selector, "el => el.querySelectorAll('*').forEach(c => c.dataset.old = '1')")
    page.wait_for_function(
        "s => { const el = document.querySelector(s); return el && el.firstElementChild"
        " && !el.querySelector('[data-old]'); }", arg=selector)


def login(page: Page, base: str, next_path: str) -> None:
    """Log in through the login form; wait until it sent us on to next_path."""
    page.goto(f"{base}/login?next={next_path}")
    page.fill('input[name="password"]', PASSWORD)
    page.click("form.login button")
    wait_for(lambda: urlparse(page.url).path == next_path, what=f"redirect to {next_path} after login")
    expect(page.locator("header .who button")).to_have_text("log out")


def click_kill(page: Page, job_id: str) -> list[str]:
    """Click the Kill button in the job's row and accept live.js's confirm(); the dialogs seen."""
    dialogs = accept_next_dialog(page)
    with page.expect_navigation():
        row_of(page, job_id).locator('button[data-action="kill"]').click()
    return dialogs


def test_running_page_kill_button_kills_the_job(app, stack, dashboard, page):
    w = stack.worker(concurrency=1)
    stack.dispatcher()
    job = apps.hold.delay("b1", 60)
    pid = started_pid(app, "b1")
    # Timers stay paused in this test, so live.js never refreshes: it sees each page as served
    # (the live refresh has tests of its own below).
    page.clock.install()
    page.clock.pause_at(datetime.now() + timedelta(seconds=1))

    # Not logged in: the row shows the job, where it runs, and no Kill button.
    page.goto(dashboard + "/running")
    row = row_of(page, job.id)
    expect(row).to_have_count(1)
    expect(cell(row, "job")).to_have_text(job.id)
    expect(cell(row, "task")).to_have_text("tests.apps.hold")
    expect(cell(row, "host")).to_have_text(socket.gethostname())
    expect(cell(row, "pid")).to_have_text(str(pid))
    expect(page.locator('button[data-action="kill"]')).to_have_count(0)
    expect(page.locator("header .who")).to_have_text("log in")

    # Log in through the form: back on /running, now with a Kill button in the row.
    login(page, dashboard, "/running")
    kill = row_of(page, job.id).locator('button[data-action="kill"]')
    expect(kill).to_have_count(1)
    expect(kill).to_have_class("danger")
    screenshot(page, "running-logged-in.png")
    assert "fragment" not in row_of(page, job.id).locator('input[name="next"]').get_attribute("value")

    dialogs = click_kill(page, job.id)
    assert dialogs == [f"Kill job {job.id[:8]}… (tests.apps.hold)? It ends killed; if it runs, it is stopped."]
    # The form redirects back to the Running page with a message.
    wait_for(lambda: urlparse(page.url).path == "/running", what="back on /running")
    expect(page.locator("h1")).to_have_text("Running")
    expect(page.locator("p.flash")).to_contain_text(f"{job.id}: kill")

    # The job ends killed: the job page (reloaded while polling) shows the badge.
    page.goto(f"{dashboard}/jobs/{job.id}")

    def killed_badge() -> bool:
        page.reload()
        return page.locator("h1 .badge.killed").count() == 1

    wait_for(killed_badge, timeout=60, what="the killed badge on the job page")
    expect(page.locator("h1 .badge")).to_have_text("killed")
    assert app.job(job.id).state == "killed"
    screenshot(page, "job-killed.png")

    # The worker lives on and takes jobs.
    assert w.poll() is None
    assert apps.add.delay(1, 2).wait(30) == 3

    page.goto(dashboard + "/")
    queue = page.locator("table").first.locator("tbody tr", has_text="default")
    headers = [h.strip() for h in page.locator("table").first.locator("thead th").all_text_contents()]
    expect(queue.locator("td").nth(headers.index("killed"))).to_have_text("1")  # by name: columns come and go
    expect(page.locator("table").nth(1).locator("tbody tr")).to_have_count(1)  # one worker
    expect(page.locator("table").nth(1).locator(".badge")).to_have_text("alive")
    screenshot(page, "overview.png")


def test_running_page_shows_new_job_without_reload(app, stack, dashboard, page):
    stack.worker(concurrency=1)
    page.goto(dashboard + "/running")
    expect(page.locator("[data-live] td.muted")).to_have_text("nothing running")
    page.evaluate("window.__same_document = true")  # a reload or navigation would drop it

    job = apps.hold.delay("live", 60)
    started_pid(app, "live")
    page.mouse.move(0, 0)  # live.js does not refresh under the pointer
    row = row_of(page, job.id)
    expect(row).to_have_count(1)
    expect(cell(row, "job")).to_have_text(job.id)
    assert page.evaluate("window.__same_document") is True

    release(app, "live")
    assert job.wait(30) == "released"
    expect(row).to_have_count(0)  # and gone again, still without a reload
    expect(page.locator("[data-live] td.muted")).to_have_text("nothing running")
    assert page.evaluate("window.__same_document") is True


def test_hostile_job_argument_is_shown_as_text(app, stack, dashboard, page):
    stack.worker(concurrency=1)
    job = apps.hold.delay(HOSTILE, 60)
    started_pid(app, HOSTILE)
    try:
        page.goto(dashboard + "/running")
        row = row_of(page, job.id)

        def shown_as_text() -> None:
            expect(row).to_have_count(1)
            expect(cell(row, "args")).to_contain_text("<img src=x")
            expect(cell(row, "args")).to_be_visible()
            assert page.locator("img").count() == 0
            assert page.evaluate("window.__xss") is None

        shown_as_text()  # as served
        wait_for_live_refresh(page)
        shown_as_text()  # as live.js put it in with innerHTML
        page.goto(f"{dashboard}/jobs/{job.id}")
        expect(page.locator("table.kv")).to_contain_text("<img src=x onerror=window.__xss=1>")
        assert page.locator("img").count() == 0
        assert page.evaluate("window.__xss") is None
    finally:
        release(app, HOSTILE)
    assert job.wait(30) == "released"


def test_confirm_guard_is_in_place_before_any_button_shows(dashboard, page):
    """live.js's submit handler (the confirm before a danger button, "Tick the jobs first")
    is attached before the page has a single button: a click as soon as a button shows,
    on a slow or loaded machine, must not post past it (a deferred script left a window
    in which a Delete went through unconfirmed; CI clicked into it)."""
    page.add_init_script("""
      window.__guard = [];
      const add = EventTarget.prototype.addEventListener;
      EventTarget.prototype.addEventListener = function (type, ...rest) {
        if (this === document && type === "submit") window.__guard.push(document.querySelectorAll("button").length);
        return add.call(this, type, ...rest);
      };""")
    login(page, dashboard, "/failed")
    assert page.evaluate("window.__guard") == [0]


def test_a_live_refresh_leaves_alone_what_the_pointer_came_onto_meanwhile(dashboard, page):
    """live.js looks whether the pointer is on the element before it fetches the fragment;
    one that came onto it while the fetch was out had the content replaced under it, and a
    click between mouse-down and mouse-up was lost (noticed by the flake hunt). It looks
    again when the answer comes. The fetches are held (page.route) to make the moment."""
    held: list[Any] = []
    page.route("**/?fragment=1", lambda route: held.append(route))

    def next_fetch() -> Any:
        return wait_for(lambda: page.wait_for_timeout(50) or held, what="live.js's next fetch").pop()

    page.goto(dashboard + "/")
    page.mouse.move(0, 0)
    page.eval_on_selector("[data-live]", "el => el.querySelectorAll('*').forEach(c => c.dataset.old = '1')")
    first = next_fetch()
    page.hover("[data-live] table")  # the pointer comes while the fetch is out
    first.continue_()
    page.wait_for_selector("[data-live][data-held]", state="attached")  # its answer set aside
    assert page.eval_on_selector("[data-live]", "el => !!el.querySelector('[data-old]')")
    page.mouse.move(0, 0)  # the pointer leaves: the next refresh goes
    next_fetch().continue_()
    page.wait_for_function("() => !document.querySelector('[data-live] [data-old], [data-live][data-held]')")
    page.unroute("**/?fragment=1")


def test_kill_after_live_refresh_returns_to_the_full_page(app, stack, dashboard, page):
    stack.worker(concurrency=1)
    job = apps.hold.delay("b2", 60)
    started_pid(app, "b2")
    try:
        login(page, dashboard, "/running")
        expect(row_of(page, job.id)).to_have_count(1)
        wait_for_live_refresh(page)  # as for anyone who stays on the page for 2 s
        assert click_kill(page, job.id) == [f"Kill job {job.id[:8]}… (tests.apps.hold)? It ends killed; if it runs, "
                                            "it is stopped."]
        assert "fragment" not in page.url, page.url
        expect(page.locator("h1")).to_have_text("Running", timeout=2_000)
        expect(page.locator("p.flash")).to_contain_text(f"{job.id}: kill", timeout=2_000)
    finally:
        release(app, "b2")


def test_job_page_shows_progress_and_logs_live(app, stack, dashboard, page):
    job = apps.chatty.delay("pl", 3)
    page.goto(f"{dashboard}/jobs/{job.id}")
    expect(page.locator("h1 .badge")).to_have_text("pending")
    page.evaluate("window.__same_document = true")
    stack.worker(concurrency=1)  # the job starts after the page was loaded
    page.mouse.move(0, 0)  # live.js does not refresh under the pointer
    expect(page.locator("pre.logs")).to_contain_text("line 3 of 3")
    expect(page.locator("progress").first).to_have_attribute("value", "1.0")
    expect(page.locator("h1 .badge")).to_have_text("running")
    screenshots(page, "job-progress-logs", ())
    release(app, "pl")
    assert job.wait(30) == 3
    expect(page.locator("h1 .badge")).to_have_text("completed")
    assert page.evaluate("window.__same_document") is True
