#!/usr/bin/env node
'use strict';
// Enqueue one job, print its id (and with --wait, its record as JSON once it has ended).
//   node producer.js [--queue Q] [--id ID] [--delay S] [--max-duration S] [--retries N]
//                    [--priority 0-9] [--concurrency-key K] [--unique-key K] [--unique-for S]
//                    [--unique-until start|finish] [--depends-on ID]... [--wait SECONDS]
//                    TASK [ARGS_JSON [KWARGS_JSON]]
// --depends-on: run once job ID (of any queue) completed; repeat it for several.
// --unique-for alone: the key is made from TASK, ARGS and KWARGS (as Python makes it). A
// duplicate prints the id of the job that holds the key (and says so on stderr).
// Redis and key prefix from REDIS_URL and TASKRUNNER_PREFIX. Exit codes: 0 enqueued (with
// --wait: completed), 1 the job failed or was killed, 2 bad usage or a refused enqueue.
const { parseArgs } = require('util');
const { TaskRunner } = require('./taskrunner');

// A whole-number flag: its number, or the text as given (refused, and shown, by enqueue).
const count = (s) => (s !== undefined && /^-?[0-9]+$/.test(s) ? Number(s) : s);

// A flag of seconds: its number (undefined when not given); else an error, before anything
// is enqueued (a --wait refused once the job was in would leave it behind).
function seconds(flag, s) {
  if (s === undefined) return undefined;
  const n = s.trim() === '' ? NaN : Number(s);
  if (!Number.isFinite(n) || n < 0) throw new Error(`--${flag} must be a number of seconds >= 0, not ${JSON.stringify(s)}`);
  return n;
}

async function main() {
  const { values: o, positionals: [task, args = '[]', kwargs = '{}'] } = parseArgs({
    allowPositionals: true,
    options: { queue: { type: 'string' }, id: { type: 'string' }, delay: { type: 'string' },
      'max-duration': { type: 'string' }, retries: { type: 'string' }, wait: { type: 'string' },
      'depends-on': { type: 'string', multiple: true }, priority: { type: 'string' },
      'concurrency-key': { type: 'string' }, 'unique-key': { type: 'string' }, 'unique-for': { type: 'string' },
      'unique-until': { type: 'string' } },
  });
  if (!task) throw new Error('usage: producer.js [options] TASK [ARGS_JSON [KWARGS_JSON]]');
  const delay = seconds('delay', o.delay) || 0;
  const wait = seconds('wait', o.wait);
  const tr = new TaskRunner();
  try {
    const { id, queue, created, duplicate } = await tr.enqueue(task, JSON.parse(args), JSON.parse(kwargs), {
      queue: o.queue, id: o.id, delay, maxDuration: o['max-duration'], retries: o.retries,
      dependsOn: o['depends-on'], priority: count(o.priority), concurrencyKey: o['concurrency-key'],
      uniqueKey: o['unique-key'], uniqueFor: count(o['unique-for']), uniqueUntil: o['unique-until'] });
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
    tr.redis.disconnect();
  }
}

main().then((code) => { process.exitCode = code; }, (e) => { console.error(`Error: ${e.message}`); process.exitCode = 2; });
