#!/usr/bin/env node
'use strict';
// Enqueue one job, print its id (and with --wait, its record as JSON once it has ended).
const { parseArgs } = require('util');
const { TaskRunner, Refused, unavailable } = require('./taskrunner');

const USAGE = `usage: node producer.js [options] TASK [ARGS_JSON [KWARGS_JSON]]
  Enqueue one job of TASK (ARGS_JSON: a JSON array, default []; KWARGS_JSON: a JSON object,
  default {}); print its id, or with --wait its record as JSON once it has ended.
  --queue Q                 default: the task's queue as its workers declared it, else default
  --id ID                   default: a new ULID; an existing id is not enqueued again
  --delay S                 seconds before it may run (default 0)
  --expires S               seconds from now by which it must have started: a worker that
                            claims it later does not run it, it ends killed (Expired)
  --max-duration S, --retries N
  --priority 0-9            higher is claimed first within the queue (default 0)
  --concurrency-key K       counts against the task's max_concurrency
  --unique-key K, --unique-for S, --unique-until start|finish
                            while a job holding the key has not ended, enqueue nothing and
                            print that job's id; --unique-for alone makes the key from TASK,
                            ARGS and KWARGS (as Python makes it)
  --depends-on ID           run once job ID (of any queue) completed; repeat it for several
  --wait S                  wait up to S seconds for the job to end; print its record (a
                            Redis outage meanwhile is waited out until then)
  -h, --help                this text
  Redis and key prefix from REDIS_URL and TASKRUNNER_PREFIX. Exit codes (as taskrunner's CLI):
  0 enqueued (with --wait: completed); 1 refused or failed: a closed or full queue, no such
  job (--depends-on, --wait), the job failed, was killed or canceled, an error Redis answered
  with (a NOPERM: the URL's user may not use the task's keys); 2 a mistake in what was
  given (bad options, arguments that are not JSON or do not fit the task, a bad URL, a wrong
  password), or with --wait the job still not ended after S seconds; 3 Redis unreachable for
  now: not answering for TASKRUNNER_ENQUEUE_RETRY seconds (default 15; 0: at the first try),
  or answering READONLY, MASTERDOWN, BUSY, LOADING, TRYAGAIN or CLUSTERDOWN, or with --wait
  still not answering after S seconds (the job's state is unknown): try again.
  e.g. node producer.js --wait 30 shop.add '[40, 2]'`;

// A whole-number flag: its number, or the text as given (refused, and shown, by enqueue).
const count = (s) => (s !== undefined && /^-?[0-9]+$/.test(s) ? Number(s) : s);

// A flag of seconds: its number (undefined when not given); else an error, before anything
// is enqueued (a --wait refused once the job was in would leave it behind). `positive`: > 0.
function seconds(flag, s, positive = false) {
  if (s === undefined) return undefined;
  const n = s.trim() === '' ? NaN : Number(s);
  if (!Number.isFinite(n) || n < 0 || (positive && n === 0)) {
    throw new Error(`--${flag} must be a number of seconds ${positive ? '>' : '>='} 0, not ${JSON.stringify(s)}`);
  }
  return n;
}

// Redis unreachable: ioredis connects again and again, emitting each failure (each was an
// "[ioredis] Unhandled error event" with its stack), and holds the requests meanwhile (the
// producer's client: maxRetriesPerRequest null; ioredis's own limit, 20 tries, failed the
// request after about 11.5 s, exit 2, before the setting's 15 s). Say none of the failures; once the
// first is TASKRUNNER_ENQUEUE_RETRY seconds old and Redis still not ready, give up in one
// line (exit 3), as taskrunner's Python producer does: a timer, as a host that drops packets
// fails only every connectTimeout. A Redis that takes the connection and answers nothing
// (stopped, a hung host) fires no error at all: the enqueue not done that long and a socket
// timeout (5 s, the Python producer's) more after the producer started, it gives up too.
// Answers a function that ends the watch (the job is in, or the call failed: --wait rides
// out an outage until its own end).
function giveUpWhenUnreachable(tr) {
  const setting = Number(process.env.TASKRUNNER_ENQUEUE_RETRY || 15);
  const limit = (Number.isFinite(setting) && setting >= 0 ? setting : 15) * 1000;
  let last = null;
  let timer = null;
  let watching = true;
  const giveUp = (why, ms) => setTimeout(() => {
    console.error(`Error: cannot reach Redis: ${why()} (for ${ms / 1000}s; set REDIS_URL)`);
    process.exit(3);
  }, ms);
  const silent = giveUp(() => (last ? last.message : 'it did not answer'), limit + 5000);
  tr.redis.on('ready', () => {
    clearTimeout(timer);
    timer = null;
  });
  tr.redis.on('error', (e) => {
    if (!unavailable(e)) return; // a refusal (a wrong password) fails the request itself
    last = e;
    if (timer !== null || !watching) return;
    timer = giveUp(() => last.message, limit);
  });
  return () => {
    watching = false;
    clearTimeout(timer);
    clearTimeout(silent);
  };
}

// The exit code of a failure, as taskrunner's CLI sorts them (README, Exit codes): 1 the
// answer is no, 3 Redis unavailable for now, 2 a mistake in what was given.
const exitCode = (e) => (e instanceof Refused || answeredWith(e) ? 1 : unavailable(e) ? 3 : 2);

// An error Redis answered with (a NOPERM, an OOM, a WRONGTYPE): 1, as the CLI's "Redis
// answered with an error" (it was 2, a mistake in what was given); not a refusal of what was
// given: taskrunner's scripts' ("ERR taskrunner: ..."), a credential's or the URL's database's.
const GIVEN = /^(ERR taskrunner: |WRONGPASS|NOAUTH|ERR invalid password|ERR DB index is out of range)/;
const answeredWith = (e) => e !== null && typeof e === 'object' && e.name === 'ReplyError' && !unavailable(e)
  && !GIVEN.test(String(e.message));

// ARGS_JSON or KWARGS_JSON read: a JSON array or object (`kind`), else an error naming it,
// before Redis is asked (it answered "ERR taskrunner: NotJSON: ... args is not a JSON array").
function parsed(name, text, kind) {
  let value;
  try {
    value = JSON.parse(text);
  } catch (e) {
    throw new Error(`${name} is not JSON (${e.message}): ${text}`);
  }
  const isArray = Array.isArray(value);
  if (value === null || typeof value !== 'object' || isArray !== (kind === 'array')) {
    throw new Error(`${name} must be a JSON ${kind}, not ${text}`);
  }
  return value;
}

async function main() {
  const { values: o, positionals: [task, args = '[]', kwargs = '{}'] } = parseArgs({
    allowPositionals: true,
    options: { queue: { type: 'string' }, id: { type: 'string' }, delay: { type: 'string' },
      expires: { type: 'string' }, 'max-duration': { type: 'string' }, retries: { type: 'string' },
      wait: { type: 'string' }, 'depends-on': { type: 'string', multiple: true }, priority: { type: 'string' },
      'concurrency-key': { type: 'string' }, 'unique-key': { type: 'string' }, 'unique-for': { type: 'string' },
      'unique-until': { type: 'string' }, help: { type: 'boolean', short: 'h' } },
  });
  if (o.help) {
    console.log(USAGE);
    return 0;
  }
  if (!task) throw new Error('usage: node producer.js [options] TASK [ARGS_JSON [KWARGS_JSON]] (--help says more)');
  const jobArgs = parsed('ARGS_JSON', args, 'array');
  const jobKwargs = parsed('KWARGS_JSON', kwargs, 'object');
  const delay = seconds('delay', o.delay) || 0;
  const expires = seconds('expires', o.expires, true);
  const wait = seconds('wait', o.wait);
  const tr = new TaskRunner({ options: { maxRetriesPerRequest: null, connectTimeout: 5000 } });
  const enqueued = giveUpWhenUnreachable(tr);
  try {
    const { id, queue, created, duplicate } = await tr.enqueue(task, jobArgs, jobKwargs, {
      queue: o.queue, id: o.id, delay, expires, maxDuration: o['max-duration'], retries: o.retries,
      dependsOn: o['depends-on'], priority: count(o.priority), concurrencyKey: o['concurrency-key'],
      uniqueKey: o['unique-key'], uniqueFor: count(o['unique-for']), uniqueUntil: o['unique-until'] });
    enqueued();
    if (duplicate) console.error(`a job with its unique key exists: ${id} (not enqueued)`);
    else if (!created) console.error(`job ${id} exists already: not enqueued again`);
    if (wait === undefined) {
      console.log(id);
      return 0;
    }
    const record = await tr.wait(id, queue, wait);
    console.log(JSON.stringify(record));
    return record.state === 'completed' ? 0 : 1;
  } finally {
    enqueued(); // a failed call too: its timers must not end the process later
    tr.redis.disconnect();
  }
}

main().then((code) => { process.exitCode = code; }, (e) => {
  console.error(`Error: ${e.message}`);
  process.exitCode = exitCode(e);
});
