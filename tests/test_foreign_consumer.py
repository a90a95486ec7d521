"""A consumer that is not a taskrunner worker, as docs/PROTOCOL.md describes it: raw
EVALSHA of claim.lua and heartbeat.lua (defensive against arguments that would corrupt a
holding entry or an info the dispatcher reads), and the liveness rule a real dispatcher
applies to it: dead at once only when its PID is gone on the dispatcher's own machine,
never because of a field such as create_time."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import time

import pytest
import redis

from taskrunner.client.consumer import Consumer
from tests import apps
from tests.conftest import wait_for
from tests.test_protocol import SCRIPTS, ForeignClient


class Foreign(ForeignClient):
    """The conformance client, with heartbeat.lua and raw claim arguments."""

    def __init__(self, url: str, prefix: str):
        super().__init__(url, prefix)
        source = (SCRIPTS / "_lib.lua").read_text() + "\n" + (SCRIPTS / "heartbeat.lua").read_text()
        self.sha["heartbeat"] = self.r.execute_command("SCRIPT", "LOAD", source)
        self.g = f"{prefix}:{{_}}:"

    def claim_raw(self, queue: str, *argv) -> list:
        return self.r.evalsha(self.sha["claim"], 1, self.q(queue), *argv)

    def claim_as(self, queue: str, me: str, pid: int) -> list:
        head = json.dumps({"worker": me, "host": socket.gethostname(), "ip": "127.0.0.1"})[:-1]
        return self.claim_raw(queue, head, me, socket.gethostname(), "127.0.0.1", 1, 60, pid, "")

    def heartbeat(self, name: str, info: dict | str, ttl="60"):
        raw = info if isinstance(info, str) else json.dumps(info)
        return self.r.evalsha(self.sha["heartbeat"], 1, self.g, name, raw, ttl)

    def pending(self, queue: str) -> list[bytes]:
        return self.r.lrange(self.q(queue) + "pending", 0, -1)


@pytest.fixture
def foreign(app) -> Foreign:
    return Foreign(app.settings.redis_url, app.settings.prefix)


HEAD = '{"worker":"c1","host":"h","ip":"10.0.0.1"'
GOOD = [HEAD, "c1", "h", "10.0.0.1", 1, 60, "4242", ""]


@pytest.mark.parametrize("argv, why", [
    ([HEAD, "c1", "h", "10.0.0.1", 1, 60, "abc", ""], "pid"),
    ([HEAD, "c1", "h", "10.0.0.1", 1, 60, "", ""], "pid"),
    ([HEAD, "c1", "h", "10.0.0.1", 1, 60, "-1", ""], "pid"),
    ([HEAD, "c1", "h", "10.0.0.1", 1, 60, "12 ", ""], "pid"),
    ([HEAD, "c1", "h", "10.0.0.1", 1, 60, "4242", "soon"], "ahead"),
    ([HEAD, "c1", "h", "10.0.0.1", 1, 60, "4242"], "pair"),
    ([HEAD + "}", "c1", "h", "10.0.0.1", 1, 60, "4242", ""], "ARGV[1]"),
    ([HEAD, "c2", "h", "10.0.0.1", 1, 60, "4242", ""], "ARGV[1]"),
    # the head as claim.lua would build it from host and ip, which is not JSON (a backslash)
    (['{"worker":"c1","host":"h\\","ip":"10.0.0.1"', "c1", "h\\", "10.0.0.1", 1, 60, "4242", ""], "ARGV[1]"),
    # ... and a host that names another worker when pasted in
    (['{"worker":"c1","host":"h","worker":"c2","ip":"10.0.0.1"', "c1", 'h","worker":"c2', "10.0.0.1", 1, 60, "4242",
      ""], "ARGV[1]"),
    (['{"worker":"c 1"', "c 1", "h", "10.0.0.1", 1, 60, "4242", ""], "worker name"),
    ([HEAD, "c1", "h", "10.0.0.1", 0, 60, "4242", ""], "bucket width"),
    ([HEAD, "c1", "h", "10.0.0.1", 1, "nan", "4242", ""], "default max duration"),
])
def test_claim_refuses_arguments_that_would_corrupt_the_holding_entry(foreign, argv, why):
    """A non-numeric PID used to be written into the holding entry: the dispatcher could
    not read it, so the job came back only at its max duration. Now nothing changes."""
    assert foreign.enqueue("default", "j1", "tests.apps.add", [1, 2], {}) == 1
    with pytest.raises(redis.ResponseError, match=re.escape(why)) as e:
        foreign.claim_raw("default", *argv)
    assert str(e.value).startswith("claim: ") and "\n" not in str(e.value)
    assert foreign.pending("default") == [b"j1"] and foreign.r.hlen(foreign.q("default") + "running") == 0
    assert foreign.record("default", "j1")["attempts"] == "0"
    assert foreign.claim_raw("default", *GOOD)[1] == b"j1"  # nothing was taken


@pytest.mark.parametrize("host, width", [("h-1.example:x_y", 1), ("my host", 1), ('h"q', 2), ("h\\b", 1),
                                         ("h\u00e9", 3), ("h\x01", 1)])
def test_claim_takes_a_head_with_any_host_written_as_json(foreign, host, width):
    """Host and IP of letters, digits and .:_- are checked by a pattern, any other text by
    decoding the head: both are taken when the head is that JSON object."""
    assert foreign.enqueue("default", "j1", "tests.apps.add", [1, 2], {}) == 1
    head = json.dumps({"worker": "c1", "host": host, "ip": "::1"})[:-1]
    assert foreign.claim_raw("default", head, "c1", host, "::1", width, 60, "4242", "")[1] == b"j1"
    entry = json.loads(foreign.r.hget(foreign.q("default") + "running", "j1"))
    assert entry["host"] == host and entry["ip"] == "::1" and entry["worker"] == "c1"


@pytest.mark.parametrize("max_duration", ["5.", "05", "1e3", "-1", "0x10", "inf", "nan", ""])
def test_claim_writes_only_json_numbers_into_the_holding_entry(foreign, max_duration):
    """A record's max_duration is copied into the holding entry's JSON; "5." and "05" passed
    the old check yet are not JSON, so the dispatcher could not read the entry."""
    assert foreign.enqueue("default", "j1", "tests.apps.add", [1, 2], {}) == 1
    foreign.r.hset(foreign.q("default") + "job:j1", "max_duration", max_duration)
    [_, _, _, _, _, _, md, *_] = foreign.claim_raw("default", *GOOD)
    entry = json.loads(foreign.r.hget(foreign.q("default") + "running", "j1"))
    assert md == b"60" and entry["max_duration"] == 60 and entry["pid"] == 4242


def test_a_batch_claim_checks_every_pid_and_max_duration_and_answers_the_jobs_it_took(foreign):
    """claim.lua checks a PID or a max duration equal to the one before once per call (and
    makes a batch's answer at its full size): a bad one after good ones is still refused,
    each job keeps its own max duration or gets the default, and a batch that finds fewer
    jobs than it wants answers exactly those (the unpresized path, over 100 jobs, alike)."""
    p = foreign.q("default")
    for i, md in enumerate(["30", "30", "5.", "nan", "30", "0.5"]):
        assert foreign.enqueue("default", f"j{i}", "tests.apps.add", [i, 1], {}) == 1
        foreign.r.hset(p + f"job:j{i}", "max_duration", md)
    head = [HEAD, "c1", "h", "10.0.0.1", 1, 60]
    for pids, bad in ([("4242", "4242", "012"), 11], [("4242", "4242", "12345678901"), 11],
                      [("4242", "4242", "77", "77", "4242 "), 15]):
        with pytest.raises(redis.ResponseError, match=re.escape(f"pid (ARGV[{bad}])")):
            foreign.claim_raw("default", *head, *[x for pid in pids for x in (pid, "")])
    assert foreign.r.hlen(p + "running") == 0
    pids = ["4242", "4242", "1234567890", "1234567890", "77", "4242", "4242", "9"]
    out = foreign.claim_raw("default", *head, *[x for pid in pids for x in (pid, "")])
    assert len(out) == 60  # six jobs for eight wanted: their 60 values, nothing after
    mds = [out[k + 6] for k in range(0, 60, 10)]
    assert [out[k + 1] for k in range(0, 60, 10)] == [f"j{i}".encode() for i in range(6)]
    assert mds == [b"30", b"30", b"60", b"60", b"30", b"0.5"]
    for i, (md, pid) in enumerate(zip(mds, pids)):
        entry = json.loads(foreign.r.hget(p + "running", f"j{i}"))
        assert (entry["max_duration"], entry["pid"]) == (json.loads(md), int(pid))
    for i in range(3):
        assert foreign.enqueue("default", f"k{i}", "tests.apps.add", [i, 1], {}) == 1
    out = foreign.claim_raw("default", *head, *["4242", ""] * 101)
    assert len(out) == 30 and [out[k + 1] for k in range(0, 30, 10)] == [b"k0", b"k1", b"k2"]


@pytest.mark.parametrize("head, job, why", [
    (["1.5", 600, 86400], ["completed", "", "42", "", "", ""], "result TTL"),  # used to fail half-way
    (["0", 600, 86400], ["completed", "", "42", "", "", ""], "result TTL"),
    ([3600, "soon", 86400], ["completed", "", "42", "", "", ""], "backoff cap"),
    ([3600, 600, "week"], ["completed", "", "42", "", "", ""], "failed TTL"),
    ([3600, 600], ["completed", "", "42", "", "", ""], "failed TTL"),  # the ARGV of before: ARGV[3] an id
    ([3600, 600, 86400], ["completed", "", "42", "", ""], "8 values"),  # one value short: misaligned
    ([3600, 600, 86400], ["done", "", "42", "", "", ""], "unknown outcome"),  # used to fail the job
    ([3600, 600, 86400], ["completed", "soon", "42", "", "", ""], "began"),
])
def test_finish_refuses_arguments_it_cannot_apply_whole(foreign, head, job, why):
    assert foreign.enqueue("default", "j1", "tests.apps.add", [1, 2], {}) == 1
    [_, _, attempt, *_] = foreign.claim_raw("default", *GOOD)
    with pytest.raises(redis.ResponseError, match=re.escape(why)) as e:
        foreign.r.evalsha(foreign.sha["finish"], 1, foreign.q("default"), *head, "j1", attempt, *job)
    assert str(e.value).startswith("finish: ")
    rec = foreign.record("default", "j1")
    assert (rec["state"], rec.get("failures"), rec.get("result")) == ("running", None, None)
    p = foreign.q("default")
    assert foreign.r.hexists(p + "running", "j1") and foreign.r.ttl(p + "job:j1") == -1
    assert foreign.finish("default", b"j1", attempt, 3) == 1 and foreign.record("default", "j1")["state"] == "completed"


INFO = {"name": "c1", "host": "h", "pid": 4242}


@pytest.mark.parametrize("name, info, ttl, why", [
    ("c1", "not json", "60", "JSON object"),
    ("c1", "[1, 2]", "60", "JSON object"),
    ("c1", {**INFO, "name": "c2"}, "60", '"name"'),
    ("c 1", {**INFO, "name": "c 1"}, "60", "worker name"),
    ("c1", {"name": "c1", "pid": 4242}, "60", '"host"'),
    ("c1", {**INFO, "pid": "4242"}, "60", '"pid"'),
    ("c1", {**INFO, "pid": 0}, "60", '"pid"'),
    ("c1", {**INFO, "pid": 42.5}, "60", '"pid"'),
    ("c1", {**INFO, "pid": 2 ** 31}, "60", '"pid" must be an integer from 1 to 2^31 - 1'),  # it said > 0
    ("c1", {**INFO, "pidns": 7}, "60", '"pidns"'),
    ("c1", {**INFO, "boot_id": None}, "60", '"boot_id"'),
    ("c1", INFO, "1.5", "TTL"),
    ("c1", INFO, "0", "TTL"),
])
def test_heartbeat_refuses_an_info_the_dispatcher_cannot_read(foreign, name, info, ttl, why):
    with pytest.raises(redis.ResponseError, match=re.escape(why)) as e:
        foreign.heartbeat(name, info, ttl)
    assert str(e.value).startswith("heartbeat: ")
    assert foreign.r.zcard(foreign.g + "workers") == 0 and not foreign.r.keys(foreign.g + "worker:*")
    foreign.heartbeat("c1", INFO)  # the smallest info that is right
    assert foreign.r.zscore(foreign.g + "workers", "c1")


def passes(app) -> int:
    return sum(json.loads(v)["passes"] for v in app.redis.hvals(app.keys.dispatchers))


def beat_through_passes(foreign: Foreign, name: str, info: dict, app, n: int = 25) -> None:
    """Heartbeat every 0.1 s while a dispatcher makes n passes (longer than dead_after)."""
    start = passes(app)
    deadline = time.monotonic() + 60
    while passes(app) < start + n:
        assert time.monotonic() < deadline, "the dispatcher made no passes"
        foreign.heartbeat(name, info)
        time.sleep(0.1)


def here(pid: int, **fields) -> dict:
    """An info whose process runs on this machine, as PROTOCOL.md says to write it."""
    with open("/proc/sys/kernel/random/boot_id") as f:
        boot = f.read().strip()
    return {"name": "c1", "host": socket.gethostname(), "pid": pid, "pidns": os.readlink("/proc/self/ns/pid"),
            "boot_id": boot, **fields}


def gone_pid() -> int:
    p = subprocess.Popen(["true"])
    p.wait()
    return p.pid


@pytest.mark.parametrize("info", [
    # A guess at create_time (the time of the first beat, or a clock off by seconds):
    # the dispatcher used to compare it with psutil's, within 1 s, and declared it dead.
    pytest.param(lambda: here(os.getpid(), create_time=time.time() - 5), id="create_time-differs"),
    # Another machine with the same host name, in its first PID namespace (same id on every
    # machine): the dispatcher used to look for its PID here, miss it, and declare it dead.
    pytest.param(lambda: here(gone_pid(), boot_id="another-machine"), id="same-host-name-other-machine"),
    pytest.param(lambda: {**here(gone_pid()), "pidns": "pid:[1]"}, id="other-pid-namespace"),
])
def test_a_consumer_that_heartbeats_is_not_declared_dead_by_a_field_it_sent(app, stack, foreign, info):
    info = info()
    foreign.heartbeat("c1", info)
    job = apps.add.delay(1, 2)
    assert foreign.claim_as("default", "c1", info["pid"])[1].decode() == job.id
    stack.dispatcher()
    beat_through_passes(foreign, "c1", info, app)
    rec = foreign.record("default", job.id)
    assert (rec["state"], rec["attempts"], rec["worker"]) == ("running", "1", "c1")
    assert app.redis.zscore(app.keys.workers_dead, "c1") is None


def test_a_consumer_whose_process_is_gone_here_is_dead_at_once(app, stack, foreign):
    """The same-machine check still works: beats keep coming (from another process), yet
    the PID that holds the job is gone, so the job is requeued within a few passes."""
    sleeper = subprocess.Popen(["sleep", "60"])
    try:
        info = here(sleeper.pid)
        foreign.heartbeat("c1", info)
        job = apps.add.delay(1, 2)
        foreign.claim_as("default", "c1", sleeper.pid)
        stack.dispatcher()
        beat_through_passes(foreign, "c1", info, app, n=5)
        assert foreign.record("default", job.id)["state"] == "running"
    finally:
        sleeper.kill()
        sleeper.wait()
    wait_for(lambda: foreign.record("default", job.id)["state"] == "pending", timeout=30, what="requeue")
    rec = foreign.record("default", job.id)
    assert "worker c1 is dead" in rec["end:1"]
    # The dispatcher lists it dead once its jobs are requeued (in that order: a dispatcher
    # that died between the two must not leave the jobs of a worker no longer listed held).
    wait_for(lambda: app.redis.zscore(app.keys.workers_dead, "c1"), timeout=30, what="c1 listed dead")


def test_a_consumer_restarted_under_its_name_is_judged_by_its_new_pid(app, stack, foreign):
    """The dispatcher keeps each worker's info; it used to judge a consumer restarted under
    the same name by its old PID, find it gone, and requeue what the new process held."""
    first = subprocess.Popen(["sleep", "60"])
    second = subprocess.Popen(["sleep", "60"])
    try:
        foreign.heartbeat("c1", here(first.pid))
        stack.dispatcher()
        beat_through_passes(foreign, "c1", here(first.pid), app, n=3)
        first.kill()
        first.wait()
        job = apps.add.delay(1, 2)
        foreign.heartbeat("c1", here(second.pid))
        foreign.claim_as("default", "c1", second.pid)
        beat_through_passes(foreign, "c1", here(second.pid), app)
        assert foreign.record("default", job.id)["state"] == "running"
        assert app.redis.zscore(app.keys.workers_dead, "c1") is None
    finally:
        for p in (first, second):
            p.kill()
            p.wait()


def test_a_consumer_that_closes_puts_what_it_holds_back_at_once(app):
    """Consumer.close() used to leave the worker list only: a job it still held waited for
    its max duration (300 s) before the dispatcher requeued it."""
    job = apps.add.delay(20, 22)
    c = Consumer(app, ["default"], name="closing")
    [d] = c.claim()
    c.close()
    rec = job.refresh().to_dict()
    assert rec["state"] == "pending" and job.id in app.redis.lrange(app.keys.q("default") + "pending", 0, -1)
    assert app.redis.hlen(app.keys.q("default") + "running") == 0
    assert app.redis.zscore(app.keys.workers, "closing") is None and not app.redis.exists(app.keys.worker("closing"))
    assert not c.ack([d])[0]  # the delivery is no longer ours
    [again] = Consumer(app, ["default"], name="next").claim()
    assert (again.id, again.attempt) == (job.id, "2")
