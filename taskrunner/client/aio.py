"""An asyncio client: enqueue, wait for and look up jobs from asyncio applications.
Jobs run in ordinary workers; this only talks to Redis (redis.asyncio), through the same
scripts and record format as the synchronous API.

    from taskrunner.client.aio import AsyncClient
    client = AsyncClient(app)                  # app: your TaskRunner (its settings, tasks)
    job_id = await client.enqueue("shop.send", ["a@b.c", "hi"], queue="emails")
    result = await client.wait(job_id, timeout=10)
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from datetime import datetime
from typing import Any, TypeVar

import redis.asyncio as aioredis
from redis.exceptions import ResponseError

from taskrunner.client import canvas, flow, steps
from taskrunner.client.app import TaskRunner, _enqueue_args
from taskrunner.client.canvas import Chain, Chord, Group, Signature
from taskrunner.client.job import Job
from taskrunner.protocol import connection, scripts
from taskrunner.protocol.blocking import slack
from taskrunner.protocol.connection import close_async, connect_async, is_cluster

T = TypeVar("T")


class AsyncClient:
    """The asyncio twin of the synchronous API: the same operations (steps.py), carried
    out with redis.asyncio. Eager mode is the synchronous API's alone."""

    def __init__(self, app: TaskRunner, redis: aioredis.Redis | None = None):
        self.app, self.keys = app, app.keys
        self.redis: connection.AsyncClient = redis or connect_async(app.settings.redis_url)
        self._known_queues: set[str] = set()

    async def _run(self, operation: steps.Steps[T]) -> T:
        """Carry out an operation (steps.run, with redis.asyncio)."""
        answer: Any = None
        error: BaseException | None = None
        while True:
            try:
                request = operation.send(answer) if error is None else operation.throw(error)
            except StopIteration as done:
                return done.value
            try:
                answer, error = await self._answer(request), None
            except Exception as e:
                answer, error = None, e
            except BaseException:
                operation.close()  # cancelled: its finally (Backoff.give_up) runs now, not at its collection
                raise

    async def _answer(self, r: steps.Request) -> Any:
        if isinstance(r, steps.Command):
            return await getattr(self.redis, r.name)(*r.args)
        if isinstance(r, steps.Script):
            return await self._script(r.script, r.keys, r.args)
        if isinstance(r, steps.Scripts):
            return list(await asyncio.gather(*(self._script(c.script, c.keys, c.args) for c in r.calls)))
        if isinstance(r, steps.Clustered):
            return is_cluster(self.redis)
        if isinstance(r, steps.Enqueue):
            keys = self.app.enqueue_keys(r.queue, r.others)
            if len(keys) == 1 and r.queue not in self._known_queues:  # a cluster: the script cannot register it
                await self.redis.sadd(self.keys.queues, r.queue)
                self._known_queues.add(r.queue)
            return await self._script(scripts.ENQUEUE, keys, _enqueue_args(r.jobs, self.app.settings.max_payload))
        if isinstance(r, steps.Pipeline):
            pipe = self.redis.pipeline(transaction=False)
            for c in r.commands:
                getattr(pipe, c.name)(*c.args)
            return await pipe.execute()
        if isinstance(r, steps.Pop):
            return await self._pop(r.command, r.key, r.timeout)
        if isinstance(r, steps.Sleep):
            return await asyncio.sleep(r.seconds)
        raise TypeError(f"not a request: {r!r}")

    async def _script(self, script: scripts.Script, keys: list[str], args: list[Any]) -> Any:
        try:
            try:
                return await self.redis.execute_command(*script.command(self.redis, keys, args))
            except ResponseError as e:
                if not scripts.missing(e):
                    raise
                await self._load(e)
                return await self.redis.execute_command(*script.command(self.redis, keys, args))
        except ResponseError as e:
            raise scripts.refusal(e) from None

    async def _load(self, answer: ResponseError) -> None:
        """scripts.load(), awaited."""
        for command in scripts.loading(self.redis, answer):
            try:
                await self._send_load(command)
            except ResponseError as e:
                if command[0] != "FUNCTION" or not scripts.refused(self.redis, e):
                    raise
                for again in scripts.loading(self.redis, e):
                    await self._send_load(again)
                return

    async def _send_load(self, command: tuple[Any, ...]) -> None:
        """FUNCTION LOAD or SCRIPT LOAD, its two words as one name: redis-py's asyncio cluster
        routes a command by that name (to every primary), and finds no key in the words
        apart; one server's connection splits them again."""
        await self.redis.execute_command(f"{command[0]} {command[1]}", *command[2:])

    async def enqueue(self, task: str, args: list | tuple = (), kwargs: dict | None = None, *,
                      delay: float | None = None, job_id: str | None = None, block_timeout: float | None = None,
                      headers: dict[str, Any] | None = None, depends_on: Iterable[Job | str] | None = None,
                      on_success: Signature | None = None, on_failure: Signature | None = None,
                      priority: int | None = None, unique_for: int | None = None, unique_key: str | None = None,
                      unique_until: str | None = None, expires: float | datetime | None = None, **options: Any) -> str:
        """Enqueue by task name; returns the job id (a unique job's duplicate: the id of the
        job that holds its key). Same options, links (depends_on: Job objects or ids;
        on_success, on_failure: signatures, e.g. app.signature("name")) and errors as
        TaskRunner.enqueue (QueueFull after block_timeout, QueueClosed, NotJSONError...)."""
        fields = flow.fields(task, args, kwargs, priority, unique_for, unique_key, unique_until, expires)
        canvas.refuse_bad_links(fields, delay, depends_on, on_success, on_failure)
        what = f"enqueueing {task}"
        draft = await self._run(steps.riding(self.app, steps.draft(self.app, task, args, kwargs, None, options, delay,
                                                                   job_id, headers, fields), what))
        created = await self._run(steps.riding(self.app, canvas.linked(self.app, draft, depends_on, on_success,
                                                                       on_failure, block_timeout), what))
        return created if isinstance(created, str) else draft.id

    async def apply(self, workflow: Signature | Chain | Group | Chord) -> str | list[str]:
        """Enqueue a workflow (chain, group, chord, or a signature alone) as its apply_async()
        does, through the same operation (on a Redis Cluster, across slots as TaskRunner
        writes it); the id whose wait() gives its result: a chain's last step, a chord's
        callback, the signature's job; a group's ids, in order."""
        if isinstance(workflow, Signature):
            workflow = Chain(workflow)
        jobs = await self._run(steps.riding(self.app, workflow.enqueued(), "enqueueing a workflow"))
        return [j.id for j in jobs] if isinstance(workflow, Group) else jobs[-1].id

    async def _pop(self, command: str, key: str, timeout: float) -> Any:
        """One BRPOP or BLPOP of up to `timeout` seconds (any length) on a connection of its
        own, whose read waits that long plus slack(): the client's socket_timeout (5 s by
        default from redis-py 6 on) would cut off a longer block. On a cluster, to the
        primary of the key's slot; through Sentinel, to the current primary."""
        if isinstance(self.redis, aioredis.RedisCluster):
            await self.redis.initialize()
            maker: Any = self.redis.get_node_from_key(key)
        else:
            maker = self.redis.connection_pool
        conn = maker.connection_class(**maker.connection_kwargs)
        try:
            await conn.connect()
            await conn.send_command(command, key, timeout)
            return await conn.read_response(timeout=timeout + slack(conn.socket_timeout))
        finally:
            await conn.disconnect()

    async def job(self, job_id: str) -> dict[str, Any]:
        """The job's record, as `taskrunner status --json` shows it."""
        return Job(self.app, job_id, *await self._run(steps.find(self.app, job_id))).to_dict()

    async def wait(self, job_id: str, timeout: float | None = None) -> Any:
        """The job's result once it ends (JobFailed if it failed or was killed, Timeout);
        blocks in Redis (BLPOP) and rides out a Redis outage, as Job.wait does."""
        queue, _ = await self._run(steps.find(self.app, job_id))
        job = Job(self.app, job_id, queue, await self._run(steps.wait(self.app, job_id, queue, timeout)))
        if job.data.get("state") == "completed":
            return job.result
        raise job._failure()

    async def kill(self, job_id: str, who: str = "aio") -> str:
        """Kill the job; answers as Job.kill: "killed", "running" (its worker stops it), or
        "already <state>" for a job that had already ended (nothing done)."""
        queue, _ = await self._run(steps.find(self.app, job_id))
        return await self._run(steps.kill(self.app, job_id, queue, who))

    async def close(self) -> None:
        await close_async(self.redis)


__all__ = ["AsyncClient"]
