"""The web dashboard: queues, workers, running and stuck jobs (with Kill), failures,
schedules; every page also as JSON under /api. It reads only what a page shows and never
imports Spark. `create_app()` reads TASKRUNNER_APP, REDIS_URL, TASKRUNNER_DASHBOARD_PASSWORD,
TASKRUNNER_DASHBOARD_TOKEN and TASKRUNNER_DASHBOARD_PROXIES (how many reverse proxies are in
front, e.g. 1 on Heroku; default 0) from the environment (gunicorn: "dashboard:create_app()")."""

from __future__ import annotations

import json
import logging
import os
import threading
from datetime import datetime, timezone
from typing import Any

import redis
from flask import Flask, g, jsonify, render_template, request
from jinja2 import Undefined
from werkzeug.exceptions import HTTPException, ServiceUnavailable
from werkzeug.middleware.proxy_fix import ProxyFix

from taskrunner import TaskRunner
from taskrunner.client.loader import load_app
from taskrunner.errors import AppNotFound
from taskrunner.ops.diagnose import explain
from taskrunner.protocol.outages import Outage

from . import charts, security, watch
from .views import api, pages

log = logging.getLogger("taskrunner.dashboard")


def create_app(runner: TaskRunner | None = None, password: str | None = None, token: str | None = None) -> Flask:
    if runner is None:
        try:
            runner = load_app(os.environ.get("TASKRUNNER_APP"))
        except AppNotFound as e:
            raise SystemExit(f"Error: {e}") from None  # one line in gunicorn's log, not a traceback
    web = Flask(__name__)
    # X-Forwarded-Proto/-Host may come from anyone: at worst a client gets a Secure cookie.
    # X-Forwarded-For is the address logins are counted by, so it is trusted only from the
    # TASKRUNNER_DASHBOARD_PROXIES proxies said to be in front (a client could set it).
    proxies = int(os.environ.get("TASKRUNNER_DASHBOARD_PROXIES") or 0)
    web.wsgi_app = ProxyFix(web.wsgi_app, x_for=proxies, x_proto=max(proxies, 1),  # type: ignore[method-assign]
                            x_host=max(proxies, 1))
    web.config.update(
        TR_RUNNER=runner,
        TR_PASSWORD=password if password is not None else os.environ.get("TASKRUNNER_DASHBOARD_PASSWORD", ""),
        TR_TOKEN=token if token is not None else os.environ.get("TASKRUNNER_DASHBOARD_TOKEN", ""),
        SESSION_COOKIE_HTTPONLY=True,
        SESSION_COOKIE_SAMESITE="Strict",
        SESSION_COOKIE_NAME="taskrunner_session",
        SECRET_KEY=os.environ.get("TASKRUNNER_DASHBOARD_SECRET"),  # else Sessions fetches the one in Redis
    )
    web.session_interface = security.Sessions()
    web.register_blueprint(pages)
    web.register_blueprint(api)
    web.register_blueprint(watch.watching)
    # The app a worker's command line should name in the hints (the one this dashboard loaded).
    app_spec = os.environ.get("TASKRUNNER_APP") or "yourapp"
    web.jinja_env.globals.update(csrf_token=security.csrf_token, app_name=runner.name, live_poll=watch.live,
                                 app_spec=app_spec)
    web.jinja_env.filters.update(ago=ago, exact=exact, duration=duration, json=pretty_json)

    @web.context_processor
    def flags() -> dict[str, Any]:
        from flask import session

        return {"can_act": bool(web.config["TR_PASSWORD"]) and bool(session.get("user")),
                "login_enabled": bool(web.config["TR_PASSWORD"]), "user": session.get("user")}

    @web.after_request
    def headers(response: Any) -> Any:
        response.headers["Content-Security-Policy"] = (
            "default-src 'self'; img-src 'self' data:; frame-ancestors 'none'; form-action 'self'; base-uri 'none'")
        response.headers["X-Content-Type-Options"] = "nosniff"
        response.headers["Referrer-Policy"] = "same-origin"
        response.headers["X-Frame-Options"] = "DENY"
        return response

    @web.errorhandler(HTTPException)
    def error(e: HTTPException) -> Any:
        if request.path.startswith("/api/") or request.accept_mimetypes.best == "application/json":
            return jsonify(error=e.description, status=e.code), e.code
        return render_template("error.html", error=e), e.code

    # An outage is logged once per process (one warning, one line when Redis is back), as
    # workers do: a warning per request added a line every 2 s for each open live page.
    outage, outage_lock = Outage("dashboard", log), threading.Lock()

    @web.errorhandler(redis.RedisError)
    @web.errorhandler(redis.exceptions.RedisClusterException)
    def redis_error(e: Exception) -> Any:
        """Redis down or misconfigured: a page that says so (503), not a bare 500."""
        problem = explain(e, runner.settings.redis_url)
        if problem is None:
            raise e
        g.redis_failed = True
        with outage_lock:
            outage.failed(problem.message, None, " (at each request)")
        return error(ServiceUnavailable(problem.message + (". This page works again once Redis answers."
                                                           if not problem.lasting else "")))

    @web.after_request
    def redis_back(response: Any) -> Any:
        """During an outage, a page that met no Redis error asks Redis whether it is back
        (one PING: it may not have used Redis). Not a static file's request: against a Redis
        that hangs (SIGSTOP, a partition) its PING waited out the socket timeout, 5 s for each
        stylesheet and script of the page that says Redis is down."""
        if outage.since is not None and not g.get("redis_failed") and request.endpoint != "static":
            try:
                runner.redis.ping()
            except (redis.RedisError, redis.exceptions.RedisClusterException):
                return response
            with outage_lock:
                outage.ok()
        return response

    return web


def _seconds(t: Any) -> float | None:
    """A time or duration from a record, or None when it is not a number (a corrupt record
    is shown as it is, never a 500)."""
    try:
        return float(t)
    except (TypeError, ValueError):
        return None


def ago(t: Any, now: float | None = None) -> str:
    """'12 s ago', '3 min ago', 'in 5 s'."""
    if not t:
        return "-"
    s = _seconds(t)
    if s is None:
        return str(t)
    now = now if now is not None else datetime.now(timezone.utc).timestamp()
    delta = now - s
    text = duration(abs(delta))
    return f"{text} ago" if delta >= 0 else f"in {text}"


def duration(seconds: Any) -> str:
    """'29 µs', '4.2 ms', '2.5 s', '12 s', '1.2 min', '12 min', '1.5 h', '2.0 d' (under a second:
    charts.seconds); '-' for none (a field a foreign declaration or record lacks), not 0."""
    if seconds is None or seconds == "":
        return "-"
    s = _seconds(seconds)
    if s is None:
        return str(seconds)
    if s < 1:
        return charts.seconds(s)
    if s < 60:
        return f"{s:.1f} s" if s < 10 else f"{s:.0f} s"
    if s < 3600:
        return f"{s / 60:.1f} min" if s < 600 else f"{s / 60:.0f} min"
    if s < 86400:
        return f"{s / 3600:.1f} h"
    return f"{s / 86400:.1f} d"


def pretty_json(value: Any) -> str:
    """JSON as text for a page (Jinja escapes it); unlike |tojson, < stays readable. A
    field the record lacks (written by a broken producer) shows as "-"."""
    if isinstance(value, Undefined):
        return "-"
    return json.dumps(value, ensure_ascii=False)


def exact(t: Any) -> str:
    if not t:
        return ""
    s = _seconds(t)
    try:
        return datetime.fromtimestamp(s, timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")  # type: ignore[arg-type]
    except (TypeError, ValueError, OverflowError, OSError):
        return str(t)
