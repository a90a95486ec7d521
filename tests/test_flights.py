"""The worker keeps its syncs with Redis in flight (worker.Flight): Redis runs one while the
worker reads its children. What happens while a claim is out and unanswered: the child it
claims for dies, or the connection carrying it is killed. The worker runs in this process,
driven step by step, so that the race is set up, not waited for; its children are real
processes, its Redis is real."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import time
from collections.abc import Iterator

import pytest
import redis

from taskrunner.ops.redis_server import RedisServer
from taskrunner.protocol.links import Probe
from taskrunner.worker.children import wait_ready
from taskrunner.worker.main import Worker
from tests import apps
from tests.conftest import free_port, wait_for
from tests.test_prefetch import events, ledger
from tests.test_scripts import claim
from tests.topologies import DATA_NODE, Topology, sentinel_group


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


def test_a_worker_stopping_with_a_claim_in_flight_goes_on_until_it_lands(app):
    """(Review.) The loop ends once stopping and drained, which looked at children and the
    outbox only: a claim sent just before the stop landed after the children were closed,
    and the worker said goodbye with its jobs claimed, left running until the dispatcher
    found them (their attempt spent). A claim in flight keeps the worker's loop going."""
    w = start(app)
    jobs = app.enqueue_many([{"task": "tests.apps.record", "args": [f"r{i}"]} for i in range(2)])
    assert claim_in_flight(app, w)
    # Stopping with a grace, as SIGTERM does: without one (stop_at 0) the jobs the claim brought
    # were requeued at the next step unless they had ended (under load they had not).
    w.stopping, w.stop_at = True, time.monotonic() + 60
    assert not w._drained()
    wait_for(lambda: w._step() or w._drained(), what="the claim to land and its jobs to end")
    stop(w)
    assert not app.redis.hkeys(app.keys.q("default") + "running") and all(j.state == "completed" for j in jobs)


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


class WritePause:
    """Redis takes no writes (CLIENT PAUSE ... WRITE; reads pass) from start() until end() or
    the end of the `with` block, `seconds` at most. lasts(): whether the pause still does,
    told by a write sent as it began that has not run yet (no clock read)."""

    def __init__(self, app) -> None:
        self.app = app
        self.witness = app.redis.connection_pool.make_connection()
        self.key = f"{app.settings.prefix}:unpaused"

    def start(self, seconds: float) -> None:
        self.app.redis.execute_command("CLIENT", "PAUSE", int(seconds * 1000), "WRITE")
        self.witness.send_command("SET", self.key, "1")  # runs once the pause ends

    def lasts(self) -> bool:
        return not self.app.redis.exists(self.key)

    def end(self) -> None:
        self.app.redis.execute_command("CLIENT", "UNPAUSE")

    def __enter__(self) -> WritePause:
        return self

    def __exit__(self, *exc: object) -> None:
        self.end()
        self.witness.disconnect()


def test_a_heartbeat_unanswered_for_socket_timeout_counts_as_a_redis_failure(app, tmp_path):
    """The heartbeat goes in flight, not waited for: a Redis that stops answering (SIGSTOP)
    is still found out by it alone, within socket_timeout (the channel's deadline), and the
    worker backs off and reconciles as after any Redis failure; once Redis answers, the next
    heartbeat lands."""
    server = RedisServer(tmp_path, appendonly=False).start()
    app.configure(redis_url=server.url + "?socket_timeout=0.5")
    w = start(app)
    try:
        os.kill(server.proc.pid, signal.SIGSTOP)
        try:
            w.next_beat = 0.0
            w._step()
            assert [f.beat is not None for f in w.flights] == [True], "the heartbeat did not stay in flight"
            wait_for(lambda: w._step() or w.reconcile, what="the worker to give up on the heartbeat")
            assert not w.flights and w.backoff > 0
        finally:
            os.kill(server.proc.pid, signal.SIGCONT)
        wait_for(lambda: w._step() or (not w.reconcile and w.backoff == 0), what="the worker to find Redis back")
    finally:
        stop(w)
        server.stop()


def test_after_a_failure_the_worker_reconciles_once_redis_answers_not_while_it_takes_no_writes(app, tmp_path):
    """Redis takes no writes for longer than socket_timeout (CLIENT PAUSE ... WRITE): each
    heartbeat fails at the channel's deadline, and the sync that reconciles, which waits
    for its answers (and lose_held's), is not sent until a heartbeat is answered: sent to
    the paused Redis it held the loop for socket_timeout at each try, reading no child.
    "While the pause lasts" is a write sent as it began that has not run yet."""
    server = RedisServer(tmp_path, appendonly=False).start()
    app.configure(redis_url=server.url + "?socket_timeout=0.5")
    w = start(app)
    pause = WritePause(app)
    waited: list[bool] = []  # for each wait on Redis's answers: whether the pause still lasted
    failures: list[Exception] = []
    land, failed = w._land, w._redis_failed

    def spied_land(block: bool = False) -> None:
        if block:
            waited.append(pause.lasts())
        land(block)

    def spied_failed(e: Exception) -> None:
        failures.append(e)
        failed(e)

    w._land, w._redis_failed = spied_land, spied_failed
    try:
        with pause:
            pause.start(600)
            w.next_beat = 0.0
            wait_for(lambda: w._step() or len(failures) >= 3,
                     what="three heartbeats to fail while Redis takes no writes")
            assert pause.lasts(), "the pause ended early"
            assert True not in waited, "the worker waited on a Redis that took no writes"
            pause.end()
            wait_for(lambda: w._step() or not w.reconcile, what="the worker to reconcile once Redis takes writes")
    finally:
        stop(w)
        server.stop()


def test_the_loop_reads_children_and_stops_an_over_time_job_while_redis_holds_its_writes(app, tmp_path):
    """Redis takes no writes for a while (CLIENT PAUSE ... WRITE, as a failover's pause or a
    stalled primary: reads pass, the heartbeat's script and our syncs wait): the worker's loop
    goes on meanwhile, its heartbeat in flight as a sync is, so a job that ends is read and
    the child of one past its max duration is stopped while the pause lasts. The heartbeat
    used to be a blocking round trip on the loop: until its answer (at most socket_timeout)
    the worker read no child and stopped no job. Here socket_timeout outlasts the pause, and
    "while the pause lasts" is a write sent as it began that has not run yet (no clock read):
    before, the loop sat in the heartbeat until the pause ended. The default fast heartbeat
    (0.2 s) is due at once."""
    server = RedisServer(tmp_path, appendonly=False).start()
    app.configure(redis_url=server.url + "?socket_timeout=120")
    w = start(app)
    try:
        with WritePause(app) as pause:
            # Both end 3 s after they begin (one completes, one passes its max duration), each in
            # a child of its own (the worker found the queue empty at start: its claim is a probe,
            # one job per child): after the pause has begun, whatever the load.
            quick = apps.hold.apply_async(["quick", 3.0])
            slow = apps.hold.apply_async(["slow", 60], max_duration=3.0)
            w.may_claim = True
            wait_for(lambda: w._step() or ledger(app, "quick") == ledger(app, "slow") == 1, what="both jobs to begin")
            child = next(c for c in w.crew.children if any(d.id == slow.id for d in c.jobs))
            pause.start(60)

            def acted() -> bool:
                done = w.outbox.holds(quick.id) and w.outbox.holds(slow.id) and not child.proc.is_alive()
                assert pause.lasts(), "the pause ended before the worker read both jobs' ends"
                return done

            wait_for(lambda: w._step() or acted(), timeout=90,
                     what="the worker to read both jobs' ends and stop the over-time one's child")
            pause.end()
            wait_for(lambda: w._step() or slow.refresh().state == "failed" and quick.refresh().state == "completed",
                     what="both ends reported once Redis takes writes again")
            assert "TimeLimitExceeded" in str(slow.refresh().to_dict())
    finally:
        stop(w)
        server.stop()


def test_declarations_that_went_missing_are_put_back_after_a_heartbeat(app, worker):
    """Every declarations.REFRESH a heartbeat's answer has the worker put back the
    declarations that went missing (HSETNX), sent in flight as the heartbeat is: the refresh
    is made due at once here rather than waited for."""
    app.redis.delete(app.keys.tasks)
    worker.next_declare = 0.0
    wait_for(lambda: worker._step() or app.redis.hexists(app.keys.tasks, "tests.apps.add"),
             what="the worker to put its declarations back")


def stopped(pid: int) -> bool:
    """Is the process stopped (SIGSTOP: state T in /proc/PID/stat)?"""
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rpartition(")")[2].split()[0] == "T"


@contextlib.contextmanager
def hung(pid: int) -> Iterator[None]:
    """The process stopped (SIGSTOP) for the block, and resumed after it whatever happens;
    a watchdog process resumes it after 30 s in any case (this process killed, a step that
    waits on it), so that a Redis found still stopped tells that we did not wait for it."""
    os.kill(pid, signal.SIGSTOP)
    watchdog = subprocess.Popen(["sh", "-c", f"sleep 30; kill -CONT {pid}"], start_new_session=True)
    try:
        yield
    finally:
        os.kill(pid, signal.SIGCONT)
        os.killpg(watchdog.pid, signal.SIGKILL)  # its sleep too
        watchdog.wait()


def stops_an_over_time_job_while_redis_answers_nothing(app, pid: int, drop: bool) -> None:
    """A worker of this process (its socket_timeout outlasting a watchdog process that resumes
    Redis after 30 s whatever happens) runs a job with a 3 s max duration; Redis (`pid`) stops
    answering (SIGSTOP), having dropped every connection first with `drop` (CLIENT KILL): the
    job's child must be stopped while Redis is still stopped, and its end reported once Redis
    answers again."""
    w = start(app)
    try:
        # A job that does not use Redis (a dropped connection would fail it), begun once its
        # child has it; only our steps of the worker stop it.
        slow = apps.nap.apply_async([60], max_duration=3.0)
        w.may_claim = True
        child = wait_for(lambda: w._step() or next((c for c in w.crew.children if c.jobs), None),
                         what="the job to begin")
        if drop:
            app.redis.client_kill_filter(_type="normal")  # all but this one (SKIPME yes)
        with hung(pid):
            wait_for(lambda: w._step() or not child.proc.is_alive(), timeout=120,
                     what="the worker to stop the over-time job's child")
            assert stopped(pid), "Redis was resumed before the worker stopped the over-time job's child"
        wait_for(lambda: w._step() or slow.refresh().state == "failed",
                 what="the job's end reported once Redis answers")
        assert "TimeLimitExceeded" in str(slow.refresh().to_dict())
    finally:
        stop(w)


@pytest.mark.parametrize("transport", ["unix", "tcp"])
def test_the_loop_stops_an_over_time_job_while_redis_hangs_after_dropping_its_connections(app, tmp_path, transport):
    """Redis drops every connection (CLIENT KILL) and then answers nothing (SIGSTOP: the
    kernel still takes new connections, as a hung host's does): the worker's connections
    must be opened again, and redis-py's handshake (CLIENT SETINFO, AUTH, SELECT) waits for
    answers. The loop sat in it for socket_timeout at each of redis-py's tries, stopping no
    job past its max duration; now a raw PING, read in the loop's select, must be answered
    before a connection is opened again."""
    port = free_port() if transport == "tcp" else 0
    server = RedisServer(tmp_path, appendonly=False, port=port).start()
    try:
        url = f"redis://127.0.0.1:{port}" if port else server.url
        app.configure(redis_url=url + "?socket_timeout=120")
        stops_an_over_time_job_while_redis_answers_nothing(app, server.proc.pid, drop=True)
    finally:
        server.stop()


@pytest.mark.parametrize("drop", [False, True])
def test_over_tls_the_loop_stops_an_over_time_job_while_redis_answers_nothing(app, tmp_path, monkeypatch, drop):
    """Over TLS (rediss://) the heartbeats and syncs were redis-py's round trips on the loop:
    a Redis that answers nothing (SIGSTOP) held it for socket_timeout at each, stopping no
    job past its max duration. They go in flight on a TLS channel now, and a dropped
    connection is opened again once a probe is answered (a TLS server closes on a plain
    PING: that counts as an answer)."""
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=localhost",
                    "-keyout", str(key), "-out", str(cert)], check=True, capture_output=True)
    with Topology(tmp_path / "nodes") as topology:
        tls = free_port()
        node = topology.start(*DATA_NODE, "--tls-port", str(tls), "--tls-cert-file", str(cert), "--tls-key-file",
                              str(key), "--tls-ca-cert-file", str(cert), "--tls-auth-clients", "no")
        monkeypatch.setenv("TASKRUNNER_REDIS_SSL_CERT_REQS", "none")
        app.configure(redis_url=f"rediss://127.0.0.1:{tls}/0?socket_timeout=120")
        stops_an_over_time_job_while_redis_answers_nothing(app, node.proc.pid, drop=drop)


@pytest.mark.parametrize("drop", [False, True])
def test_through_sentinel_the_loop_stops_an_over_time_job_while_the_primary_answers_nothing(app, tmp_path, drop):
    """Through Sentinel the heartbeats and syncs were redis-py's round trips on the loop: a
    primary that answers nothing (SIGSTOP) held it for socket_timeout at each. They go in
    flight on a channel to the primary the sentinels name now. The sentinels here take a
    minute to call the primary down: no failover meanwhile."""
    with Topology(tmp_path / "nodes") as topology:
        group = sentinel_group(topology, down_after_ms=60_000)
        app.configure(redis_url=group.url() + "?socket_timeout=120")
        stops_an_over_time_job_while_redis_answers_nothing(app, group.primary.proc.pid, drop=drop)

def answered(probe: Probe) -> bool:
    """Wait on the probe as the worker's loop does (for writing while it connects): True
    once it is answered; its errors are raised."""
    ready = wait_ready([probe], 0.1, [probe] if probe.connecting else [])
    return bool(ready) and probe.step()


def test_a_probe_counts_any_answer_and_fails_where_nothing_serves(tmp_path):
    """A PING refused for want of a password (NOAUTH) is an answer: the server serves, and
    redis-py's handshake will authenticate. Nothing listening on the port: ConnectionError,
    as redis-py's connect gives (at once, or once the connect fails)."""
    port = free_port()
    with RedisServer(tmp_path, appendonly=False, port=port):
        redis.Redis(host="127.0.0.1", port=port).config_set("requirepass", "pw")
        probe = Probe(redis.Connection(host="127.0.0.1", port=port, socket_timeout=5))
        wait_for(lambda: answered(probe), what="the probe's answer")
    with pytest.raises(redis.ConnectionError):
        probe = Probe(redis.Connection(host="127.0.0.1", port=free_port(), socket_timeout=5))
        wait_for(lambda: answered(probe), what="the probe's refusal")


def test_a_child_forked_while_a_probe_is_out_leaves_no_connection_to_redis_open(app, tmp_path):
    """(Review.) A child forked while a probe is out (the over-time job's replacement, forked
    while Redis answers nothing) inherits the probe's socket. The worker closed its own once
    answered, so the connection stayed open in the child for as long as the child lived, one
    more at each outage; shut down for every process, as redis-py's disconnect() does, the
    server sees it end."""
    port = free_port()
    with RedisServer(tmp_path, appendonly=False, port=port) as server:
        app.configure(redis_url=f"redis://127.0.0.1:{port}?socket_timeout=120")
        w = start(app)
        try:
            app.redis.client_kill_filter(_type="normal")  # all but this one (SKIPME yes): the worker probes
            with hung(server.proc.pid):
                probe = wait_for(lambda: w._step() or (w.probe if w.probe and not w.probe.connecting else None),
                                 what="the worker's probe to be out")
                host, local = probe.sock.getsockname()
                old = w.crew.children[0]
                os.kill(old.pid, signal.SIGKILL)
                wait_for(lambda: w._step() or (old not in w.crew.children and len(w.crew.children) == 2),
                         what="a child forked in the dead one's place")
                assert w.probe is probe, "the probe ended before the child was forked"
            wait_for(lambda: w._step() or not w.unsure, what="the probe's answer")
            wait_for(lambda: f"{host}:{local}" not in {c["addr"] for c in app.redis.client_list()}, timeout=10,
                     what="the probe's connection to end")
        finally:
            stop(w)


def test_a_worker_told_to_stop_while_redis_answers_nothing_gives_its_wake_tokens_back_in_flight(app, tmp_path):
    """(Review.) An idle worker told to stop (SIGTERM) gave back the wake tokens its BRPOPs
    may have taken with a round trip of redis-py's, on the loop: with Redis answering
    nothing (SIGSTOP) it sat there for socket_timeout at each of redis-py's tries, reading
    no child and stopping no job at its max duration. They go with the next sync now, in
    flight. socket_timeout outlasts a watchdog process that resumes Redis after 30 s
    whatever happens: the step must return while Redis is still stopped."""
    port = free_port()
    with RedisServer(tmp_path, appendonly=False, port=port) as server:
        app.configure(redis_url=f"redis://127.0.0.1:{port}?socket_timeout=120")
        w = start(app)
        try:
            wait_for(lambda: w._step() or all(b.armed for b in w.wakes), what="the idle worker's BRPOPs on its wakes")
            wakes = [b.keys[0] for b in w.wakes]
            app.redis.delete(*wakes)
            with hung(server.proc.pid):
                w._on_signal(signal.SIGTERM, None)
                w._step()
                assert stopped(server.proc.pid), "the step waited for Redis until the watchdog resumed it"
            wait_for(lambda: w._step() or all(app.redis.llen(k) == 1 for k in wakes), what="the tokens given back")
        finally:
            stop(w)
