"""An asyncio client: enqueue, wait for and look up jobs from asyncio applications.
Jobs run in ordinary workers; this only talks to Redis (redis.asyncio), through the same
scripts and record format as the synchronous API.

    from taskrunner.aio import AsyncClient
    client = AsyncClient(app)                  # app: your TaskRunner (its settings, tasks)
    job_id = await client.enqueue("shop.send", ["a@b.c", "hi"], queue="emails")
    result = await client.wait(job_id, timeout=10)
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import redis
import redis.asyncio as aioredis
from redis.exceptions import NoScriptError, ResponseError

from . import codec, declarations, scripts
from .app import TaskRunner, _enqueue_args
from .connection import Backoff, connect_async, is_cluster, slack
from .errors import JobFailed, JobNotFound, QueueClosed, QueueFull, Timeout
from .job import FINAL, LOOK_AGAIN, Job


class AsyncClient:
    def __init__(self, app: TaskRunner, redis: aioredis.Redis | None = None):
        self.app, self.keys = app, app.keys
        self.redis = redis or connect_async(app.settings.redis_url)

    async def _script(self, script: scripts.Script, keys: list[str], args: list[Any]) -> Any:
        try:
            try:
                return await self.redis.evalsha(script.sha, len(keys), *keys, *args)
            except NoScriptError:
                await self.redis.script_load(script.source)
                return await self.redis.evalsha(script.sha, len(keys), *keys, *args)
        except ResponseError as e:
            raise scripts.refusal(e) from None

    async def enqueue(self, task: str, args: list | tuple = (), kwargs: dict | None = None, *,
                      delay: float | None = None, job_id: str | None = None, block_timeout: float | None = None,
                      headers: dict[str, Any] | None = None, **options: Any) -> str:
        """Enqueue by task name; returns the job id. Same options and errors as
        TaskRunner.enqueue (QueueFull after block_timeout, QueueClosed, NotJSONError...)."""
        if task not in self.app.tasks and options.get("queue") is None:  # the queue workers declared
            found, declared = self.app._declared.get(codec.check_name("task", task))
            if not found:
                raw = await self.redis.hget(self.keys.tasks, task)
                declared = self.app._declared.put(task, declarations.parse(task, raw))
            options["queue"] = declared.get("queue", "default") if declared else "default"
        spec, sent = self.app._job_spec(task, options)
        job_id = codec.check_id(job_id) if job_id is not None else codec.new_id()
        headers = self.app._headers(task, args, kwargs, spec.queue, job_id, headers)
        fields = self.app._fields(task, args, kwargs, spec, sent, headers)
        prefix = self.keys.q(spec.queue)
        cluster = is_cluster(self.redis)
        keys = [prefix] if cluster else [prefix, self.keys.queues]
        wait = self.app.settings.block_timeout if block_timeout is None else block_timeout
        deadline = time.monotonic() + wait
        while True:
            [created] = await self._script(scripts.ENQUEUE, keys, _enqueue_args([(job_id, delay or 0, fields)],
                                                                               self.app.settings.max_payload))
            if created == -2:
                raise QueueClosed(f"queue {spec.queue} is closed")
            if created != -1:
                break
            left = deadline - time.monotonic()
            if left <= 0:
                raise QueueFull(f"queue {spec.queue} is full")
            await self._pop("BRPOP", prefix + "notfull", max(0.01, min(left, 1.0)))
        if cluster:  # elsewhere the script registered the queue
            await self.redis.sadd(self.keys.queues, spec.queue)
        return job_id

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

    async def _queue_of(self, job_id: str) -> str:
        queues = sorted(await self.redis.smembers(self.keys.queues))
        for q in queues:
            if await self.redis.exists(self.keys.job(q, job_id)):
                return q
        raise JobNotFound(f"no job {job_id}")

    async def job(self, job_id: str) -> dict[str, Any]:
        """The job's record, as `taskrunner status --json` shows it."""
        q = await self._queue_of(job_id)
        data = await self.redis.hgetall(self.keys.job(q, job_id))
        if not data:
            raise JobNotFound(f"no job {job_id}")
        return Job(self.app, job_id, q, data).to_dict()

    async def wait(self, job_id: str, timeout: float | None = None) -> Any:
        """The job's result once it ends (JobFailed if it failed or was killed, Timeout);
        blocks in Redis (BLPOP) and rides out a Redis outage, as Job.wait does."""
        deadline = None if timeout is None else time.monotonic() + timeout
        backoff = Backoff(f"waiting for job {job_id}", deadline)
        q = None
        while True:
            try:
                q = q or await self._queue_of(job_id)
                prefix = self.keys.q(q)
                state = await self._script(scripts.WATCH, [prefix], [job_id])
                if not state:
                    raise JobNotFound(f"no job {job_id}")
                if state in FINAL:
                    d = await self.job(job_id)
                    if state == "completed":
                        return d.get("result")
                    raise JobFailed(job_id, state, d.get("error_type") or "Error", d.get("error") or "",
                                    d.get("traceback") or "")
                left = LOOK_AGAIN if deadline is None else min(LOOK_AGAIN, deadline - time.monotonic())
                if left <= 0:
                    raise Timeout(f"job {job_id} still {state} after {timeout}s")
                await self._pop("BLPOP", f"{prefix}notify:{job_id}", max(left, 0.01))
                backoff.ok()
            except (redis.RedisError, redis.exceptions.RedisClusterException) as e:
                await asyncio.sleep(backoff.after(e))

    async def kill(self, job_id: str, who: str = "aio") -> str:
        q = await self._queue_of(job_id)
        state, *rest = await self._script(scripts.KILL, [self.keys.q(q)], [job_id, who, self.app.settings.result_ttl])
        if state == "running" and rest[0]:
            key = self.keys.control(rest[0])
            await self.redis.lpush(key, codec.dumps({"kill": job_id, "attempt": int(rest[1]), "reason": "killed"}))
            await self.redis.expire(key, 3600)
        return state

    async def close(self) -> None:
        await self.redis.aclose()


__all__ = ["AsyncClient"]
