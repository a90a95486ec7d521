#!/usr/bin/env node
'use strict';
// Run jobs with the handlers a module exports ({"task.name": async (args, kwargs, ctx) => result}).
//   node consumer.js [--queues a,b] [--name NAME] HANDLERS_MODULE
// Redis and key prefix from REDIS_URL and TASKRUNNER_PREFIX; timings from the TASKRUNNER_*
// settings of README.md (heartbeat, dead_after, max_duration, idle_block, shutdown_grace).
// SIGTERM or SIGINT: no more claims, the running job gets shutdown_grace s, then it leaves.
const path = require('path');
const { parseArgs } = require('util');
const { TaskRunner, Consumer } = require('./taskrunner');

const { values: o, positionals: [handlersPath] } = parseArgs({
  allowPositionals: true,
  options: { queues: { type: 'string', default: 'default' }, name: { type: 'string' } },
});
if (!handlersPath) {
  console.error('usage: consumer.js [--queues a,b] [--name NAME] HANDLERS_MODULE');
  process.exit(2);
}
const consumer = new Consumer(new TaskRunner(), require(path.resolve(handlersPath)),
  { queues: o.queues.split(','), name: o.name });
for (const sig of ['SIGTERM', 'SIGINT']) process.on(sig, () => consumer.stop());
console.log(`consumer ${consumer.name}: queues ${consumer.queues.join(', ')}`);
consumer.start().then(() => {
  console.log(`consumer ${consumer.name}: stopped after ${consumer.processed} jobs`);
  consumer.tr.redis.disconnect();
  process.exit(0); // a handler told to stop may still have timers or sockets open
}, (e) => {
  console.error(`Error: ${e.message}`);
  process.exit(1);
});
