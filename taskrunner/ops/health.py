"""Health checks for orchestrators (Kubernetes probes, load balancers), answered by the
dashboard and, with `--health-port`, by workers and dispatchers:

- liveness (`/healthz`): the process is up and, for a worker or dispatcher, its loop went
  round lately. It never asks Redis: a Redis outage must not get every worker restarted
  (they wait for Redis and go on by themselves).
- readiness (`/readyz`): Redis answers and a dispatcher made a pass lately (without one, dead
  workers' jobs are never requeued nor delayed jobs promoted).
Each answers 200 or 503 with a JSON object saying why."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import TYPE_CHECKING, Any

from taskrunner.ops import listing
from taskrunner.ops.diagnose import explain
from taskrunner.protocol.connection import server_time

if TYPE_CHECKING:
    from taskrunner.client.app import TaskRunner

Check = Callable[[], tuple[bool, dict[str, Any]]]


def readiness(app: TaskRunner) -> tuple[bool, dict[str, Any]]:
    """(ready, why): Redis answers and at least one dispatcher is healthy."""
    try:
        now = server_time(app.redis)
        found = listing.dispatchers(app, now)
    except Exception as e:  # any failure to read Redis is "not ready", said in one line
        problem = explain(e, app.settings.redis_url)
        return False, {"ready": False, "reason": problem.message if problem else f"Redis: {e}"}
    healthy = [d for d in found if d["healthy"]]
    if not healthy:
        late = f"; the latest passed {found[0]['age']:.0f} s ago" if found else ""
        return False, {"ready": False, "reason": f"no dispatcher made a pass lately{late} (start "
                       "`taskrunner dispatcher`: without one, dead workers' jobs are not requeued)"}
    return True, {"ready": True, "dispatchers": len(healthy)}


def liveness(looped_ago: Callable[[], float], limit: float, what: str) -> Check:
    """A check that the loop of `what` went round within `limit` seconds."""
    def check() -> tuple[bool, dict[str, Any]]:
        ago = looped_ago()
        if ago > limit:
            return False, {"alive": False, "reason": f"the {what}'s loop last went round {ago:.0f} s ago "
                           f"(more than {limit:g} s)"}
        return True, {"alive": True}
    return check


def parse_address(text: str) -> tuple[str, int]:
    """`PORT` or `HOST:PORT` (loopback when no host is given: a pod's probes need
    `0.0.0.0:PORT`)."""
    host, _, port = text.rpartition(":")
    host = host.strip("[]") or "127.0.0.1"
    if not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ValueError(f"expected PORT or HOST:PORT (a port from 0 to 65535), not {text!r}")
    return host, int(port)


def serve(address: tuple[str, int], checks: dict[str, Check]) -> ThreadingHTTPServer:
    """Answer GET <path> for each of `checks` ({"/healthz": ..., "/readyz": ...}) from a
    daemon thread; returns the server (its server_address has the port when 0 was asked)."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (http.server's name)
            check = checks.get(self.path.split("?", 1)[0])
            ok, body = check() if check else (False, {"error": f"no such path; try {', '.join(checks)}"})
            data = json.dumps(body).encode()
            self.send_response(200 if ok else 404 if check is None else 503)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, format: str, *args: Any) -> None:  # probes every few seconds: not logged
            pass

    server = ThreadingHTTPServer(address, Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, name="taskrunner-health", daemon=True).start()
    return server
