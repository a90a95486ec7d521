"""Live list pages: what changed since the page was drawn, cheaply, so that a page that
waits polls `GET /api/version/<page>` (live.js, every few seconds, only while the tab is
shown) and refreshes in place or says "N new — reload", keeping the boxes ticked and the
scroll. Each page's version is read from counts and a page of ids at most, never job
records (but a worker's, from the jobs its heartbeat lists, and a workflow's, from the states
of the graph its page draws): {"version": text, "total": jobs the page lists, "new": jobs since `since`} (`since`:
the version the page was drawn with). A version is "<total>:<what else changes>".

The pages that refresh themselves from HTML fragments (the overview, Running, Stuck, a job)
are not watched here: their fragment is their poll."""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from typing import Any

from flask import Blueprint, abort, jsonify, request
from werkzeug.exceptions import HTTPException

from taskrunner.ops import listing
from taskrunner.ops.queue import backlogs

from . import views

watching = Blueprint("watch", __name__, url_prefix="/api/version")


def _digest(*parts: Any) -> str:
    return hashlib.sha1(repr(parts).encode()).hexdigest()[:12]


def _total_of(version: str | None) -> int | None:
    try:
        return int((version or "").split(":", 1)[0])
    except ValueError:
        return None


def failed() -> dict[str, Any]:
    """Failed or killed jobs of the page's filter: a ZCARD and the newest score per queue;
    `new` counts those that ended after the newest the page showed (a ZCOUNT per queue)."""
    f = views.failure_filter({k: v for k, v in request.args.items() if k in ("state", "queue", "task", "error")})
    app = views.runner()
    queues = f.queues(app)
    pipe = app.redis.pipeline(transaction=False)
    for q in queues:
        pipe.zcard(f.key(app, q))
        pipe.zrevrange(f.key(app, q), 0, 0, withscores=True)
    res = pipe.execute() if queues else []
    total = sum(res[0::2])
    newest = max((t for top in res[1::2] for _, t in top), default=0.0)
    version = f"{total}:{newest!r}"
    since = request.args.get("since")
    new = 0
    try:
        then = float((since or "").split(":", 1)[1])
    except (IndexError, ValueError):
        then = None
    if then is not None and newest > then:
        for q in queues:
            pipe.zcount(f.key(app, q), f"({then!r}", "+inf")
        new = sum(pipe.execute())
    return {"version": version, "total": total, "new": new}


def queue(name: str) -> dict[str, Any]:
    """A queue's page of one state: its count per shard and the ids of the page (as the page
    reads them, without their records)."""
    views.queue_arg(name)
    state = request.args.get("state", "pending")
    if state not in ("pending", "delayed", "waiting", *views.FINISHED):
        abort(400, "state must be pending, delayed, waiting, completed, failed, killed or canceled")
    app = views.runner()
    total, rows = listing.page_ids(app, name, state, (views.page_arg() - 1) * views.PAGE, views.PAGE)
    paused = app.redis.hget(app.keys.q(name) + "meta", "paused")
    return _counted(total, _digest([r["id"] for r in rows], paused))


def workers() -> dict[str, Any]:
    """The workers page: each worker's name, state and figures (O(workers))."""
    rows = listing.workers(views.runner())
    return _counted(len(rows), _digest([(w["name"], w["state"], w.get("busy"), w.get("processed"))
                                        for w in rows]))


def worker(name: str) -> dict[str, Any]:
    """One worker's page: its state and figures, its children (a job that ends or starts
    moves `busy` or `processed`): its heartbeat, not its jobs (O(workers))."""
    w = views.find_worker(name, jobs=0)
    return _counted(w.get("busy") or 0, _digest(w["state"], w.get("busy"), w.get("processed"), w.get("children")))


def searched() -> dict[str, Any]:
    """A search's results: the number of jobs of the searched states, per queue (a count
    each; the search itself reads up to search.BUDGET records, too many to poll). Two round
    trips at most, whatever the number of queues: the sets' ZCARDs with each queue's
    priorities, then the LLENs of the pending lists those give."""
    text, states, _ = views.search_args()
    app = views.runner()
    queues = sorted(app.queue_names())
    cells = [(q, s) for q in queues for s in states]
    pipe = app.redis.pipeline(transaction=False)
    for q, s in cells:
        if s == "pending":
            pipe.hget(app.keys.q(q) + "meta", "priorities")
        else:
            pipe.zcard(app.keys.q(q) + s)
    first = pipe.execute() if cells else []
    pending = [i for i, (_, s) in enumerate(cells) if s == "pending"]
    lengths = dict(zip(pending, backlogs(app, [cells[i][0] for i in pending], [first[i] for i in pending])))
    counts = [lengths.get(i, n) for i, n in enumerate(first)]
    return _counted(sum(counts), _digest(text, counts))


def history() -> dict[str, Any]:
    """The History page: the latest analysis's time."""
    from taskrunner.ops import analyze

    summary = analyze.latest(views.runner()) or {}
    return _counted(summary.get("records") or 0, _digest(summary.get("generated_at")))


def workflow(job_id: str) -> dict[str, Any]:
    """A workflow's page: the state of each of its jobs (the graph the page draws, as bounded)."""
    from taskrunner.ops.workflow import graph

    views.find_job(job_id)
    g = graph(views.runner(), job_id)
    return _counted(len(g["jobs"]), _digest([(n["id"], n["state"]) for n in g["jobs"]]))


def _counted(total: int, rest: str) -> dict[str, Any]:
    """The answer of a page whose `new` is how many more jobs it lists than at `since`."""
    then = _total_of(request.args.get("since"))
    return {"version": f"{total}:{rest}", "total": total, "new": max(0, total - then) if then is not None else 0}


#: A watched page's endpoint -> (its version, whether the page refreshes itself when it
#: changes: a page of things now, not a list that grows; else it says "N new — reload").
PAGES: dict[str, tuple[Callable[..., dict[str, Any]], bool]] = {
    "pages.failed": (failed, False), "pages.queue": (queue, True), "pages.workers": (workers, True),
    "pages.worker": (worker, True), "pages.search": (searched, False), "pages.history": (history, False),
    "pages.workflow": (workflow, True)}

# Each watched page's poll is at /api/version + the page's path, with the page's query and
# `since`: /api/version/failed?state=&queue=&task=&error=, /api/version/queues/<name>?state=&page=,
# /api/version/workers, /api/version/workers/<name>, /api/version/search?q=&state=,
# /api/version/history, /api/version/workflows/<id>.


def _poll(version: Callable[..., dict[str, Any]]) -> Callable[..., Any]:
    def view(**kwargs: Any) -> Any:
        return jsonify(version(**kwargs))

    return view


for _endpoint, _rule in (("failed", "/failed"), ("queue", "/queues/<name>"), ("workers", "/workers"),
                         ("worker", "/workers/<name>"), ("search", "/search"), ("history", "/history"),
                         ("workflow", "/workflows/<job_id>")):
    watching.add_url_rule(_rule, _endpoint, _poll(PAGES["pages." + _endpoint][0]))


def live() -> dict[str, Any] | None:
    """For base.html: the poll of the page being drawn, {"url", "version", "auto"}, or None
    when it is not a watched page (an error page among them) or its poll would answer an
    error (a gone worker's page: no worker to watch)."""
    entry = PAGES.get(request.endpoint or "")
    if entry is None or request.args.get("fragment"):
        return None
    try:
        answer = entry[0](**(request.view_args or {}))
    except HTTPException:  # a page drawn for what its poll finds not there (a gone worker's)
        return None
    query = request.query_string.decode()
    return {"url": "/api/version" + request.path + ("?" + query if query else ""), "version": answer["version"],
            "auto": entry[1]}
