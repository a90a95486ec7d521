"""The worker keeps its syncs with Redis in flight (worker.Flight): Redis runs one while the
worker reads its children. What happens while a claim is out and unanswered: the child it
claims for dies, or the connection carrying it is killed. The worker runs in this process,
driven step by step, so that the race is set up, not waited for; its children are real
processes, its Redis is real."""

from __future__ import annotations

import os
import signal
import socket

import pytest

from taskrunner.ops.redis_server import RedisServer
from taskrunner.worker.main import Worker
from tests import apps
from tests.conftest import wait_for
from tests.test_prefetch import events, ledger
from tests.test_scripts import claim


def start(app) -> Worker:
    """A worker of this process, set up as run() does it, its first sync done."""
    w = Worker(app, ["default"], concurrency=2, name="inflight")
    assert w.channel is not None, "the test Redis is a plain unix socket: syncs go in flight"
    w._wakeup, w._wakeup_w = socket.socketpair()  # what run() sets up for signals
    w.crew.start()
    w._sync()  # the first sync reconciles, and waits
    w._arm()  # its control list's BRPOP
    return w


def stop(w: Worker) -> None:
    w._shutdown()
    w._wakeup.close()
    w._wakeup_w.close()


@pytest.fixture
def worker(app):
    w = start(app)
    yield w
    stop(w)


def claim_in_flight(app, w: Worker) -> set[str]:
    """Send a sync that claims jobs, see Redis run it, and say which; its answers stay unread."""
    w.may_claim = True  # as a wake token would
    w._sync()
    assert w.flights and w.flights[-1].slots, "the sync claims nothing"
    held = app.keys.q("default") + "running"
    wait_for(lambda: app.redis.hlen(held) == len(w.flights[-1].slots), what="Redis to run the claim")
    return set(app.redis.hkeys(held))


def run_until_done(w: Worker, jobs: list) -> None:
    wait_for(lambda: w._step() or all(j.state == "completed" for j in jobs), what="every job to complete")


def test_jobs_claimed_for_a_child_that_died_meanwhile_go_back_to_the_queue(app, worker):
    jobs = app.enqueue_many([{"task": "tests.apps.record", "args": [f"r{i}"]} for i in range(4)])
    claim_in_flight(app, worker)
    dead = worker.crew.children[0]
    os.kill(dead.pid, signal.SIGKILL)
    dead.proc.join()
    worker.crew.exited(dead, replace=True)  # replaced by a new child, before the claim's answer is read
    worker._land(block=True)
    worker._sync(wait=True)  # reports what went back
    returned = [j for j in jobs if any("returned before it began: its process died" in e for e in events(j))]
    assert returned, "no job was claimed for the child that died"
    run_until_done(worker, jobs)
    assert [ledger(app, f"r{i}") for i in range(4)] == [1] * 4
    assert all(j.refresh().data["attempts"] == "2" for j in returned)


def client_id(w: Worker) -> int:
    """The Redis client id of the worker's sync connection."""
    w.channel.send([("CLIENT", "ID")])
    (answer,), = w.channel.take(block=True)
    return answer


def test_a_claim_whose_answers_are_lost_with_its_connection_is_reconciled(app, worker):
    cid = client_id(worker)
    jobs = app.enqueue_many([{"task": "tests.apps.record", "args": [f"r{i}"]} for i in range(4)])
    claimed = claim_in_flight(app, worker)
    for _ in range(len(worker.flights[-1].batch)):
        worker.channel.link.reply()  # the answers are lost on the way...
    app.redis.client_kill_filter(_id=cid)  # ...and the connection with them
    run_until_done(worker, jobs)
    assert [ledger(app, f"r{i}") for i in range(4)] == [1] * 4  # none ran before its release
    for j in jobs:
        timeline = " ".join(events(j))
        assert ("worker inflight no longer ran it" in timeline) == (j.id in claimed), timeline
        assert j.refresh().data["attempts"] == ("2" if j.id in claimed else "1")


def test_a_lost_claim_of_a_job_whose_earlier_attempt_runs_here_is_reconciled(app, worker):
    """A job runs here (attempt 1) and is requeued; before the heartbeat notices, our claim
    takes it again (attempt 2) and its answer is lost. Reconciling matches deliveries by
    attempt: attempt 2 is none of ours and goes back. Matched by job id, the child's attempt
    1 made it ours, and it waited for its max duration."""
    job = apps.hold.delay("again", 60)
    worker.next_beat = float("inf")  # no heartbeat: it would find attempt 1 lost
    worker.may_claim = True
    wait_for(lambda: worker._step() or ledger(app, "again") == 1, what="attempt 1 to begin")
    assert job.requeue("ops@desk")
    [row] = claim(app, pids=(os.getpid(),), worker="inflight")  # our claim, its answer lost
    assert (row[1], row[2]) == (job.id, 2)
    worker.reconcile, worker.may_claim = True, False  # the next sync reconciles, and claims nothing
    worker._sync(wait=True)
    assert "worker inflight no longer ran it" in " ".join(events(job))
    assert job.refresh().data["state"] == "pending"
    app.redis.set(f"{app.settings.prefix}:release:again", 1)  # attempt 1 ends; its end is fenced off


def test_answers_come_before_the_connection_was_killed_count(app, worker):
    """Redis answered, then the connection was killed (CLIENT KILL): the answers our end
    received still count; the next sync fails to go out, and goes again."""
    cid = client_id(worker)
    jobs = app.enqueue_many([{"task": "tests.apps.record", "args": [f"r{i}"]} for i in range(4)])
    claim_in_flight(app, worker)
    app.redis.client_kill_filter(_id=cid)
    run_until_done(worker, jobs)
    assert [ledger(app, f"r{i}") for i in range(4)] == [1] * 4
    assert all(j.refresh().data["attempts"] == "1" for j in jobs)


def test_a_sync_unanswered_for_socket_timeout_counts_as_lost(app, tmp_path):
    """Redis stops answering (SIGSTOP) with syncs in flight: after the client's
    socket_timeout the worker gives them up, as a connection error (never a hang), and
    once Redis answers again every job runs, once."""
    server = RedisServer(tmp_path, appendonly=False).start()
    app.configure(redis_url=server.url + "?socket_timeout=0.5")
    w = start(app)
    try:
        jobs = app.enqueue_many([{"task": "tests.apps.record", "args": [f"r{i}"]} for i in range(4)])
        w.may_claim = True
        w.next_beat = float("inf")  # no heartbeat to find Redis gone first
        os.kill(server.proc.pid, signal.SIGSTOP)
        try:
            w._sync()
            assert w.flights, "the sync did not stay in flight"
            wait_for(lambda: w._step() or w.reconcile, what="the worker to give up on the sync")
            assert not w.flights
        finally:
            os.kill(server.proc.pid, signal.SIGCONT)
        run_until_done(w, jobs)
        assert [ledger(app, f"r{i}") for i in range(4)] == [1] * 4
    finally:
        stop(w)
        server.stop()
