"""`taskrunner consume`: take one job from the shell and hand it to a command."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import Any, NoReturn

import click

from taskrunner import logs
from taskrunner.cli.base import EXIT_NOT_YET, EXIT_REFUSED, Finite, app_from, common, log_options, main
from taskrunner.client.app import TaskRunner
from taskrunner.client.consumer import Consumer
from taskrunner.client.steps import REDIS_ERRORS
from taskrunner.protocol import codec
from taskrunner.protocol.claims import Delivery
from taskrunner.protocol.outages import Backoff


@main.command(context_settings={"ignore_unknown_options": True})
@click.option("-q", "--queue", "queue_list", required=True, help="Queues in priority order, comma-separated.")
@click.option("--timeout", type=Finite(min=0), default=0, show_default=True,
              help="Wait this long for a job (exit 2 if none).")
@click.argument("command", nargs=-1, type=click.UNPROCESSED)
@log_options
@common
def consume(queue_list: str, timeout: float, command: tuple[str, ...], log_level: str, log_format: str,
            app_spec: str | None, redis_url: str | None) -> None:
    """Take one job from the shell. With `-- CMD ...`, CMD gets the job as JSON on stdin;
    exit 0 acks it (CMD's stdout, JSON if it parses, is the result), anything else fails
    it. Without CMD the job's JSON is printed and acked. Exit: CMD's code, 2 if no job; 130 on
    Ctrl-C and 143 on SIGTERM once CMD outlived the shutdown grace: the job went back (143
    too on SIGTERM while waiting for a job)."""
    logs.configure(log_level, log_format)  # what it logs: waiting out a Redis outage
    app = app_from(app_spec, redis_url)
    c = Consumer(app, [q.strip() for q in queue_list.split(",") if q.strip()])
    signal.signal(signal.SIGTERM, terminated)  # until the job is held (Held.on_sigterm)
    try:
        claimed = c.claim(1, block=timeout)
        delivery = claimed[0] if claimed else None
        if delivery is None:
            signal.signal(signal.SIGTERM, signal.SIG_IGN)  # leaving already
        else:
            held = Held(app, c, delivery)
            signal.signal(signal.SIGTERM, held.on_sigterm)
    except KeyboardInterrupt:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # leaving already
        c.close()
        raise
    except Terminated:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        try:
            c.close()  # a claim answered as the signal came: its job goes back too
        except REDIS_ERRORS as e:
            click.echo(f"stopped (SIGTERM) before it had a job: Redis unreachable ({e}); the dispatcher requeues "
                       "anything it held once it finds this consumer dead", err=True)
        else:
            click.echo("stopped (SIGTERM) before it had a job", err=True)
        sys.exit(128 + signal.SIGTERM)
    if delivery is None:
        c.close()  # else listed among the workers, then as a dead one for an hour
        click.echo("no job", err=True)
        sys.exit(EXIT_NOT_YET)
    if not command:
        return held.print_and_ack()
    held.hand_to(command)


class Terminated(Exception):
    """SIGTERM before consume held a job (waiting for one, --timeout): it stops there, as a
    worker stops claiming, rather than die of it listed among the workers (then as a dead
    one for an hour), a job its claim had just taken held until the dispatcher found it dead."""


def terminated(signum: int, frame: Any) -> NoReturn:
    raise Terminated


class Stop:
    """Whether the watcher stopped CMD, and why, decided once. The watcher stops CMD only
    while consume has not yet read how CMD ended (stop()); consume reads it once (settle())
    for both the record and the exit code. A kill read just as CMD exits 0 so either stopped
    it (the job ends killed: exit 1) or came too late (acked: exit 0), never acked and exit 1."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.exited = threading.Event()  # CMD exited: the watcher's waits end
        self.settled = False
        self.reason: str | None = None

    def stop(self, reason: str) -> bool:
        """The watcher's decision to stop CMD for `reason`: False once CMD's end was read."""
        with self.lock:
            if self.settled:
                return False
            self.reason = reason
            return True

    def settle(self) -> str | None:
        """CMD exited: why the watcher stopped it (None: it did not), read once."""
        with self.lock:
            self.settled = True
            self.exited.set()
            return self.reason


class Held:
    """The job `consume` claimed, held until its outcome is recorded: printed and acked, or
    handed to a command that is watched while it runs (watch()) and whose exit is the
    outcome (record()). The outcome is only here, so each write of it rides out a Redis
    outage (report()), and the consumer leaves the list of workers last (leave()).
    SIGTERM is a worker's stop for this one job (on_sigterm())."""

    def __init__(self, app: TaskRunner, consumer: Consumer, delivery: Delivery) -> None:
        self.app, self.c, self.delivery = app, consumer, delivery
        self.payload = json.dumps(delivery.to_dict())
        self.term_at: float | None = None  # monotonic: past it, a SIGTERM stops CMD
        self.printed = False  # no CMD: the job is printed and acked

    def on_sigterm(self, signum: int, frame: Any) -> None:
        """SIGTERM stops consume as it stops a worker (README, *Run it in production*): CMD
        has shutdown_grace to finish, its outcome recorded as usual; past it, the watcher stops
        CMD and the job goes back to its queue. A repeated SIGTERM changes nothing (platforms
        signal every process, supervisors pass it on). It died of it: CMD ran on alone while
        the job, held until the dispatcher found the consumer dead, was run again. Without
        CMD the job is printed and acked at once: there is nothing to wait for. Written with
        os.write: the handler may run inside a write to stderr."""
        if self.printed:
            note = "SIGTERM: the job was printed; acking it first"
        elif self.term_at is None:
            grace = self.app.settings.shutdown_grace
            self.term_at = time.monotonic() + grace
            note = f"SIGTERM: letting the command finish ({grace:g} s at most), then its job goes back to its queue"
        else:
            note = "SIGTERM again: already stopping, the command keeps its grace"
        os.write(2, (note + "\n").encode())

    def report(self, call: Callable[[], Any], deadline: float | None = None) -> Any:
        """The outcome is only here: ride out a Redis outage (with backoff) to record it,
        rather than exit and let the job run again once its holder is found dead. Each try
        beats first, so that the dispatcher, if it answers, does not take us for dead (and run
        the job again) before the outcome lands. `deadline` (monotonic): give up then."""
        backoff = Backoff(f"consumer {self.c.name}: reporting job {self.delivery.id}", deadline)
        while True:
            try:
                if backoff.pause:
                    self.c.heartbeat(busy=1)
                answer = call()
                backoff.ok()
                return answer
            except REDIS_ERRORS as e:
                time.sleep(backoff.after(e))

    def leave(self) -> None:
        """Leave the list of workers; the outcome is recorded: an outage now is not worth a
        wait beyond a heartbeat's worth (the dispatcher then forgets us in its time)."""
        try:
            self.report(self.c.close, time.monotonic() + max(self.app.settings.heartbeat, 5.0))
        except REDIS_ERRORS as e:
            click.echo(f"could not leave the list of workers ({e}); the dispatcher will drop this consumer", err=True)

    def hand_back(self, why: str, code: int) -> NoReturn:
        """Give the job back, next in line (Consumer.close()), and exit with `code`, saying
        what became of it: with Redis unreachable it stays held until the dispatcher finds
        this consumer dead and requeues it (close() raised: exit 3, nothing said of the job)."""
        try:
            self.c.close()
        except REDIS_ERRORS as e:
            click.echo(f"{why}: Redis unreachable ({e}): job {self.delivery.id} goes back to its queue once the "
                       "dispatcher finds this consumer dead", err=True)
        else:
            click.echo(f"{why}: job {self.delivery.id} is back in its queue", err=True)
        sys.exit(code)

    def print_and_ack(self) -> None:
        """No command: the job's JSON goes to stdout, and the job is acked."""
        self.printed = True
        click.echo(self.payload)
        if not self.report(lambda: self.c.ack([self.delivery])[0]):
            click.echo(f"job {self.delivery.id} was requeued or killed meanwhile: it was not acked", err=True)
            self.leave()
            sys.exit(EXIT_REFUSED)
        self.leave()

    def hand_to(self, command: tuple[str, ...]) -> None:
        """Run `command` with the job's JSON on stdin, watched (watch()) until it exits, pass
        on its output, record its outcome, and exit with its code (EXIT_REFUSED for a 0 that
        was not recorded as one: a stopped job, or one requeued or killed meanwhile). Ctrl-C,
        or CMD still running past a SIGTERM's grace: the job goes back (hand_back()), exit 130
        or 143 (128 + SIGTERM)."""
        c, delivery = self.c, self.delivery
        try:
            proc = subprocess.Popen(list(command), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, text=True)
        except OSError as e:
            click.echo(f"Error: cannot run {command[0]}: {e}", err=True)
            c.fail(delivery, "CommandFailed", f"{' '.join(command)}: {e}")
            c.close()
            sys.exit(127)
        stop = Stop()
        threading.Thread(target=self.watch, args=(proc, stop), daemon=True).start()
        try:
            out, err = proc.communicate(self.payload)
        except KeyboardInterrupt:  # Ctrl-C reached CMD too: the job goes back, next in line
            stop.settle()
            proc.kill()
            proc.wait()
            self.hand_back("interrupted", 130)
        why = stop.settle()
        sys.stdout.write(out)
        sys.stderr.write(err)
        if why == "shutdown":
            click.echo(f"job {delivery.id} stopped: still running {self.app.settings.shutdown_grace:g} s after "
                       "SIGTERM", err=True)
            self.hand_back("stopped (SIGTERM)", 128 + signal.SIGTERM)
        code = proc.returncode if proc.returncode >= 0 else 128 - proc.returncode  # as a shell says it
        acked = self.record(command, code, out, err, why)
        if not acked:
            click.echo(f"job {delivery.id} was requeued or killed meanwhile: this outcome was not recorded", err=True)
        self.leave()
        sys.exit(EXIT_REFUSED if code == 0 and (why or not acked) else code)  # 0 says the job was acked

    def watch(self, proc: subprocess.Popen, stop: Stop) -> None:
        """Keep the job ours while CMD runs (heartbeats, through a Redis outage too) and
        stop CMD as a worker stops a job: on a kill request (its message, or the record's
        kill_requested read at each beat), once the job is ours no more (requeued, or we
        were found dead), at its max duration when its policy is kill, or at the end of a
        SIGTERM's grace, "shutdown" (seen within a beat of the SIGTERM) (SIGTERM, SIGKILL
        after kill_grace). Why it stopped CMD goes in `stop`; it returns once CMD exited."""
        c, delivery, s = self.c, self.delivery, self.app.settings
        backoff = Backoff(f"consumer {c.name}", None)
        deadline = time.monotonic() + delivery.max_duration if delivery.timeout_policy == "kill" else math.inf
        beat_at, reason = 0.0, None
        while not stop.exited.is_set() and reason is None:
            now = time.monotonic()
            term_at = math.inf if self.term_at is None else self.term_at
            if now >= min(deadline, term_at):
                reason = "timeout" if now >= deadline else "shutdown"
                break
            try:
                if now >= beat_at:
                    c.heartbeat(busy=1)
                    beat_at = now + s.heartbeat
                    reason = c.still_ours(delivery)
                if reason is None:
                    reason = c.kill_request(delivery, max(0.01, min(beat_at, deadline, term_at) - now))
                backoff.ok()
            except REDIS_ERRORS as e:
                stop.exited.wait(min(backoff.after(e), s.heartbeat))
        if reason is None or not stop.stop(reason):
            return
        proc.terminate()
        try:
            proc.wait(s.kill_grace)
        except subprocess.TimeoutExpired:
            proc.kill()

    def record(self, command: tuple[str, ...], code: int, out: str, err: str, stopped: str | None) -> bool:
        """Record CMD's outcome (report()): the job stopped (`stopped`: why), completed with
        CMD's stdout as its result (exit 0), or failed. False: the job was no longer ours."""
        c, delivery = self.c, self.delivery
        if stopped:
            why = {"killed": "killed on request", "timeout": f"past its max duration ({delivery.max_duration:g} s)",
                   "gone": "no longer its own (requeued, or this consumer was taken for dead)"}
            click.echo(f"job {delivery.id} stopped: {why[stopped]}", err=True)
            return stopped != "gone" and self.report(lambda: c.stopped(delivery, stopped))
        if code == 0:
            try:  # strict JSON, as taskrunner sends: NaN or Infinity (which json.loads takes) make it text
                result = codec.loads(out) if out.strip() else None
            except ValueError:
                result = out
            return self.report(lambda: c.ack([delivery], [result])[0])
        return self.report(lambda: c.fail(delivery, "CommandFailed", f"{' '.join(command)} exited {code}", err[-4000:]))
