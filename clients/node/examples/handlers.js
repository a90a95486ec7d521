'use strict';
// Handlers for consumer.js: task name -> async (args, kwargs, ctx) => JSON-able result.
// ctx: {id, queue, attempt, headers, signal}; signal aborts when the job must stop.
const { sleep } = require('../taskrunner');

module.exports = {
  // The same name as the Python demo's task, so either side can run it.
  'tests.apps.add': async ([a, b]) => a + b,
  'node.echo': async (args, kwargs, ctx) => ({ args, kwargs, attempt: ctx.attempt, headers: ctx.headers, runtime: 'node' }),
  // Sleeps `seconds` on its first delivery, unless stopped; later deliveries answer at once.
  'node.slow_add': async ([a, b, seconds], kwargs, ctx) => {
    if (ctx.attempt === 1) {
      await Promise.race([sleep(seconds), new Promise((resolve) => ctx.signal.addEventListener('abort', resolve))]);
    }
    return a + b;
  },
  'node.boom': async ([message]) => { throw new TypeError(message); },
};
