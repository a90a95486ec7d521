"""`taskrunner workflow ID`, /api/workflows/<id> and the dashboard's workflow page: the whole
graph from any of its jobs, in layers, with states; the SVG drawn on the server, escaped."""

from __future__ import annotations

import json

from dashboard import create_app
from taskrunner import chain, chord
from taskrunner.ops.workflow import graph, svg
from tests import apps


def test_the_graph_from_any_job_in_layers(app, stack):
    c = chord([apps.add.s(1, 1), apps.add.s(2, 2), apps.add.s(3, 3)], apps.tsum.s())
    callback = c.delay()
    after = chain(apps.mul.s(1, 2), apps.add.s(1)).delay()  # a separate workflow: not in the graph
    members = callback.refresh().data["parents"].split()[1::2]
    for start in (callback.id, members[1]):
        g = graph(app, start)
        assert g["root"] == start and not g["truncated"]
        by_id = {n["id"]: n for n in g["jobs"]}
        assert set(by_id) == {callback.id, *members} and after.id not in by_id
        assert [by_id[m]["depth"] for m in members] == [0, 0, 0] and by_id[callback.id]["depth"] == 1
        assert by_id[callback.id]["state"] == "waiting" and by_id[callback.id]["task"] == "tests.apps.tsum"
        assert [p["id"] for p in by_id[callback.id]["parents"]] == members
    out = stack.cli("workflow", callback.id, check=True).stdout
    assert out.splitlines()[0].split()[:3] == ["STEP", "ID", "QUEUE"] and f"1* {callback.id}" in out
    assert json.loads(stack.cli("workflow", members[0], "--json", check=True).stdout)["root"] == members[0]
    stack.worker()
    callback.wait(30)
    assert {n["state"] for n in graph(app, callback.id)["jobs"]} == {"completed"}
    r = stack.cli("workflow", "nope")
    assert r.returncode == 1 and "no job" in r.stderr


def test_a_step_whose_parent_had_completed_when_it_was_written_is_drawn_after_it(app, stack):
    """depends_on a job that completed already: enqueue.lua makes the child pending at once
    and leaves the parent's `children` as they were (docs/PROTOCOL.md, Enqueue), so the edge
    is in the child's `parents` only. The graph read edges from `children`: every job of it
    stood in layer 0 and the SVG drew no line (`taskrunner workflow` said STEP 0 for all)."""
    stack.worker()
    first = apps.add.delay(1, 2)
    assert first.wait(30) == 3
    then = apps.add.apply_async((3, 4), depends_on=[first], on_success=apps.mul.s(10))
    assert then.wait(30) == 7
    g = graph(app, then.id)
    depth = {n["id"]: n["depth"] for n in g["jobs"]}
    [after] = [n for n in g["jobs"] if n["id"] not in (first.id, then.id)]
    assert (depth[first.id], depth[then.id], after["depth"]) == (0, 1, 2), g
    assert {"queue": then.queue, "id": then.id} in next(n for n in g["jobs"] if n["id"] == first.id)["children"]
    assert svg(g).count("<line") == 2


def test_the_workflow_page_draws_the_graph_escaped(app):
    handle = (apps.add.s(1, 2) | apps.mul.s(10)).delay()
    web = create_app(app, password="pw", token="tok").test_client()
    page = web.get(f"/workflows/{handle.id}").get_data(as_text=True)
    assert "<svg" in page and page.count("<rect") == 2 and "<line" in page and "tests.apps.mul" in page
    assert f'href="/jobs/{handle.id}"' in page
    assert web.get(f"/jobs/{handle.id}").get_data(as_text=True).count(f'href="/workflows/{handle.id}"') == 1
    data = web.get(f"/api/workflows/{handle.id}").get_json()
    assert [n["depth"] for n in data["jobs"]] == [0, 1]
    assert web.get("/workflows/nope").status_code == 404 and web.get("/api/workflows/nope").status_code == 404
    # the drawing escapes what it shows (a record written by a hostile client)
    drawn = svg({"root": "x", "jobs": [{"id": "x", "queue": "q", "task": "<script>alert(1)</script>", "state": "<b>",
                                        "depth": 0, "parents": [], "children": []}]})
    assert "<script>" not in drawn and "&lt;script&gt;" in drawn and "<b>" not in drawn
