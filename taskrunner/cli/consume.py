"""`taskrunner consume`: take one job from the shell and hand it to a command."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from typing import Any

import click
import redis

from taskrunner import logs
from taskrunner.cli.base import EXIT_NOT_YET, EXIT_REFUSED, Finite, app_from, common, log_options, main
from taskrunner.protocol import codec


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
    import math
    import subprocess
    import threading
    import time

    from taskrunner.client.consumer import Consumer
    from taskrunner.protocol.outages import Backoff

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
    payload = json.dumps(delivery.to_dict())

    def report(call: Callable[[], Any], deadline: float | None = None) -> Any:
        """The outcome is only here: ride out a Redis outage (with backoff) to record it,
        rather than exit and let the job run again once its holder is found dead. Each try
        beats first, so that the dispatcher, if it answers, does not take us for dead (and run
        the job again) before the outcome lands. `deadline` (monotonic): give up then."""
        backoff = Backoff(f"consumer {c.name}: reporting job {delivery.id}", deadline)
        while True:
            try:
                if backoff.pause:
                    c.heartbeat(busy=1)
                answer = call()
                backoff.ok()
                return answer
            except (redis.RedisError, redis.exceptions.RedisClusterException) as e:
                time.sleep(backoff.after(e))

    def leave() -> None:
        """Leave the list of workers; the outcome is recorded: an outage now is not worth a
        wait beyond a heartbeat's worth (the dispatcher then forgets us in its time)."""
        try:
            report(c.close, time.monotonic() + max(app.settings.heartbeat, 5.0))
        except (redis.RedisError, redis.exceptions.RedisClusterException) as e:
            click.echo(f"could not leave the list of workers ({e}); the dispatcher will drop this consumer", err=True)

    if not command:
        click.echo(payload)
        if not report(lambda: c.ack([delivery])[0]):
            click.echo(f"job {delivery.id} was requeued or killed meanwhile: it was not acked", err=True)
            leave()
            sys.exit(EXIT_REFUSED)
        return leave()
    try:
        proc = subprocess.Popen(list(command), stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True)
    except OSError as e:
        click.echo(f"Error: cannot run {command[0]}: {e}", err=True)
        c.fail(delivery, "CommandFailed", f"{' '.join(command)}: {e}")
        c.close()
        sys.exit(127)
    done, stopped = threading.Event(), []

    def watch() -> None:
        """Keep the job ours while CMD runs (heartbeats, through a Redis outage too) and
        stop CMD as a worker stops a job: on a kill request, or at its max duration when
        its policy is kill (SIGTERM, SIGKILL after kill_grace)."""
        s = app.settings
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
                reason = c.kill_request(delivery, max(0.01, min(beat_at, deadline) - now))
                backoff.ok()
            except (redis.RedisError, redis.exceptions.RedisClusterException) as e:
                done.wait(min(backoff.after(e), s.heartbeat))
        if reason is None or done.is_set():
            return
        stopped.append(reason)
        proc.terminate()
        try:
            proc.wait(s.kill_grace)
        except subprocess.TimeoutExpired:
            proc.kill()

    threading.Thread(target=watch, daemon=True).start()
    try:
        out, err = proc.communicate(payload)
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
    if stopped:
        why = {"killed": "killed on request", "timeout": f"past its max duration ({delivery.max_duration:g} s)"}
        click.echo(f"job {delivery.id} stopped: {why[stopped[0]]}", err=True)
        acked = report(lambda: c.stopped(delivery, stopped[0]))
    elif code == 0:
        try:  # strict JSON, as taskrunner sends: NaN or Infinity (which json.loads takes) make it text
            result = codec.loads(out) if out.strip() else None
        except ValueError:
            result = out
        acked = report(lambda: c.ack([delivery], [result])[0])
    else:
        acked = report(lambda: c.fail(delivery, "CommandFailed", f"{' '.join(command)} exited {code}", err[-4000:]))
    if not acked:
        click.echo(f"job {delivery.id} was requeued or killed meanwhile: this outcome was not recorded", err=True)
    leave()
    sys.exit(EXIT_REFUSED if code == 0 and (stopped or not acked) else code)  # 0 says the job was acked
