"""Pages and the JSON API. Each page has a JSON twin built from the same read model
(taskrunner.ops.listing); actions go through the same Job methods as the CLI."""

from __future__ import annotations

import logging
import re
import time
from typing import Any

from flask import (
    Blueprint,
    Response,
    abort,
    current_app,
    flash,
    jsonify,
    redirect,
    render_template,
    request,
    session,
    url_for,
)

from taskrunner.client import declarations
from taskrunner.client.job import Job
from taskrunner.errors import InvalidName, JobNotFound, TaskRunnerError
from taskrunner.ops import failures, listing
from taskrunner.ops import queue as taskqueue
from taskrunner.ops import search as searching
from taskrunner.protocol import codec
from taskrunner.protocol import shards as sharding
from taskrunner.protocol.connection import server_time

from . import security

log = logging.getLogger("taskrunner.dashboard")
pages = Blueprint("pages", __name__)
api = Blueprint("api", __name__, url_prefix="/api")
PAGE = 50
ACTIONS = ("kill", "retry", "requeue", "delete", "enqueue-now")
QUEUE_ACTIONS = ("purge", "close", "open", "pause", "resume")
SCHEDULE_ACTIONS = ("pause", "resume", "run-now", "delete")
#: A worker's actions, and the control message each sends it (the worker acts as on SIGTERM,
#: or requeues its running jobs at once).
WORKER_ACTIONS = {"stop": "graceful", "stop-now": "now"}
FINISHED = ("completed", "failed", "killed", "canceled")


def runner() -> Any:
    return current_app.config["TR_RUNNER"]


def page_arg() -> int:
    try:
        page = int(request.args.get("page", "1"))
    except ValueError:
        abort(400, "page must be a whole number")
    if page < 1:
        abort(400, "page must be 1 or more")
    return page


def queue_arg(name: str | None) -> str | None:
    if name is None:
        return None
    try:
        codec.check_queue(name)  # a shard too (a job's page links to the shard it is in): that shard alone
    except InvalidName as e:
        abort(404, str(e))
    if name not in runner().queue_names():
        abort(404, f"no queue {name!r}")
    return name


def find_job(job_id: str) -> Job:
    try:
        return runner().job(job_id)
    except (JobNotFound, InvalidName) as e:
        abort(404, str(e))


def local_path(target: str, default: str) -> str:
    """Where a form goes back to: a path on this site, else `default`. Browsers drop tabs
    and newlines from URLs and read \\ as /, so "/\\t/evil.example" would leave the site."""
    if target.startswith("/") and not target.startswith("//") and not re.search(r"[\x00-\x20\\]", target):
        return target
    return default


def pager(total: int, page: int) -> dict[str, Any]:
    pages_ = max(1, -(-total // PAGE))
    return {"page": page, "pages": pages_, "total": total, "prev": page - 1 if page > 1 else None,
            "next": page + 1 if page < pages_ else None}


def act(job: Job, action: str, who: str) -> tuple[bool, str]:
    """Carry out an action; (done, message). Logged and kept in an audit list in Redis."""
    if action not in ACTIONS:
        abort(404, f"no action {action!r}")
    if action == "kill":
        state = job.kill(who)  # "already <state>": it had ended, nothing done (audited as refused)
        done, message = state in ("killed", "running"), {
            "killed": "killed", "running": "kill requested: its worker is stopping it"}.get(
            state, f"already ended: {state.removeprefix('already ')}")
    elif action == "retry":
        try:
            done = job.retry(who)
            message = "queued again" if done else job.why_not_retried()
        except TaskRunnerError as e:  # a step that could never run
            done, message = False, str(e)
    elif action == "requeue":
        done = job.requeue(who)
        message = "back in line" if done else "only delayed or running jobs can be requeued"
    elif action == "enqueue-now":
        try:
            before = job.enqueue_now(who)
        except JobNotFound as e:  # deleted, or its record expired, since find_job()
            abort(404, str(e))
        done = before == "delayed"
        message = "enqueued now: next in line" if done else (
            f"it is {before}, not delayed: only a delayed job can be enqueued now")
    else:
        done = job.delete()
        message = "deleted" if done else "a running job cannot be deleted: kill it first"
    audit(f"{action} {job.id} ({job.queue})", who, done)
    return done, message


def queue_act(name: str, action: str, who: str) -> dict[str, Any]:
    """Purge, close, open, pause or resume a queue; {"message": ..., and for purge "deleted": n}.
    Audited."""
    if action not in QUEUE_ACTIONS:
        abort(404, f"no queue action {action!r}")
    queue_arg(name)
    if action == "purge":
        n = runner().purge(name)
        out: dict[str, Any] = {"deleted": n, "message": f"{n} pending jobs deleted"}
    elif action == "close":
        taskqueue.close(runner(), name)
        out = {"message": "closed: it takes no new jobs (queued ones still run)"}
    elif action == "open":
        taskqueue.open(runner(), name)
        out = {"message": "open: it takes new jobs"}
    elif action == "pause":
        taskqueue.pause(runner(), name)
        out = {"message": "paused: workers claim none of its jobs (it still takes new ones)"}
    else:
        taskqueue.resume(runner(), name)
        out = {"message": "resumed: workers claim its jobs again"}
    audit(f"{action} {name}" + (f" ({out['deleted']} jobs)" if action == "purge" else ""), who, True)
    return out


def schedule_act(name: str, action: str, who: str) -> dict[str, Any]:
    """Pause, resume, run now or delete a schedule (taskrunner/ops/schedules.py); audited."""
    from taskrunner.ops import schedules

    if action not in SCHEDULE_ACTIONS:
        abort(404, f"no schedule action {action!r}")
    try:
        if action in ("pause", "resume"):
            schedules.pause(runner(), name, action == "pause")
            out: dict[str, Any] = {"message": "paused" if action == "pause" else "resumed: it fires from its next tick"}
        elif action == "run-now":
            job = schedules.run_now(runner(), name)
            out = {"message": f"enqueued job {job.id}", "job": job.id}
        else:
            out = {"message": schedules.delete(runner(), name).split(": ", 1)[1]}
    except schedules.ScheduleNotFound as e:
        abort(404, str(e))
    except (schedules.ScheduleInCode, ValueError) as e:  # deleting one that code declares, ...
        abort(409, str(e))
    audit(f"{action} schedule {name}", who, True)
    return out


#: A bulk action over a filter runs batches for at most this long per request.
BULK_SECONDS = 10.0


def bulk(action: str, body: Any) -> dict[str, Any]:
    """Retry or delete failed (or killed) jobs: `{"ids": [...], "state"?}` or `{"filter":
    {...}, "cursor"?, "limit"?}`; the counts, `left` and the `cursor` to go on with. With a
    filter and no limit it runs batches of failures.BATCH_MAX for up to BULK_SECONDS.
    Audited: one entry per call."""
    if action not in ("retry", "delete"):
        abort(404, f"no bulk action {action!r}: use retry or delete")
    if not isinstance(body, dict) or ("ids" in body) == ("filter" in body):
        abort(400, 'send {"ids": [...]} or {"filter": {"state", "queue", "task", "error"}}')
    who = security.who()
    if "ids" in body:
        ids, state = body["ids"], body.get("state") or "failed"
        if not isinstance(ids, list) or not all(isinstance(i, str) for i in ids) or len(ids) > failures.BATCH_MAX:
            abort(400, f"ids must be a list of at most {failures.BATCH_MAX} job ids")
        if state not in failures.STATES:
            abort(400, "state must be failed or killed")
        out = failures.act_on_ids(runner(), action, state, ids, who)
        audit(f"{action} {out['done']} {state} jobs (selected)", who, bool(out["done"]))
        return out
    f = failure_filter(body["filter"])
    try:
        cursor = failures.Cursor.parse(body.get("cursor"))
        limit = int(body.get("limit") or 0)
    except (TypeError, ValueError) as e:
        abort(400, str(e) if "cursor" in str(e) else "limit must be a whole number")
    if not 0 <= limit <= failures.BATCH_MAX:
        abort(400, f"limit must be 1 to {failures.BATCH_MAX}")
    deadline = time.monotonic() + BULK_SECONDS
    total: dict[str, Any] = {"done": 0, "refused": 0, "gone": 0, "errors": []}
    while True:
        out = failures.act_on_filter(runner(), action, f, cursor, limit or failures.BATCH_MAX, who)
        for k in ("done", "refused", "gone"):
            total[k] += out[k]
        total["errors"] = (total["errors"] + out["errors"])[:5]
        cursor = failures.Cursor.parse(out["cursor"])
        if cursor is None or limit or time.monotonic() > deadline:
            break
    what = " ".join(f"{k}={v}" for k, v in f.as_dict().items())
    audit(f"{action} {total['done']} jobs matching {what}", who, bool(total["done"]))
    return {**total, "left": out["left"], "cursor": out["cursor"]}


def lookup_worker(name: str, jobs: int = 100) -> dict[str, Any] | None:
    """The worker, with up to `jobs` of the jobs it runs (those it has held longest); None
    when none is listed; 404 for a name that cannot be one."""
    try:
        codec.check_name("worker", name)
    except InvalidName as e:
        abort(404, str(e))
    return listing.worker(runner(), name, jobs)


def find_worker(name: str, jobs: int = 100) -> dict[str, Any]:
    """The worker, as lookup_worker() gives it; 404 when there is none."""
    w = lookup_worker(name, jobs)
    if w is None:
        abort(404, no_worker(name))
    return w


def no_worker(name: str) -> str:
    return f"no worker {name!r} (never started, stopped, or dead for over an hour)"


#: A gone worker's page looks for its jobs among this many of the newest of each ended
#: state (completed, failed, killed) of each queue, and among GONE_BUDGET records in all
#: (fewer of each when there are many queues or shards): a bounded read, whatever their
#: number, also for a visitor who is not logged in.
GONE_SCAN = 200
GONE_BUDGET = 2000


def _time(v: Any) -> float | None:
    """A time from a record, None when it is not a number (a missing field)."""
    try:
        return float(v)
    except (TypeError, ValueError):
        return None


def gone_worker(name: str, limit: int = 100) -> dict[str, Any]:
    """What the queues still know of a worker that has no record (it stopped, or died over
    an hour ago; a job's "ran on" links to it): the jobs whose last delivery it ran, among
    the GONE_SCAN newest of each ended state of each queue (their records: the history
    stream is archived every few seconds), newest first, up to `limit`; how many; and when
    the last of them ended ("last_seen", None when none is found)."""
    app = runner()
    cells = [(q, s) for q in app.queue_names() for s in ("completed", "failed", "killed")]
    each = max(1, min(GONE_SCAN, GONE_BUDGET // max(len(cells), 1)))
    pipe = app.redis.pipeline(transaction=False)
    for q, s in cells:
        pipe.zrevrange(app.keys.q(q) + s, 0, each - 1)
    rows = [{"id": i, "queue": q} for (q, _), ids in zip(cells, pipe.execute() if cells else []) for i in ids]
    fields = ("worker", "task", "state", "attempts", "pid", "started_at", "finished_at")
    ran = []
    for r, values in zip(rows, listing.hmget(app, rows, *fields)):
        d = dict(zip(fields, values))
        if d.pop("worker") == name:
            ran.append({**r, **d, "started_at": _time(d["started_at"]), "finished_at": _time(d["finished_at"])})
    ran.sort(key=lambda r: r["finished_at"] or 0, reverse=True)
    return {"last_seen": ran[0]["finished_at"] if ran else None, "jobs": ran[:limit], "known": len(ran),
            "scan": each}


def worker_act(name: str, action: str, who: str) -> dict[str, Any]:
    """Ask a live worker to stop: gracefully (its running jobs have its shutdown grace to
    finish) or now (they go back in line at once). Audited."""
    if action not in WORKER_ACTIONS:
        abort(404, f"no worker action {action!r}: use stop or stop-now")
    w = find_worker(name, jobs=0)
    if w["state"] != "alive":
        abort(409, f"worker {name} is not alive: nothing to stop")
    if w.get("kind"):  # a consumer ("consumer": ours, "node": the Node client) reads kill messages only
        abort(409, f"{name} is a {w['kind']} consumer, not a worker: it takes no stop message; "
                   f"stop its process (PID {w.get('pid', '?')} on {w.get('host', '?')}) instead")
    runner().send_control(name, {"stop": WORKER_ACTIONS[action], "who": who})
    audit(f"{action} worker {name}", who, True)
    return {"message": "stopping: its running jobs have its shutdown grace to finish" if action == "stop"
            else "stopping now: its running jobs go back in line"}


def audit(what: str, who: str, done: bool) -> None:
    r = runner()
    log.warning("dashboard: %s by %s: %s", what, who, "done" if done else "refused")
    entry = codec.dumps({"at": time.time(), "who": who, "what": what, "done": done})
    r.redis.pipeline(transaction=False).lpush(r.keys.g + "audit", entry).ltrim(r.keys.g + "audit", 0, 999).execute()


# -- pages -----------------------------------------------------------------------------


@pages.get("/")
def overview() -> str:
    data = listing.overview(runner())
    return render_template("overview.html" if not request.args.get("fragment") else "_overview.html", **data)


@pages.get("/running")
def running() -> str:
    page = page_arg()
    total, rows = listing.running(runner(), None, (page - 1) * PAGE, PAGE)
    return render_template("running.html" if not request.args.get("fragment") else "_running.html",
                           rows=rows, pager=pager(total, page), now=server_time(runner().redis),
                           title="Running", live=url_for("pages.running", page=page, fragment=1))


@pages.get("/stuck")
def stuck() -> str:
    page = page_arg()
    total, rows = listing.running(runner(), None, (page - 1) * PAGE, PAGE, only_stuck=True)
    return render_template("running.html" if not request.args.get("fragment") else "_running.html",
                           rows=rows, pager=pager(total, page), now=server_time(runner().redis),
                           title="Stuck", live=url_for("pages.stuck", page=page, fragment=1))


def failure_filter(raw: dict[str, Any] | None = None) -> failures.Filter:
    """The Failed page's filter from the query string (or a form, an API body): 400 with the
    reason when a field is not one; 404 for a queue that does not exist."""
    try:
        f = failures.Filter.parse(raw if raw is not None else dict(request.args.items()))
    except ValueError as e:
        abort(400, str(e))
    queue_arg(f.queue)
    return f


def failed_page(f: failures.Filter) -> dict[str, Any]:
    """One page of the filter's jobs, its pager, and the tasks and error types to filter by."""
    page = page_arg()
    total, rows = failures.page(runner(), f, (page - 1) * PAGE, PAGE)
    return {"rows": rows, "pager": pager(total, page), "facets": failures.facets(runner(), f.state, f.queue)}


@pages.get("/failed")
def failed() -> str:
    """Failed (or killed) jobs, filtered by queue, task and error type, each from its index
    (taskrunner/ops/failures.py): a page costs the same at any number of jobs."""
    f = failure_filter({k: v for k, v in request.args.items() if k != "page"})
    data = failed_page(f)
    base = url_for("pages.failed", **f.as_dict())
    # The queues as users name them (a sharded one once: its filter takes every shard), and
    # the shard the filter names, if it names one (a link from a job's page).
    queues = [q for q in runner().queue_names() if not sharding.is_shard(q) or q == f.queue]
    return render_template("failed.html", title=f.state.capitalize(), state=f.state, filter=f,
                           base=base + ("&" if "?" in base else "?"), queues=queues,
                           now=server_time(runner().redis), **data)


@pages.get("/search")
def search() -> Any:
    """The header's search box: a job id opens the job; other text lists the tasks and the
    jobs whose task or arguments contain it (taskrunner/ops/search.py)."""
    text, states, after = search_args()
    found = job_by_id(text)
    if found is not None:
        return redirect(url_for("pages.job", job_id=found))
    result = run_search(text, states, after)
    base = url_for("pages.search", q=text, state=list(states))
    return render_template("search.html", title="Search", q=text, states=states, result=result,
                           all_states=searching.STATES, base=base, now=server_time(runner().redis))


def search_args() -> tuple[str, tuple[str, ...], searching.Cursor]:
    text = request.args.get("q", "").strip()
    if not text:
        abort(400, "q must be a job id or some text to look for")
    if len(text) > searching.TEXT_MAX:
        abort(400, f"q must be at most {searching.TEXT_MAX} characters")
    states = tuple(request.args.getlist("state")) or searching.DEFAULT_STATES
    bad = [s for s in states if s not in searching.STATES]
    if bad:
        abort(400, f"state must be among {', '.join(searching.STATES)}")
    try:
        after = searching.Cursor.parse(request.args.get("after"))
    except ValueError as e:
        abort(400, str(e))
    return text, tuple(dict.fromkeys(states)), after


def job_by_id(text: str) -> str | None:
    """The text, when it is the id of a job."""
    try:
        return runner().job(text).id
    except (JobNotFound, InvalidName):
        return None


def run_search(text: str, states: tuple[str, ...], after: searching.Cursor) -> dict[str, Any]:
    return searching.search(runner(), text, states, after, limit=PAGE)


@pages.get("/queues/<name>")
def queue(name: str) -> str:
    queue_arg(name)
    state = request.args.get("state", "pending")
    if state not in ("pending", "delayed", "waiting", *FINISHED):
        abort(400, "state must be pending, delayed, waiting, completed, failed, killed or canceled")
    page = page_arg()
    total, rows = listing.page_of(runner(), name, state, (page - 1) * PAGE, PAGE)
    shards = listing.shard_stats(runner(), name)  # each state's count for its tab, per shard
    return render_template("jobs.html", rows=rows, pager=pager(total, page), title=f"Queue {name}",
                           state=state, queue=name, now=server_time(runner().redis),
                           info=taskqueue.combined(shards), shards=shards)


@pages.get("/workflows/<job_id>")
def workflow(job_id: str) -> str:
    """The workflow a job belongs to, drawn as an SVG on the server (taskrunner/ops/workflow.py)."""
    from markupsafe import Markup

    from taskrunner.ops.workflow import graph, svg

    find_job(job_id)  # 404 for an unknown or invalid id
    g = graph(runner(), job_id)
    return render_template("workflow.html", g=g, drawing=Markup(svg(g)), root=job_id)  # svg() escapes its text


@pages.get("/jobs/<job_id>")
def job(job_id: str) -> str:
    j = find_job(job_id)
    return render_template("_job.html" if request.args.get("fragment") else "job.html", job=j.to_dict(),
                           now=server_time(runner().redis))


@pages.get("/workers")
def workers() -> str:
    return render_template("workers.html", title="Workers", workers=listing.workers(runner()),
                           now=server_time(runner().redis))


@pages.get("/workers/<name>")
def worker(name: str) -> Any:
    """A worker's page; for one with no record (stopped, or dead over an hour: a job's
    "ran on" still names it) a 404 that says it is gone, when it was last seen and the jobs
    it ran that are still kept, rather than a bare "not found"."""
    w = lookup_worker(name)
    now = server_time(runner().redis)
    if w is None:
        return render_template("worker_gone.html", title=f"Worker {name}", name=name, now=now,
                               **gone_worker(name)), 404
    return render_template("worker.html", title=f"Worker {name}", w=w, now=now)


@pages.get("/schedules")
def schedules() -> str:
    from taskrunner.ops.schedules import rows

    return render_template("schedules.html", schedules=rows(runner()),
                           now=server_time(runner().redis))


@pages.get("/tasks")
def tasks() -> str:
    return render_template("tasks.html", tasks=declarations.known(runner()), now=server_time(runner().redis))


@pages.get("/history")
def history() -> str:
    from taskrunner.ops import analyze

    from . import charts

    summary = analyze.latest(runner())
    extra = {}
    if summary:
        tasks = summary["tasks"][:20]
        hours = [(h["hour"][5:13].replace("T", " ") + "h", h["count"]) for h in summary["hours"]]
        runtimes = [(t["task"], [t["runtime_p50"], t["runtime_p95"], t["runtime_p99"]]) for t in tasks]
        extra = {
            "throughput": charts.columns(hours, "Throughput per hour", charts.per("h"),
                                         axis="jobs finished (UTC hour)"),
            "runtimes": charts.bars(runtimes, ["p50", "p95", "p99"], "Runtime percentiles per task (log scale)",
                                    charts.seconds, log=True),
            "failures": charts.bars([(t["task"], [100 * t["failed_rate"], 100 * t["killed_rate"]]) for t in tasks],
                                    ["failed", "killed"], "Failure rate per task (% of its jobs)", charts.percent),
        }
    return render_template("history.html", summary=summary, now=server_time(runner().redis), **extra)


@pages.route("/login", methods=["GET", "POST"])
def login() -> Any:
    if not current_app.config["TR_PASSWORD"]:
        abort(404, "logins are off: set TASKRUNNER_DASHBOARD_PASSWORD to enable actions")
    if request.method == "POST":
        if not security.same_origin():
            abort(403, "cross-site request refused")
        if not security.csrf_ok():
            abort(403, "missing or wrong CSRF token: reload the page and try again")
        if not security.login_attempt(runner()):
            abort(429, "too many failed logins from your address: wait a minute")
        if security.password_ok(request.form.get("password", "")):
            security.login_succeeded(runner())
            session.clear()
            session["user"] = "admin"
            security.csrf_token()
            log.warning("dashboard: login from %s", request.remote_addr)
            return redirect(local_path(request.form.get("next", ""), "/"))
        flash("wrong password")
    return render_template("login.html", next=request.args.get("next", "/"))


@pages.post("/logout")
@security.form_action
def logout() -> Any:
    session.clear()
    return redirect("/")


@pages.post("/jobs/<job_id>/<action>")
@security.form_action
def job_action(job_id: str, action: str) -> Any:
    done, message = act(find_job(job_id), action, security.who())
    flash(f"{job_id}: {message}")
    return redirect(local_path(request.form.get("next", ""), url_for("pages.job", job_id=job_id)))


@pages.post("/failed/<action>")
@security.form_action
def failed_action(action: str) -> Any:
    """Retry or delete the ticked jobs (`id` fields), or every job of the filter (`all`);
    a browser's script sends `limit` and the `cursor` fields and shows progress between calls
    (JSON answers), a plain form runs batches for up to BULK_SECONDS and says what is left."""
    form = request.form
    f = failure_filter({k: form.get(k, "") for k in ("state", "queue", "task", "error")})
    if form.get("all"):
        cursor = {k: form.get("cursor_" + k) for k in ("before", "queue", "skip") if form.get("cursor_" + k)}
        out = bulk(action, {"filter": f.as_dict(), "cursor": cursor or None, "limit": form.get("limit")})
    else:
        out = bulk(action, {"ids": form.getlist("id"), "state": f.state})
    if request.accept_mimetypes.best == "application/json":
        return jsonify(out)
    verb = "retried" if action == "retry" else "deleted"
    flash(f"{out['done']} {verb}, {out['refused']} refused, {out['gone']} gone"
          + (f"; {out['left']} left: press again" if out["left"] else "")
          + "".join(f"; {e}" for e in out["errors"]))
    return redirect(url_for("pages.failed", **f.as_dict()))


@pages.post("/queues/<name>/<action>")
@security.form_action
def queue_action(name: str, action: str) -> Any:
    flash(f"queue {name}: {queue_act(name, action, security.who())['message']}")
    return redirect(url_for("pages.queue", name=name))


@pages.post("/workers/<name>/<action>")
@security.form_action
def worker_action(name: str, action: str) -> Any:
    flash(f"worker {name}: {worker_act(name, action, security.who())['message']}")
    return redirect(url_for("pages.worker", name=name))


@pages.post("/schedules/<name>/<action>")
@security.form_action
def schedule_action(name: str, action: str) -> Any:
    flash(f"schedule {name}: {schedule_act(name, action, security.who())['message']}")
    return redirect(url_for("pages.schedules"))


# -- JSON API --------------------------------------------------------------------------


@pages.get("/metrics")
def metrics() -> Any:
    """Prometheus metrics (taskrunner/ops/metrics.py), read from Redis at each scrape. Open to
    anyone who can reach the dashboard, unless TASKRUNNER_METRICS_TOKEN is set: then only with
    "Authorization: Bearer <it>". They change nothing."""
    from taskrunner.ops.metrics import CONTENT_TYPE, exposition

    security.metrics_allowed()
    return Response(exposition(runner()), mimetype=None, content_type=CONTENT_TYPE)


@pages.get("/healthz")
def healthz() -> Any:
    """The dashboard's process is up (a liveness probe)."""
    return jsonify(alive=True)


@pages.get("/readyz")
def readyz() -> Any:
    """Redis answers and a dispatcher is alive: 200, else 503 with the reason."""
    from taskrunner.ops.health import readiness

    ok, body = readiness(runner())
    return jsonify(body), 200 if ok else 503


@api.get("/overview")
def api_overview() -> Any:
    return jsonify(listing.overview(runner()))


@api.get("/queues")
def api_queues() -> Any:
    return jsonify(listing.overview(runner())["queues"])


@api.get("/workers")
def api_workers() -> Any:
    return jsonify(listing.workers(runner()))


@api.get("/workers/<name>")
def api_worker(name: str) -> Any:
    """The worker page's twin; for a gone worker a 404 whose `gone` is what its page shows."""
    w = lookup_worker(name)
    if w is None:
        return jsonify(error=no_worker(name), status=404, gone=gone_worker(name)), 404
    return jsonify(w)


@api.post("/workers/<name>/<action>")
@security.api_action
def api_worker_action(name: str, action: str) -> Any:
    return jsonify({"worker": name, "action": action, **worker_act(name, action, security.who())})


@api.get("/schedules")
def api_schedules() -> Any:
    from taskrunner.ops.schedules import rows

    return jsonify(rows(runner()))


@api.get("/tasks")
def api_tasks() -> Any:
    return jsonify(declarations.known(runner()))


@api.get("/history")
def api_history() -> Any:
    from taskrunner.ops import analyze

    return jsonify(analyze.latest(runner()) or {})


@api.get("/jobs")
def api_jobs() -> Any:
    state = request.args.get("state", "running")
    queue_name = queue_arg(request.args.get("queue"))
    page = page_arg()
    offset = (page - 1) * PAGE
    if state in ("running", "stuck"):
        total, rows = listing.running(runner(), queue_name, offset, PAGE, only_stuck=state == "stuck")
    elif state in FINISHED and queue_name is None:
        total, rows = listing.finished(runner(), state, offset, PAGE)
    elif state in ("pending", "delayed", "waiting", *FINISHED):
        if queue_name is None:
            abort(400, f"state={state} needs queue=NAME")
        total, rows = listing.page_of(runner(), queue_name, state, offset, PAGE)
    else:
        abort(400, "state must be running, stuck, pending, delayed, waiting, completed, failed, killed or canceled")
    response = jsonify(rows)
    response.headers["X-Total-Count"] = str(total)
    return response


@api.get("/workflows/<job_id>")
def api_workflow(job_id: str) -> Any:
    from taskrunner.ops.workflow import graph

    find_job(job_id)
    return jsonify(graph(runner(), job_id))


@api.get("/jobs/<job_id>")
def api_job(job_id: str) -> Any:
    return jsonify(find_job(job_id).to_dict())


@api.post("/jobs/<job_id>/<action>")
@security.api_action
def api_job_action(job_id: str, action: str) -> Any:
    done, message = act(find_job(job_id), action, security.who())
    return jsonify({"id": job_id, "action": action, "done": done, "message": message}), 200 if done else 409


@api.post("/queues/<name>/<action>")
@security.api_action
def api_queue_action(name: str, action: str) -> Any:
    return jsonify({"queue": name, "action": action, **queue_act(name, action, security.who())})


@api.post("/schedules/<name>/<action>")
@security.api_action
def api_schedule_action(name: str, action: str) -> Any:
    return jsonify({"schedule": name, "action": action, **schedule_act(name, action, security.who())})


@api.get("/failed")
def api_failed() -> Any:
    """The Failed page's twin: {"total", "page", "pages", "jobs", "facets"}."""
    f = failure_filter({k: v for k, v in request.args.items() if k != "page"})
    data = failed_page(f)
    return jsonify({"filter": f.as_dict(), **{k: data["pager"][k] for k in ("total", "page", "pages")},
                    "jobs": data["rows"], "facets": data["facets"]})


@api.post("/failed/<action>")
@security.api_action
def api_failed_action(action: str) -> Any:
    """Bulk retry or delete: {"ids": [...]} or {"filter": {...}} (see bulk())."""
    body = request.get_json(silent=True)
    if body is None:
        abort(400, "send a JSON object")
    return jsonify(bulk(action, body))


@api.get("/search")
def api_search() -> Any:
    """The search's twin: {"job": id} for a job id, else {"tasks", "jobs", "examined", "after"}."""
    text, states, after = search_args()
    found = job_by_id(text)
    if found is not None:
        return jsonify({"job": found})
    return jsonify(run_search(text, states, after))
