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
  --name NAME   unique among live workers: one a live worker holds is refused (exit 2)
                (default node.<host>.<pid>)
  -h, --help    this text
  Redis and key prefix from REDIS_URL and TASKRUNNER_PREFIX; timings from the TASKRUNNER_*
  settings of README.md (heartbeat, dead_after, max_duration, idle_block, shutdown_grace,
  kill_grace). SIGTERM or SIGINT: no more claims, the running job gets shutdown_grace s, then
  it leaves; with Redis unavailable, kill_grace + 10 s after that at most.
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
// Said once, as a worker says it: the stop may take the grace, and more while Redis is unavailable.
function stop() {
  if (consumer.stopping) return;
  const d = consumer.current;
  const running = d && !d.controller.signal.aborted;
  console.log(`consumer ${consumer.name}: stopping${running ? `; job ${d.id} has ${consumer.shutdownGrace}s to finish` : ''}`);
  consumer.stop();
}
for (const sig of ['SIGTERM', 'SIGINT']) process.on(sig, stop);
console.log(`consumer ${consumer.name}: queues ${consumer.queues.join(', ')}`);
consumer.start().then(() => {
  console.log(`consumer ${consumer.name}: stopped after ${consumer.processed} jobs`);
  consumer.tr.redis.disconnect();
  process.exit(0); // a handler told to stop may still have timers or sockets open
}, (e) => {
  console.error(`Error: ${e.message}`);
  process.exit(e.name === 'NameInUse' ? 2 : 1); // a name taken is a mistake in what was given, as a worker's
});
