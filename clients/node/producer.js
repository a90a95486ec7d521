#!/usr/bin/env node
'use strict';
// Enqueue one job, print its id (and with --wait, its record as JSON once it has ended).
//   node producer.js [--queue Q] [--id ID] [--delay S] [--max-duration S] [--retries N]
//                    [--depends-on ID]... [--wait SECONDS] TASK [ARGS_JSON [KWARGS_JSON]]
// --depends-on: run once job ID (of any queue) completed; repeat it for several.
// Redis and key prefix from REDIS_URL and TASKRUNNER_PREFIX. Exit codes: 0 enqueued (with
// --wait: completed), 1 the job failed or was killed, 2 bad usage or a refused enqueue.
const { parseArgs } = require('util');
const { TaskRunner } = require('./taskrunner');

async function main() {
  const { values: o, positionals: [task, args = '[]', kwargs = '{}'] } = parseArgs({
    allowPositionals: true,
    options: { queue: { type: 'string', default: 'default' }, id: { type: 'string' }, delay: { type: 'string' },
      'max-duration': { type: 'string' }, retries: { type: 'string' }, wait: { type: 'string' },
      'depends-on': { type: 'string', multiple: true } },
  });
  if (!task) throw new Error('usage: producer.js [options] TASK [ARGS_JSON [KWARGS_JSON]]');
  const tr = new TaskRunner();
  try {
    const { id, created } = await tr.enqueue(task, JSON.parse(args), JSON.parse(kwargs), {
      queue: o.queue, id: o.id, delay: Number(o.delay || 0), maxDuration: o['max-duration'], retries: o.retries,
      dependsOn: o['depends-on'] });
    if (!created) console.error(`job ${id} exists already: not enqueued again`);
    if (o.wait === undefined) {
      console.log(id);
      return 0;
    }
    const record = await tr.wait(id, o.queue, Number(o.wait));
    console.log(JSON.stringify(record));
    return record.state === 'completed' ? 0 : 1;
  } finally {
    tr.redis.disconnect();
  }
}

main().then((code) => { process.exitCode = code; }, (e) => { console.error(`Error: ${e.message}`); process.exitCode = 2; });
