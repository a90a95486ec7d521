"""`taskrunner consume`: take one job from the shell and hand it to a command."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

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
    it. Without CMD the job's JSON is printed and acked. Exit: CMD's code, 2 if no job."""
    logs.configure(log_level, log_format)  # what it logs: waiting out a Redis outage
    app = app_from(app_spec, redis_url)
    c = Consumer(app, [q.strip() for q in queue_list.split(",") if q.strip()])
    try:
        claimed = c.claim(1, block=timeout)
        delivery = claimed[0] if claimed else None
    except KeyboardInterrupt:
        c.close()
        raise
    if delivery is None:
        c.close()  # else listed among the workers, then as a dead one for an hour
        click.echo("no job", err=True)
        sys.exit(EXIT_NOT_YET)
    held = Held(app, c, delivery)
    if not command:
        return held.print_and_ack()
    held.hand_to(command)


class Held:
    """The job `consume` claimed, held until its outcome is recorded: printed and acked, or
    handed to a command that is watched while it runs (watch()) and whose exit is the
    outcome (record()). The outcome is only here, so each write of it rides out a Redis
    outage (report()), and the consumer leaves the list of workers last (leave())."""

    def __init__(self, app: TaskRunner, consumer: Consumer, delivery: Delivery) -> None:
        self.app, self.c, self.delivery = app, consumer, delivery
        self.payload = json.dumps(delivery.to_dict())

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

    def print_and_ack(self) -> None:
        """No command: the job's JSON goes to stdout, and the job is acked."""
        click.echo(self.payload)
        if not self.report(lambda: self.c.ack([self.delivery])[0]):
            click.echo(f"job {self.delivery.id} was requeued or killed meanwhile: it was not acked", err=True)
            self.leave()
            sys.exit(EXIT_REFUSED)
        self.leave()

    def hand_to(self, command: tuple[str, ...]) -> None:
        """Run `command` with the job's JSON on stdin, watched (watch()) until it exits, pass
        on its output, record its outcome, and exit with its code (EXIT_REFUSED for a 0 that
        was not recorded as one: a stopped job, or one requeued or killed meanwhile)."""
        c, delivery = self.c, self.delivery
        try:
            proc = subprocess.Popen(list(command), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, text=True)
        except OSError as e:
            click.echo(f"Error: cannot run {command[0]}: {e}", err=True)
            c.fail(delivery, "CommandFailed", f"{' '.join(command)}: {e}")
            c.close()
            sys.exit(127)
        done = threading.Event()  # CMD exited
        stopped: list[str] = []  # why watch() stopped CMD, if it did
        threading.Thread(target=self.watch, args=(proc, done, stopped), daemon=True).start()
        try:
            out, err = proc.communicate(self.payload)
        except KeyboardInterrupt:  # Ctrl-C reached CMD too: the job goes back, next in line
            proc.kill()
            proc.wait()
            c.close()
            click.echo(f"interrupted: job {delivery.id} is back in its queue", err=True)
            sys.exit(130)
        finally:
            done.set()
        sys.stdout.write(out)
        sys.stderr.write(err)
        code = proc.returncode if proc.returncode >= 0 else 128 - proc.returncode  # as a shell says it
        acked = self.record(command, code, out, err, stopped[0] if stopped else None)
        if not acked:
            click.echo(f"job {delivery.id} was requeued or killed meanwhile: this outcome was not recorded", err=True)
        self.leave()
        sys.exit(EXIT_REFUSED if code == 0 and (stopped or not acked) else code)  # 0 says the job was acked

    def watch(self, proc: subprocess.Popen, done: threading.Event, stopped: list[str]) -> None:
        """Keep the job ours while CMD runs (heartbeats, through a Redis outage too) and
        stop CMD as a worker stops a job: on a kill request (its message, or the record's
        kill_requested read at each beat), once the job is ours no more (requeued, or we
        were found dead), or at its max duration when its policy is kill (SIGTERM, SIGKILL
        after kill_grace). Why it stopped CMD goes in `stopped`; it returns once `done` is
        set (CMD exited)."""
        c, delivery, s = self.c, self.delivery, self.app.settings
        backoff = Backoff(f"consumer {c.name}", None)
        deadline = time.monotonic() + delivery.max_duration if delivery.timeout_policy == "kill" else math.inf
        beat_at, reason = 0.0, None
        while not done.is_set() and reason is None:
            now = time.monotonic()
            if now >= deadline:
                reason = "timeout"
                break
            try:
                if now >= beat_at:
                    c.heartbeat(busy=1)
                    beat_at = now + s.heartbeat
                    reason = c.still_ours(delivery)
                if reason is None:
                    reason = c.kill_request(delivery, max(0.01, min(beat_at, deadline) - now))
                backoff.ok()
            except REDIS_ERRORS as e:
                done.wait(min(backoff.after(e), s.heartbeat))
        if reason is None or done.is_set():
            return
        stopped.append(reason)
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
