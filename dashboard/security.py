"""Who may change things, and how we know the request is theirs.

- HTML forms: a login (password from TASKRUNNER_DASHBOARD_PASSWORD) in a signed session
  cookie (HttpOnly, SameSite=Strict, Secure over HTTPS), a CSRF token per session, and a
  same-origin check (Sec-Fetch-Site, else Origin).
- JSON API: `Authorization: Bearer <TASKRUNNER_DASHBOARD_TOKEN>`.
- Neither configured: read-only.
All state lives in Redis (the session key, login attempts), so gunicorn workers agree."""

from __future__ import annotations

import hmac
import os
import secrets
from collections.abc import Callable
from functools import wraps
from typing import Any

import redis
from flask import abort, current_app, request, session
from flask.sessions import NullSession, SecureCookieSessionInterface

#: Failed logins allowed per client address per minute; then 429.
LOGIN_ATTEMPTS = 5


class Sessions(SecureCookieSessionInterface):
    """Secure cookies whenever the request came over HTTPS (behind a proxy too), signed
    with the key kept in Redis, fetched at the first request that finds Redis up: a
    dashboard started while Redis is down serves pages that say so, and sessions once
    Redis is back (till then, none: nobody can log in or act)."""

    def get_cookie_secure(self, app: Any) -> bool:
        return request.is_secure

    def get_signing_serializer(self, app: Any) -> Any:
        if not app.secret_key:
            try:
                app.secret_key = secret_key(app.config["TR_RUNNER"])
            except (redis.RedisError, redis.exceptions.RedisClusterException):
                return None
        return super().get_signing_serializer(app)


def secret_key(runner: Any) -> str:
    """One signing key for every dashboard process, made once and kept in Redis."""
    key = runner.keys.g + "dashboard:secret"
    runner.redis.set(key, secrets.token_hex(32), nx=True)
    return runner.redis.get(key)


def csrf_token() -> str:
    if isinstance(session, NullSession):  # no signing key: Redis was down when the request came
        current_app.config["TR_RUNNER"].redis.ping()  # still down: the page says why
        abort(503, "Redis was unreachable a moment ago: reload the page")
    if "csrf" not in session:
        session["csrf"] = secrets.token_urlsafe(32)
    return session["csrf"]


def same_origin() -> bool:
    """Browsers say where a request comes from; refuse anything not from this site."""
    site = request.headers.get("Sec-Fetch-Site")
    if site is not None:
        return site in ("same-origin", "none")
    origin = request.headers.get("Origin")
    if origin is not None:
        return origin == request.host_url.rstrip("/")
    return True  # no browser signal at all (curl, old browsers): the CSRF token decides


def password_ok(password: str) -> bool:
    expected = current_app.config["TR_PASSWORD"]
    return bool(expected) and hmac.compare_digest(password.encode(), expected.encode())


def login_attempt(runner: Any) -> bool:
    """Count a login attempt of this client address in Redis, before the password is
    looked at: INCR is atomic, so parallel guesses cannot all pass a read-then-count
    check. False once the address used its LOGIN_ATTEMPTS of the last minute."""
    key = f"{runner.keys.g}dashboard:logins:{request.remote_addr}"
    n, _ = runner.redis.pipeline(transaction=False).incr(key).expire(key, 60).execute()
    return n <= LOGIN_ATTEMPTS


def login_succeeded(runner: Any) -> None:
    """Only failures count: a good password gives its attempt back."""
    runner.redis.decr(f"{runner.keys.g}dashboard:logins:{request.remote_addr}")


def csrf_ok() -> bool:
    """The form's CSRF token is this session's (compared in constant time, as bytes: a
    str with non-ASCII characters would make compare_digest raise)."""
    token = request.form.get("csrf_token", "")
    return bool(token) and hmac.compare_digest(token.encode(), session.get("csrf", "").encode())


def who() -> str:
    user = "api" if request.headers.get("Authorization") else session.get("user", "?")
    return f"{user}@{request.remote_addr}"


def form_action(view: Callable) -> Callable:
    """POST from a dashboard form: logged in, same origin, valid CSRF token."""

    @wraps(view)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if not current_app.config["TR_PASSWORD"]:
            abort(403, "the dashboard is read-only: set TASKRUNNER_DASHBOARD_PASSWORD to act")
        if not session.get("user"):
            abort(401, "log in first")
        if not same_origin():
            abort(403, "cross-site request refused")
        if not csrf_ok():
            abort(403, "missing or wrong CSRF token: reload the page and try again")
        return view(*args, **kwargs)

    return wrapper


def api_action(view: Callable) -> Callable:
    """POST to the JSON API: the bearer token."""

    @wraps(view)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        expected = current_app.config["TR_TOKEN"]
        if not expected:
            abort(403, "the API is read-only: set TASKRUNNER_DASHBOARD_TOKEN to act")
        if not _bearer(expected):
            abort(401, "missing or wrong bearer token")
        return view(*args, **kwargs)

    return wrapper


def metrics_allowed() -> None:
    """GET /metrics: open, or with TASKRUNNER_METRICS_TOKEN set, only with that bearer token
    (not the API's: a scraper that can read metrics must not be able to act)."""
    expected = os.environ.get("TASKRUNNER_METRICS_TOKEN", "")
    if not expected:
        return
    if not _bearer(expected):
        abort(401, "missing or wrong bearer token (TASKRUNNER_METRICS_TOKEN)")


def _bearer(expected: str) -> bool:
    """The request carries `Authorization: Bearer <expected>` (compared in constant time)."""
    given = request.headers.get("Authorization", "")
    return given.startswith("Bearer ") and hmac.compare_digest(given[7:].encode(), expected.encode())


def check_bind(addresses: list[str], password: str | None) -> None:
    """Refuse to serve beyond this machine without a password: job arguments are data."""
    import ipaddress

    if password:
        return
    for address in addresses:
        if address.startswith("unix:"):
            continue
        host = address
        if address.startswith("["):  # [v6]:port or [v6]
            host = address[1:address.find("]")]
        elif address.count(":") == 1:  # host:port (a bare v6 address has more colons)
            host = address.split(":")[0]
        if host == "localhost":
            continue
        try:
            loopback = ipaddress.ip_address(host).is_loopback
        except ValueError:
            loopback = False
        if not loopback:
            raise SystemExit(f"refusing to serve the dashboard on {address} without a password: set "
                             "TASKRUNNER_DASHBOARD_PASSWORD (or bind to 127.0.0.1)")
