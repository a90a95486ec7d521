"""The web dashboard. This first version is read-only: an overview page and JSON API;
the full dashboard (running/stuck pages, kill and retry actions) comes next."""

from __future__ import annotations

import os

from flask import Flask, jsonify, render_template

from taskrunner import TaskRunner, listing
from taskrunner.loader import load_app


def create_app(runner: TaskRunner | None = None) -> Flask:
    runner = runner or load_app(os.environ.get("TASKRUNNER_APP"))
    here = os.path.dirname(os.path.abspath(__file__))
    web = Flask(__name__, template_folder=os.path.join(here, "..", "templates"))

    @web.get("/")
    def overview() -> str:
        return render_template("overview.html", app=runner, queues=listing.queue_stats(runner),
                               workers=listing.workers(runner))

    @web.get("/api/queues")
    def api_queues():  # type: ignore[no-untyped-def]
        return jsonify(listing.queue_stats(runner))

    @web.get("/api/workers")
    def api_workers():  # type: ignore[no-untyped-def]
        return jsonify(listing.workers(runner))

    @web.get("/api/jobs")
    def api_jobs():  # type: ignore[no-untyped-def]
        from flask import request

        jobs = listing.list_jobs(runner, request.args.get("queue"), request.args.get("state"))
        return jsonify([j.to_dict() for j in jobs])

    return web
