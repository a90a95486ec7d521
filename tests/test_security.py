"""Dashboard security (test_dashboard.py shows the actions working with a login, a CSRF
token and the bearer token, and the read-only mode): every action refused without
authentication, CSRF tokens missing or of other sessions, the session cookie's flags,
brute force from "other" addresses and in parallel, job data escaped on every page and
plain in the JSON API, security headers on every response, redirects that stay on the
site, and no public bind without a password, by the CLI and by the gunicorn hook."""

from __future__ import annotations

import json
import re
import socket
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from urllib.parse import quote, urlencode
from urllib.request import Request, urlopen

import pytest
from werkzeug.serving import make_server

from dashboard import create_app
from dashboard.security import LOGIN_ATTEMPTS, check_bind
from taskrunner.protocol import codec
from tests import apps
from tests.conftest import ROOT, wait_for
from tests.test_dashboard import csrf, login

#: Breaks out of text, attributes (both quotes) and tags, wherever a page puts it.
X = "\"'><script>x()</script><img src=x onerror=x()>"
ESCAPED = "&lt;script&gt;x()&lt;/script&gt;"
ACTIONS = ["kill", "retry", "requeue", "delete", "enqueue-now"]


@pytest.fixture
def web(app):
    return create_app(app, password="pw", token="tok").test_client()


def attempt(web, path: str, **kwargs):
    """POST an action; the job (if any) must be untouched by a refused one."""
    return web.post(path, **kwargs).status_code


def test_no_action_without_authentication(app, web):
    job = apps.add.delay(1, 2)
    before = app.redis.hgetall(app.keys.job("default", job.id))
    for action in ACTIONS:
        assert attempt(web, f"/jobs/{job.id}/{action}", data={"csrf_token": "x"}) == 401, action
        assert attempt(web, f"/api/jobs/{job.id}/{action}") == 401, action
        assert web.get(f"/jobs/{job.id}/{action}").status_code == 405  # never by a link
    assert attempt(web, "/queues/default/purge", data={"csrf_token": "x"}) == 401
    assert attempt(web, "/api/queues/default/purge") == 401
    token = login(web)  # a logged-in browser session is no API credential
    assert attempt(web, f"/api/jobs/{job.id}/kill", data={"csrf_token": token}) == 401
    for header in ["tok", "Basic tok", "Bearer", "Bearer tok2", "Bearer to", "bearer tok", "Bearer  tok"]:
        assert attempt(web, f"/api/jobs/{job.id}/kill", headers={"Authorization": header}) == 401, header
    assert app.redis.hgetall(app.keys.job("default", job.id)) == before
    assert app.redis.llen(app.keys.q("default") + "pending") == 1


def test_csrf_token_of_another_session_or_none_is_refused(app):
    job = apps.add.delay(1, 2)
    alice, mallory = (create_app(app, password="pw").test_client() for _ in range(2))
    alices, mallorys = login(alice), login(mallory)
    assert alices != mallorys
    for data in [{}, {"csrf_token": ""}, {"csrf_token": mallorys}, {"csrf_token": alices[:-1]},
                 {"csrf_token": alices + "x"}, {"csrf_token": "é" * 43}]:
        for path in [f"/jobs/{job.id}/kill", "/queues/default/purge", "/logout"]:
            assert alice.post(path, data=data).status_code == 403, (path, data)
    assert job.state == "pending" and alice.get("/").get_data(as_text=True).count("log out") == 1
    stranger = create_app(app, password="pw").test_client()  # a login form needs its own session's token
    assert csrf(stranger) != alices
    assert stranger.post("/login", data={"password": "pw", "csrf_token": alices}).status_code == 403
    assert alice.post(f"/jobs/{job.id}/kill", data={"csrf_token": alices}).status_code == 302
    assert job.state == "killed"


@pytest.mark.parametrize("proto, secure", [("https", True), ("http", False), (None, False)])
def test_session_cookie_flags(app, proto, secure):
    client = create_app(app, password="pw").test_client()
    headers = {"X-Forwarded-Proto": proto} if proto else {}
    client.get("/login", headers=headers)
    r = client.post("/login", data={"password": "pw", "csrf_token": csrf(client)}, headers=headers)
    cookie = r.headers["Set-Cookie"]
    assert "HttpOnly" in cookie and "SameSite=Strict" in cookie
    assert ("Secure" in cookie) is secure


def test_login_brute_force_is_slowed_whatever_the_client_claims(app, web):
    token = csrf(web)
    assert web.post("/login", data={"password": "pw"}).status_code == 403  # no CSRF token: not even counted
    codes = [web.post("/login", data={"password": f"guess{i}", "csrf_token": token},
                      headers={"X-Forwarded-For": f"10.0.0.{i}", "X-Real-IP": f"10.0.1.{i}"}).status_code
             for i in range(LOGIN_ATTEMPTS + 3)]
    assert codes == [200] * LOGIN_ATTEMPTS + [429] * 3
    assert web.post("/login", data={"password": "pw", "csrf_token": token}).status_code == 429


def test_parallel_guesses_cannot_pass_the_limit_together(app):
    """Guesses sent at once all read "under the limit" unless counting is atomic."""
    server = make_server("127.0.0.1", 0, create_app(app, password="pw"), threaded=True)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        base = f"http://127.0.0.1:{server.server_port}"
        with urlopen(base + "/login") as r:
            cookie = r.headers["Set-Cookie"].split(";")[0]
            token = re.search(r'name="csrf_token" value="([^"]+)"', r.read().decode()).group(1)

        def guess(i: int) -> int:
            body = urlencode({"password": f"guess{i}", "csrf_token": token}).encode()
            try:
                with urlopen(Request(base + "/login", body, headers={"Cookie": cookie})) as r:
                    return r.status
            except OSError as e:
                return e.code  # type: ignore[attr-defined]

        with ThreadPoolExecutor(16) as pool:
            codes = list(pool.map(guess, range(32)))
    finally:
        server.shutdown()
        server.server_close()
    assert codes.count(200) == LOGIN_ATTEMPTS and codes.count(429) == 32 - LOGIN_ATTEMPTS


def hostile_data(app, stack) -> dict[str, str]:
    """X in every field a page shows: through the API and a real worker where a user could
    put it there (args, kwargs, results, errors, tracebacks), written straight into Redis
    where only another client could (names of tasks, queues, workers, schedules)."""
    stack.worker(concurrency=1)
    r, p, now = app.redis, app.keys.q("q"), app.redis.time()[0]
    ids = {"pending": apps.add.apply_async([X], {"b": X}, queue="q").id,
           "delayed": apps.add.apply_async([X, X], queue="q", delay=600).id,
           "completed": app.enqueue("tests.apps.add", [X, X]).id, "failed": apps.boom.delay(X).id}
    app.job(ids["completed"]).wait(30)
    wait_for(lambda: app.job(ids["failed"]).state == "failed", what="boom to fail")
    for job_id, state in [("killed", "killed"), ("named", "failed"), ("done", "completed")]:
        record = {k: X for k in ("task", "error_type", "error", "traceback", "killed_by", "worker", "host")}
        r.hset(p + "job:" + job_id, mapping={**record, "queue": "q", "args": json.dumps([X]), "result": json.dumps(X),
                                             "kwargs": json.dumps({X: X}), "state": state, "finished_at": now,
                                             "enqueued_at": now})
        r.zadd(p + state, {job_id: now})
    r.hset(p + "job:running", mapping={"task": X, "args": json.dumps([X]), "state": "running", "stuck": "1"})
    r.hset(p + "running", "running", codec.dumps({"worker": X, "host": X, "ip": X, "pid": 1, "started_at": now,
                                                   "max_duration": 1, "attempt": 1}))
    r.zadd(p + "failed", {X: now})  # an id no client could enqueue, in attributes and links
    r.hset(p + "job:" + X, mapping={"task": X, "state": "failed", "error": X})
    r.sadd(app.keys.queues, X)
    r.zadd(app.keys.workers, {X: now})
    r.set(app.keys.worker(X), codec.dumps({"name": X, "host": X, "ip": X, "queues": [X], "pid": 1}))
    r.hset(app.keys.dispatchers, X, codec.dumps({"name": X, "host": X, "pid": 1, "last_pass": now, "passes": 1}))
    r.hset(app.keys.schedules, X, codec.dumps({"name": X, "cron": X, "task": X, "queue": X, "last": now}))
    r.hset(app.keys.tasks, X, codec.dumps({k: X for k in ("queue", "max_duration", "retries", "retry_backoff",
                                                           "timeout_policy", "max_lost", "worker", "declared_at")}))
    row = {"count": 1, **{k: 0 for k in ("completed", "failed", "killed", "requeued", "runtime_p50", "runtime_p95",
                                         "runtime_p99", "wait_p50", "wait_p95")},
           **{f"{k}_rate": 0.0 for k in ("completed", "failed", "killed", "requeued")},
           "top_errors": [{"error_type": X, "count": 1}]}
    r.set(app.keys.g + "history:summary", codec.dumps({
        "records": 1, "since": 60, "generated_at": now, "seconds": 1, "history_dir": X,
        "tasks": [{**row, "task": X}], "queues": [{**row, "queue": X}], "workers": [{**row, "host": X}],
        "hours": [{**row, "hour": "2024-01-01T00" + X}]}))
    return ids


def test_job_data_is_escaped_on_every_page_and_plain_json_in_the_api(app, stack, web):
    ids = hostile_data(app, stack)
    login(web)  # so that action forms (with their hidden fields) render too
    pages = ["/", "/?fragment=1", "/running", "/running?fragment=1", "/stuck", "/stuck?fragment=1", "/failed",
             "/failed?state=killed", "/schedules", "/tasks", "/history",
             *(f"/jobs/{i}" for i in ("named", "killed", "done", "running")),
             *(f"/queues/q?state={s}" for s in ("pending", "delayed", "completed", "failed", "killed")),
             *(f"/jobs/{i}" for i in ids.values())]
    for path in pages:
        r = web.get(path)
        body = r.get_data(as_text=True)
        assert r.status_code == 200, path
        assert "<script>x()" not in body and "<img src=x" not in body, path
        assert ESCAPED in body, path  # the data is there, as text
    traceback = web.get(f"/jobs/{ids['failed']}").get_data(as_text=True)
    assert "Traceback" in traceback and f"ValueError: &#34;&#39;&gt;{ESCAPED}" in traceback
    for path in [f"/jobs/{quote(X, safe='')}", f"/queues/{quote(X, safe='')}", f"/failed?state={quote(X)}",
                 f"/queues/q?state={quote(X)}", f"/nope{quote(X)}"]:
        r = web.get(path)  # error pages quote what was asked for
        assert r.status_code in (400, 404, 405) and "<script>x()" not in r.get_data(as_text=True), path
    api = ["/api/overview", "/api/queues", "/api/workers", "/api/schedules", "/api/tasks", "/api/history",
           "/api/jobs?state=running", "/api/jobs?state=stuck", "/api/jobs?state=failed", "/api/jobs?state=killed",
           "/api/jobs/named", "/api/jobs/done", f"/api/jobs/{ids['failed']}"]
    for path in api:
        r = web.get(path)
        assert r.mimetype == "application/json" and r.headers["X-Content-Type-Options"] == "nosniff", path
        assert X in strings(r.get_json()), path  # the value itself, as a JSON string


def strings(value) -> set[str]:
    """Every string anywhere in a JSON value (keys too)."""
    if isinstance(value, str):
        return {value}
    if isinstance(value, dict):
        return set(value) | {s for v in value.values() for s in strings(v)}
    if isinstance(value, list):
        return {s for v in value for s in strings(v)}
    return set()


def csp(header: str) -> dict[str, list[str]]:
    return {d.split()[0]: d.split()[1:] for d in header.split(";") if d.strip()}


def test_security_headers_on_every_response(app, web):
    job = apps.boom.delay("x")
    token = login(web)
    responses = [web.get(p) for p in ["/", "/running", "/failed", "/queues/default", f"/jobs/{job.id}", "/schedules",
                                      "/history", "/login", "/static/live.js", "/static/style.css", "/api/overview",
                                      "/nope", "/jobs/nope", "/api/jobs/nope"]]
    responses += [web.post("/jobs/nope/kill", data={"csrf_token": token}), web.post("/api/jobs/nope/kill"),
                  web.put("/"), web.post("/login", data={})]
    for r in responses:
        policy = csp(r.headers["Content-Security-Policy"])
        scripts = policy.get("script-src", policy["default-src"])
        assert "'self'" in scripts and not {"'unsafe-inline'", "'unsafe-eval'", "*", "data:"} & set(scripts)
        assert policy["frame-ancestors"] == ["'none'"] and r.headers["X-Frame-Options"] == "DENY"
        assert r.headers["X-Content-Type-Options"] == "nosniff"
        assert policy["object-src" if "object-src" in policy else "default-src"] in (["'none'"], ["'self'"])
    for r in responses[:8]:  # the pages need no inline script, so the policy breaks nothing
        body = r.get_data(as_text=True)
        assert not re.search(r"<script(?![^>]*\bsrc=)[^>]*>", body) and not re.search(r"\son[a-z]+=", body)


@pytest.mark.parametrize("next_url", ["//evil.example/x", "/\\evil.example", "https://evil.example",
                                      "/\t/evil.example", "javascript:alert(1)"])
def test_redirects_after_login_and_actions_stay_on_this_site(app, web, next_url):
    job = apps.add.delay(1, 2)
    r = web.post("/login", data={"password": "pw", "csrf_token": csrf(web), "next": next_url})
    assert r.status_code == 302 and r.headers["Location"].startswith("/") and "//" not in r.headers["Location"]
    assert "evil" not in r.headers["Location"] or r.headers["Location"].startswith("/%")
    token = csrf(web, "/")
    r = web.post(f"/jobs/{job.id}/kill", data={"csrf_token": token, "next": next_url})
    assert r.status_code == 302 and r.headers["Location"].startswith("/") and "//" not in r.headers["Location"]


def test_bind_check_reads_every_address_form():
    check_bind(["127.0.0.1:5000", "localhost", "[::1]:80", "unix:/tmp/x.sock", "::1", "[::1]", "127.0.0.2:80"], None)
    check_bind(["0.0.0.0:80", "[::]:80"], "pw")
    for address in ["0.0.0.0:5000", "10.1.2.3", "example.com:80", "::", "[::]:5000", "[::]", "::ffff:10.0.0.1", "0",
                    "", "fd://3"]:
        with pytest.raises(SystemExit, match="without a password"):
            check_bind([address], None)


@pytest.mark.parametrize("host", ["0.0.0.0", "::", socket.gethostname()])
def test_cli_refuses_to_serve_beyond_loopback_without_a_password(stack, host):
    r = stack.cli("dashboard", "--host", host, "--port", "0", timeout=30)
    assert r.returncode != 0 and "without a password" in r.stderr


@pytest.mark.parametrize("bind", ["0.0.0.0:0", "[::]:0"])
def test_gunicorn_hook_refuses_to_serve_beyond_loopback_without_a_password(stack, bind):
    env = {**stack.env, "TASKRUNNER_APP": "tests.apps", "TASKRUNNER_DASHBOARD_PASSWORD": ""}
    proc = subprocess.Popen([sys.executable, "-m", "gunicorn", "-c", "python:dashboard.gunicorn_conf", "-b", bind,
                             "dashboard:create_app()"], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        out, _ = proc.communicate(timeout=30)
    finally:
        proc.kill()
        proc.wait()
    assert proc.returncode != 0 and "without a password" in out
