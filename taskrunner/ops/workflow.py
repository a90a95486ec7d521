"""A workflow's graph, found from any of its jobs: the jobs linked to it by `parents` and
`children` (docs/PROTOCOL.md, Workflows), each with its state, for `taskrunner workflow ID`,
/api/workflows/<id> and the dashboard's workflow page (an SVG drawn on the server)."""

from __future__ import annotations

from html import escape
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from taskrunner.client.app import TaskRunner

#: Jobs a graph holds at most (a 10,000-member chord is read in a few pipelined rounds).
MOST = 20_000
FIELDS = ("task", "state", "parents", "children", "error_type", "canceled_by")


def _pairs(text: str | None) -> list[tuple[str, str]]:
    """'<queue> <id> <queue> <id> ...' as (queue, id) pairs (a malformed tail is ignored)."""
    words = (text or "").split()
    return list(zip(words[0::2], words[1::2]))


def graph(app: TaskRunner, job_id: str, queue: str | None = None) -> dict[str, Any]:
    """{"root": id, "jobs": [{id, queue, task, state, depth, parents, children, ...}],
    "truncated": bool}: every job linked to `job_id`, breadth first, read a level at a time
    (one pipelined round per level). `depth` is the longest path from a job without parents
    in the graph, for drawing it in layers. A job's `children` are those its record lists and
    those in the graph that name it among their `parents`. A job whose record is gone shows
    as state "gone"."""
    start = app.job(job_id, queue)
    found: dict[tuple[str, str], dict[str, Any]] = {}
    level = [(start.queue, start.id)]
    while level and len(found) < MOST:
        level = [k for k in dict.fromkeys(level) if k not in found][:MOST - len(found)]
        pipe = app.redis.pipeline(transaction=False)
        for q, i in level:
            pipe.hmget(app.keys.job(q, i), *FIELDS)
        following: list[tuple[str, str]] = []
        for (q, i), values in zip(level, pipe.execute() if level else []):
            d = dict(zip(FIELDS, values))
            parents, children = _pairs(d.pop("parents")), _pairs(d.pop("children"))
            found[(q, i)] = {"id": i, "queue": q, **d, "state": d["state"] or "gone",
                             "parents": [{"queue": pq, "id": pi} for pq, pi in parents],
                             "children": [{"queue": cq, "id": ci} for cq, ci in children]}
            following += parents + children
        level = following
    # A parent lists a child in `children` only when it had not ended as the child was
    # written (enqueue.lua: depends_on a job that completed makes the child pending at once):
    # the edge is then in the child's `parents` alone. Both sides give the graph's edges.
    for k, n in found.items():
        for p in n["parents"]:
            parent = found.get((p["queue"], p["id"]))
            child = {"queue": k[0], "id": k[1]}
            if parent is not None and child not in parent["children"]:
                parent["children"].append(child)
    # Depth in topological order (Kahn's): edges only go from earlier jobs to later ones.
    waiting = {k: sum((p["queue"], p["id"]) in found for p in n["parents"]) for k, n in found.items()}
    ready = [k for k, w in waiting.items() if w == 0]
    for n in found.values():
        n["depth"] = 0
    while ready:
        key = ready.pop()
        for c in found[key]["children"]:
            ck = (c["queue"], c["id"])
            if ck in found:
                found[ck]["depth"] = max(found[ck]["depth"], found[key]["depth"] + 1)
                waiting[ck] -= 1
                if waiting[ck] == 0:
                    ready.append(ck)
    jobs = sorted(found.values(), key=lambda n: (n["depth"], n["id"]))
    return {"root": start.id, "jobs": jobs, "truncated": len(found) >= MOST}


#: Fill colours of the states, for the SVG on its own (the dashboard's badges' light palette).
#: Each element also has a class (its state; `root`, `state`) by which a page's stylesheet
#: colours it instead, e.g. for a dark colour scheme (dashboard/static/style.css).
COLOURS = {"completed": "#e3f4ea", "failed": "#fbe5e7", "killed": "#fbe5e7", "canceled": "#eeeeee",
           "running": "#e5effb", "pending": "#fff6dc", "delayed": "#fff6dc", "waiting": "#f3ecfb", "gone": "#ffffff"}
W, H, GAP_X, GAP_Y = 190, 46, 60, 14


def svg(g: dict[str, Any], link: str = "/jobs/{id}", most: int = 400) -> str:
    """The graph drawn as SVG, in layers by depth (left to right), each job a box with its
    task and state linking to its page, each edge a line; text escaped. Past `most` jobs only
    the first are drawn (the page says so)."""
    jobs = g["jobs"][:most]
    layers: dict[int, list[dict[str, Any]]] = {}
    for n in jobs:
        layers.setdefault(n["depth"], []).append(n)
    pos: dict[tuple[str, str], tuple[int, int]] = {}
    for d, nodes in layers.items():
        for k, n in enumerate(nodes):
            pos[(n["queue"], n["id"])] = (20 + d * (W + GAP_X), 20 + k * (H + GAP_Y))
    width = 40 + (max(layers, default=0) + 1) * (W + GAP_X)
    height = 40 + max((len(v) for v in layers.values()), default=1) * (H + GAP_Y)
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" class="workflow" width="{width}" height="{height}" '
           f'viewBox="0 0 {width} {height}" role="img" aria-label="workflow graph">']
    for n in jobs:
        x, y = pos[(n["queue"], n["id"])]
        for c in n["children"]:
            if (c["queue"], c["id"]) in pos:
                cx, cy = pos[(c["queue"], c["id"])]
                out.append(f'<line x1="{x + W}" y1="{y + H // 2}" x2="{cx}" y2="{cy + H // 2}" stroke="#889" />')
    for n in jobs:
        x, y = pos[(n["queue"], n["id"])]
        state = str(n["state"])
        fill = COLOURS.get(state, "#ffffff")
        root = ' stroke-width="3"' if n["id"] == g["root"] else ""
        kind = escape(state if state in COLOURS else "other") + (" root" if root else "")
        out.append(f'<a href="{escape(link.format(id=n["id"]))}"><rect x="{x}" y="{y}" width="{W}" height="{H}" '
                   f'rx="6" fill="{fill}" stroke="#556"{root} class="{kind}" />'
                   f'<text x="{x + 8}" y="{y + 18}" font-size="12">{escape(str(n["task"] or "?")[:40])}</text>'
                   f'<text x="{x + 8}" y="{y + 36}" font-size="11" class="state state-{escape(state)}">'
                   f'{escape(state)} · '
                   f'{escape(n["id"][-8:])}</text></a>')
    out.append("</svg>")
    return "".join(out)
