#!/usr/bin/env node
'use strict';
// Run jobs with the handlers a module exports ({"task.name": async (args, kwargs, ctx) => result}).
const path = require('path');
const { parseArgs } = require('util');
const { TaskRunner, Consumer } = require('./taskrunner');

const USAGE = `usage: node consumer.js [--queues a,b] [--name NAME] HANDLERS_MODULE
  Run the jobs of the queues (in priority order; default: default) with the handlers
  HANDLERS_MODULE exports: {"task.name": async (args, kwargs, ctx) => result}, one job at a
  time. A sharded queue: name its shards (--queues Q,Q~1,Q~2).
  --name NAME   unique among live workers (default node.<host>.<pid>)
  -h, --help    this text
  Redis and key prefix from REDIS_URL and TASKRUNNER_PREFIX; timings from the TASKRUNNER_*
  settings of README.md (heartbeat, dead_after, max_duration, idle_block, shutdown_grace).
  SIGTERM or SIGINT: no more claims, the running job gets shutdown_grace s, then it leaves.
  e.g. node consumer.js --queues default,other --name node-1 examples/handlers.js`;

// A mistake in what it was given: one line, exit 2.
function refuse(message) {
  console.error(`Error: ${message}`);
  process.exit(2);
}

let o;
let handlersPath;
try {
  ({ values: o, positionals: [handlersPath] } = parseArgs({
    allowPositionals: true,
    options: { queues: { type: 'string', default: 'default' }, name: { type: 'string' },
      help: { type: 'boolean', short: 'h' } },
  }));
} catch (e) {
  refuse(e.message);
}
if (o.help) {
  console.log(USAGE);
  process.exit(0);
}
if (!handlersPath) refuse('usage: node consumer.js [--queues a,b] [--name NAME] HANDLERS_MODULE (--help says more)');
let handlers;
try {
  handlers = require(path.resolve(handlersPath));
} catch (e) {
  if (e.code !== 'MODULE_NOT_FOUND' || !String(e.message).includes(path.resolve(handlersPath))) throw e;
  refuse(`no handlers module ${handlersPath}`);
}
if (handlers === null || typeof handlers !== 'object') {
  refuse(`${handlersPath} must export an object of task names to handlers, not ${typeof handlers}`);
}
let consumer;
try {
  consumer = new Consumer(new TaskRunner(), handlers, { queues: o.queues.split(','), name: o.name });
} catch (e) {
  refuse(e.message);
}
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
