'use strict';
// A minimal taskrunner client for Node.js, written from docs/PROTOCOL.md alone: a producer
// (enqueue, wait) and a consumer (heartbeat, claim, run a JS handler, finish, kill requests,
// max duration, a clean leave). Section names in comments are those of PROTOCOL.md.
const crypto = require('crypto');
const fs = require('fs');
const os = require('os');
const path = require('path');
const Redis = require('ioredis');

const NAME = /^[A-Za-z0-9][A-Za-z0-9_.:@-]{0,199}$/;
const ID = /^[A-Za-z0-9_.:@-]{1,200}$/;
const FINAL = new Set(['completed', 'failed', 'killed', 'canceled']);
// Answers of a Redis that cannot take the request for now (a replica, a failover, a script
// running, a dataset loading): try again, as a network error.
const NOT_NOW = /^(READONLY|MASTERDOWN|BUSY|LOADING|TRYAGAIN|CLUSTERDOWN)\b/;

// The answer is no (a closed or full queue, no such job): what was asked was understood.
class Refused extends Error {
  constructor(message) {
    super(message);
    this.name = 'Refused';
  }
}

// Redis could not be reached in time: what happened is unknown, try again.
class Unreachable extends Error {
  constructor(message) {
    super(message);
    this.name = 'Unreachable';
  }
}

// Whether `e` says Redis is unavailable for now (not that it refused the request): a network
// error (one of a socket's system calls: a file's, as a scripts directory that is not there,
// is a mistake), ioredis giving up its retries of a request or a cluster, a closed
// connection, or an answer of NOT_NOW.
const NET_CALLS = new Set(['connect', 'read', 'write', 'getaddrinfo']);
function unavailable(e) {
  if (e === null || typeof e !== 'object') return false;
  return NET_CALLS.has(e.syscall) || e instanceof Unreachable || e.name === 'MaxRetriesPerRequestError'
    || e.name === 'ClusterAllFailedError' || e.message === 'Connection is closed.' || NOT_NOW.test(String(e.message));
}
// The fields of an outbox entry join.lua takes after child, parent, task and state (Across slots).
const NEWS = ['result', 'error_type', 'error', 'canceled_by'];

function setting(name, fallback) {
  const v = process.env[name];
  return v === undefined || v === '' ? fallback : v;
}

function checkName(kind, s) {
  if (typeof s !== 'string' || !NAME.test(s)) throw new Error(`invalid ${kind} name ${JSON.stringify(s)}`);
  return s;
}

const shown = (v) => (typeof v === 'string' ? JSON.stringify(v) : String(v));

function whole(name, v, min, max) {
  if (!Number.isInteger(v) || v < min || v > max) {
    throw new Error(`${name} must be a whole number from ${min} to ${max}, not ${shown(v)}`);
  }
  return v;
}

// A job's `expires` (PROTOCOL.md, Expiry): seconds from now (a finite number > 0 and < 2^53)
// or a Date, as the seconds from now until it (one that has passed is refused: the job could
// never run). enqueue.lua adds them to Redis's clock; a claim at or after that time ends the
// job killed, Expired, instead of running it.
function expiry(v) {
  if (v instanceof Date) {
    const left = (v.getTime() - Date.now()) / 1000;
    if (!Number.isFinite(left)) throw new Error('expires must be a valid Date, not an invalid one');
    if (left <= 0) throw new Error(`expires ${v.toISOString()} has passed: the job could never run`);
    return left;
  }
  if (typeof v !== 'number' || !Number.isFinite(v) || v <= 0 || v >= 2 ** 53) {
    throw new Error(`expires must be seconds from now (a finite number > 0 and < 2^53) or a Date, not ${shown(v)}`);
  }
  return v;
}

// Unique jobs (PROTOCOL.md, Pause, priorities, unique jobs): what enqueue.lua takes as a key.
const UNIQUE_KEY = /^[!-~]{1,200}$/;
const INT_MIN = -(2n ** 63n); // the integers orjson reads as ints; others are floats in Python
const INT_MAX = 2n ** 64n - 1n;

// A JSON number as Python writes it after reading it (orjson): an integer in [-2^63, 2^64-1]
// in digits; any other number is a float, in its shortest digits, in plain decimal with at
// least one digit after the point for decimal exponents -5 to 15 (0.00001, 100.0), else as
// d.ddde+x / d.ddde-x (1e+16, 1.5e-7).
function pyNumber(x) {
  const text = JSON.stringify(x); // what the job's JSON holds ("null" for NaN and Infinity)
  if (text === 'null') return text;
  if (/^-?[0-9]+$/.test(text) && BigInt(text) >= INT_MIN && BigInt(text) <= INT_MAX) return text;
  const [mantissa, exponent] = x.toExponential().split('e'); // the shortest digits that give x
  const e = Number(exponent);
  const sign = x < 0 ? '-' : '';
  const digits = mantissa.replace(/[-.]/g, '');
  if (e < -5 || e > 15) {
    return `${sign}${digits[0]}${digits.length > 1 ? '.' + digits.slice(1) : ''}e${e < 0 ? '-' : '+'}${Math.abs(e)}`;
  }
  if (e < 0) return `${sign}0.${'0'.repeat(-e - 1)}${digits}`;
  return `${sign}${digits.slice(0, e + 1).padEnd(e + 1, '0')}.${digits.slice(e + 1) || '0'}`;
}

// The canonical JSON of a parsed JSON value, byte for byte as taskrunner's Python producer
// writes it (orjson, OPT_SORT_KEYS): no spaces, object keys in code point order (UTF-8
// byte order, not JavaScript's UTF-16 order), strings escaped as JSON.stringify does, numbers
// as pyNumber.
function canonical(v) {
  if (v === null || typeof v === 'boolean' || typeof v === 'string') return JSON.stringify(v);
  if (typeof v === 'number') return pyNumber(v);
  if (Array.isArray(v)) return `[${v.map(canonical).join(',')}]`;
  const keys = Object.keys(v).sort((a, b) => Buffer.compare(Buffer.from(a), Buffer.from(b)));
  return `{${keys.map((k) => `${JSON.stringify(k)}:${canonical(v[k])}`).join(',')}}`;
}

// The unique key of `uniqueFor` without `uniqueKey`: the SHA-1 (hex) of the canonical JSON of
// [task, args, kwargs] as a Python worker reads the job (args and kwargs as they are written),
// the key taskrunner's Python producer makes for the same job. Whole numbers are read as ints
// there: Python's 2.0 (a float) and Node's 2 give different keys.
function uniqueKeyOf(task, args = [], kwargs = {}) {
  const text = `[${JSON.stringify(task)},${canonical(JSON.parse(JSON.stringify(args)))},`
    + `${canonical(JSON.parse(JSON.stringify(kwargs)))}]`;
  return crypto.createHash('sha1').update(text, 'utf8').digest('hex');
}

// Names: a ULID, 26 Crockford base-32 characters that sort by creation time.
function ulid() {
  const abc = '0123456789ABCDEFGHJKMNPQRSTVWXYZ';
  let t = Date.now();
  let out = '';
  for (let i = 0; i < 10; i++, t = Math.floor(t / 32)) out = abc[t % 32] + out;
  for (const b of crypto.randomBytes(16)) out += abc[b % 32];
  return out;
}

// A Redis Cluster: redis+cluster://[[user]:password@]host[:port][,host[:port]...] (the form
// taskrunner's Python client takes; options after "?" are ignored here). null for another URL.
function clusterOf(url) {
  const m = /^redis\+cluster:\/\/(?:([^@/]*)@)?([^/?]+)/.exec(url);
  if (!m) return null;
  const [user, password] = m[1] === undefined ? [] : m[1].split(':').map(decodeURIComponent);
  const nodes = m[2].split(',').map((hp) => {
    const v6 = /^\[([^\]]+)\](?::(\d+))?$/.exec(hp);
    const [host, port] = v6 ? [v6[1], v6[2]] : hp.split(':');
    return { host, port: Number(port || 6379) };
  });
  return { nodes, redisOptions: { username: user || undefined, password: password || undefined } };
}

// Outbox entries as a script answers them after its n values ([[stream id, [field, value, ...]], ...]).
function entries(answer, n) {
  if (answer.length <= n) return [];
  return answer[n].map(([sid, flat]) => {
    const e = { sid };
    for (let i = 0; i < flat.length; i += 2) e[flat[i]] = flat[i + 1];
    return e;
  });
}

function push(map, key, value) {
  if (!map.has(key)) map.set(key, []);
  map.get(key).push(value);
}

// The enqueue fields of a job's flow control (PROTOCOL.md, Enqueue; Flow control; Pause,
// priorities, unique jobs), checked here as taskrunner's Python producer checks them, so that a
// mistake is one line before Redis (enqueue.lua checks them again). None given: no field, so
// the job costs nothing more. `priority`: 0-9, higher claimed first within the queue (0: as
// none). `concurrencyKey`: the key whose running jobs count against its task's
// max_concurrency (needs one, declared or sent: else enqueue.lua refuses it). `uniqueKey`:
// while a job of the queue holding it has not ended (`uniqueUntil` "finish", the default) or
// started ("start"), another with it is not added; `uniqueFor`: seconds the lock lasts at most,
// alone it locks uniqueKeyOf(task, args, kwargs). `unique`: whether the job may have a lock
// (not as part of a workflow).
function flow(task, args, kwargs, opts, unique) {
  const out = [];
  if (opts.priority !== undefined && whole('priority', opts.priority, 0, 9) > 0) out.push('priority', String(opts.priority));
  if (opts.concurrencyKey !== undefined) out.push('concurrency_key', checkName('concurrency key', opts.concurrencyKey));
  const { uniqueKey, uniqueFor, uniqueUntil } = opts;
  if (uniqueKey === undefined && uniqueFor === undefined && uniqueUntil === undefined) return out;
  if (!unique) {
    throw new Error('a unique job cannot be part of a workflow (a chain, group or chord, dependsOn, onSuccess, onFailure)');
  }
  if (uniqueUntil !== undefined && uniqueUntil !== 'start' && uniqueUntil !== 'finish') {
    throw new Error(`uniqueUntil must be "start" or "finish", not ${shown(uniqueUntil)}`);
  }
  if (uniqueKey === undefined && uniqueFor === undefined) throw new Error('uniqueUntil needs uniqueKey or uniqueFor');
  if (uniqueFor !== undefined) whole('uniqueFor', uniqueFor, 1, 2 ** 31 - 1);
  if (uniqueKey !== undefined && (typeof uniqueKey !== 'string' || !UNIQUE_KEY.test(uniqueKey))) {
    throw new Error(`uniqueKey must be 1-200 printable ASCII characters without spaces, not ${shown(uniqueKey)}`);
  }
  out.push('unique_key', uniqueKey === undefined ? uniqueKeyOf(task, args, kwargs) : uniqueKey);
  if (uniqueUntil !== undefined) out.push('unique_until', uniqueUntil);
  if (uniqueFor !== undefined) out.push('unique_for', String(uniqueFor));
  return out;
}

// A job's arguments checked against its task's declared `params` (PROTOCOL.md, Task
// declarations), as taskrunner's Python producer checks them (taskrunner/client/arguments.py):
// Python's Signature.bind rules and wording, so that a job that would fail in a worker with a
// TypeError is refused here, one line naming the task and its signature. Python's parameter
// kinds, in the order a signature must keep them:
const [POSITIONAL_ONLY, POSITIONAL_OR_KEYWORD, VAR_POSITIONAL, KEYWORD_ONLY, VAR_KEYWORD] = [0, 1, 2, 3, 4];
const PY_NAME = /^[\p{L}\p{Nl}_][\p{L}\p{Nl}\p{Mn}\p{Mc}\p{Nd}\p{Pc}]*$/u;
const PY_KEYWORDS = new Set(['False', 'None', 'True', 'and', 'as', 'assert', 'async', 'await', 'break', 'class',
  'continue', 'def', 'del', 'elif', 'else', 'except', 'finally', 'for', 'from', 'global', 'if', 'import', 'in', 'is',
  'lambda', 'nonlocal', 'not', 'or', 'pass', 'raise', 'return', 'try', 'while', 'with', 'yield']);

class BadArguments extends Error {
  constructor(message) {
    super(message);
    this.name = 'BadArguments';
  }
}

// The parameters a declaration's `params` describe ({name, kind, optional}) and the signature
// as Python shows it ("(a, /, b, c=..., *, d, **kw)"); null where they are not as Python writes
// them (absent, another language's worker, a corrupt declaration): nothing is checked then.
function signatureOf(params) {
  if (!Array.isArray(params) || !params.every((w) => typeof w === 'string')) return null;
  let mode = params.includes('/') ? POSITIONAL_ONLY : POSITIONAL_OR_KEYWORD;
  const ps = [];
  for (const w of params) {
    if (w === '/') mode = POSITIONAL_OR_KEYWORD;
    else if (w === '*') mode = KEYWORD_ONLY;
    else if (w.startsWith('**')) ps.push({ name: w.slice(2), kind: VAR_KEYWORD, optional: false });
    else if (w.startsWith('*')) {
      ps.push({ name: w.slice(1), kind: VAR_POSITIONAL, optional: false });
      mode = KEYWORD_ONLY;
    } else if (w.endsWith('=')) ps.push({ name: w.slice(0, -1), kind: mode, optional: true });
    else ps.push({ name: w, kind: mode, optional: false });
  }
  // What Python refuses to make a signature of: a name that is not one, a name twice, a kind
  // out of order, a positional parameter without a default after one with.
  let top = POSITIONAL_ONLY;
  let defaulted = false;
  const names = new Set();
  for (const p of ps) {
    if (!PY_NAME.test(p.name) || PY_KEYWORDS.has(p.name) || names.has(p.name) || p.kind < top) return null;
    if (p.kind <= POSITIONAL_OR_KEYWORD && !p.optional && defaulted) return null;
    defaulted = defaulted || (p.kind <= POSITIONAL_OR_KEYWORD && p.optional);
    top = p.kind;
    names.add(p.name);
  }
  const words = [];
  let slashDue = false;
  let starDue = true;
  for (const p of ps) {
    if (p.kind === POSITIONAL_ONLY) slashDue = true;
    else if (slashDue) {
      words.push('/');
      slashDue = false;
    }
    if (p.kind === VAR_POSITIONAL) starDue = false;
    else if (p.kind === KEYWORD_ONLY && starDue) {
      words.push('*');
      starDue = false;
    }
    words.push(({ [VAR_POSITIONAL]: '*', [VAR_KEYWORD]: '**' }[p.kind] || '') + p.name + (p.optional ? '=...' : ''));
  }
  if (slashDue) words.push('/');
  return { params: ps, shown: `(${words.join(', ')})` };
}

// What Python's Signature.bind says of `n` positional arguments and `kwargs`, or null: they bind.
function unbound(ps, n, kwargs) {
  const left = new Set(Object.keys(kwargs));
  const onlyPositional = (p) => `'${p.name}' parameter is positional only, but was passed as a keyword`;
  let i = 0;
  let rest = []; // the parameter the positional arguments stopped at, when keywords may fill it
  for (let given = 0; ; given++) {
    const p = ps[i++];
    if (given === n) {
      if (p === undefined || p.kind === VAR_POSITIONAL) break;
      if (left.has(p.name) && p.kind === POSITIONAL_ONLY) return onlyPositional(p);
      if (left.has(p.name) || p.kind === VAR_KEYWORD || p.optional) {
        rest = [p];
        break;
      }
      return `missing a required argument: '${p.name}'`;
    }
    if (p === undefined || p.kind === KEYWORD_ONLY || p.kind === VAR_KEYWORD) return 'too many positional arguments';
    if (p.kind === VAR_POSITIONAL) break;
    if (left.has(p.name) && p.kind !== POSITIONAL_ONLY) return `multiple values for argument '${p.name}'`;
  }
  let anyKeyword = false;
  for (const p of [...rest, ...ps.slice(i)]) {
    if (p.kind === VAR_KEYWORD) anyKeyword = true;
    else if (p.kind === VAR_POSITIONAL) continue;
    else if (!left.has(p.name)) {
      if (!p.optional) return `missing a required argument: '${p.name}'`;
    } else if (p.kind === POSITIONAL_ONLY) return onlyPositional(p);
    else left.delete(p.name);
  }
  return left.size && !anyKeyword ? `got an unexpected keyword argument '${left.values().next().value}'` : null;
}

// Throw BadArguments unless `args` and `kwargs` fit the task's declared `params` (nothing
// declared, or not as Python writes it: nothing to check). `fed`: the job is given a value
// first when it becomes pending (a chain step, a callback: not immutable), counted as its first
// argument.
const SIGNATURES = new WeakMap(); // params (as kept with their declaration) -> signatureOf(them), read once
function checkArguments(task, params, args, kwargs, fed = false) {
  if (Array.isArray(params) && !SIGNATURES.has(params)) SIGNATURES.set(params, signatureOf(params));
  const sig = Array.isArray(args) && Array.isArray(params) ? SIGNATURES.get(params) : null;
  const why = sig && unbound(sig.params, args.length + (fed ? 1 : 0), kwargs || {});
  if (why) {
    const first = fed ? ' (counting the value it is given first, its parent\'s result or error; an immutable step, '
      + 'immutable: true, is given none)' : '';
    throw new BadArguments(`${task}${sig.shown}: ${why}${first}`);
  }
}

// Loading a script: the text of _lib.lua, a newline, then <name>.lua; SCRIPT LOAD, EVALSHA,
// and load it again after a NOSCRIPT reply (Redis restarted, a promoted replica).
// Sharded queues (PROTOCOL.md, Sharded queues): shard i >= 1 of queue Q is the queue `Q~i`;
// a job goes to shard crc32(key) mod N of its key, else round robin.
const SHARD = /^[A-Za-z0-9][A-Za-z0-9_.:@-]{0,199}~[1-9][0-9]?$/;
// Put a draft (TaskRunner.draft) in another queue: its queue and its record's field.
// The field is found among the keys (even indices): a task named "queue" is a value.
function move(d, queue) {
  d.queue = queue;
  const at = d.fields.findIndex((f, i) => i % 2 === 0 && f === 'queue');
  d.fields[at + 1] = queue;
}
const KEEP_MS = 10000; // how long a shard count or a declaration read is kept
const CRC = Array.from({ length: 256 }, (_, n) => {
  let c = n;
  for (let k = 0; k < 8; k++) c = c & 1 ? 0xedb88320 ^ (c >>> 1) : c >>> 1;
  return c >>> 0;
});
function crc32(text) {
  let c = 0xffffffff;
  for (const b of Buffer.from(text, 'utf8')) c = CRC[(c ^ b) & 0xff] ^ (c >>> 8);
  return (c ^ 0xffffffff) >>> 0;
}

class Scripts {
  constructor(redis, dir) {
    this.redis = redis;
    this.dir = dir;
    this.source = {};
  }

  async call(name, keys, args) {
    if (!this.source[name]) {
      const lib = fs.readFileSync(path.join(this.dir, '_lib.lua'), 'utf8');
      const src = lib + '\n' + fs.readFileSync(path.join(this.dir, `${name}.lua`), 'utf8');
      this.source[name] = { src, sha: crypto.createHash('sha1').update(src).digest('hex') };
    }
    const { src, sha } = this.source[name];
    try {
      return await this.redis.evalsha(sha, keys.length, ...keys, ...args);
    } catch (e) {
      if (!String(e.message).startsWith('NOSCRIPT')) throw e;
      const nodes = this.redis.isCluster ? this.redis.nodes('master') : [this.redis]; // a cluster: every primary
      await Promise.all(nodes.map((n) => n.script('LOAD', src)));
      return this.redis.evalsha(sha, keys.length, ...keys, ...args);
    }
  }
}

class TaskRunner {
  // `options`: ioredis's, for each server's connection (e.g. maxRetriesPerRequest: null to
  // hold requests while Redis is down, however long, as the producer does).
  constructor({ url = setting('REDIS_URL', 'redis://127.0.0.1:6379/0'), prefix = setting('TASKRUNNER_PREFIX', 'tr'),
    scriptsDir = setting('TASKRUNNER_SCRIPTS', path.join(__dirname, '..', '..', 'taskrunner', 'protocol', 'scripts')),
    options = {} } = {}) {
    this.url = url;
    this.prefix = prefix;
    const cluster = clusterOf(url);
    this.cluster = cluster !== null;
    this.redis = cluster
      ? new Redis.Cluster(cluster.nodes, { lazyConnect: true, redisOptions: { ...options, ...cluster.redisOptions } })
      : new Redis(url, { ...options, lazyConnect: true });
    this.failedTtl = setting('TASKRUNNER_FAILED_TTL', '604800');
    this.registered = new Set(); // queues added to P:{_}:queues by this producer (a cluster)
    this.kept = new Map(); // "shards <queue>" or "task <name>" -> [until (ms), value]: read at most once per KEEP_MS
    this.outage = null; // {say, since, down}: once tellOutages() was called
    this.turn = crc32(String(Date.now())); // round robin over a sharded queue's shards, from a start of our own
    this.scripts = new Scripts(this.redis, scriptsDir);
    this.g = `${prefix}:{_}:`;
  }

  q(queue) { return `${this.prefix}:{${queue}}:`; }

  // For blocking commands (BRPOP): watched for outages as this.redis is (tellOutages).
  connection() {
    const conn = this.redis.duplicate();
    if (this.outage) this.watch(conn);
    return conn;
  }

  // Say an outage in two lines through `say`: one when Redis stops answering, one when it
  // answers again, for this.redis and every connection() after. ioredis connects again by
  // itself, emitting each failure on each connection; unheard, each was printed with its
  // stack ("[ioredis] Unhandled error event": about a hundred lines in 8 s for a consumer).
  tellOutages(say) {
    this.outage = { say, since: null, down: new Set(), failed: false };
    this.watch(this.redis);
  }

  // A request that failed (`what`: which), said through the outage's `say`; while Redis is
  // unavailable only the first is, as each try's failure is no news then.
  failed(what, e) {
    const o = this.outage;
    if (o.since !== null && o.failed) return;
    o.failed = o.since !== null;
    o.say(`${what}: ${e.message}; trying again`);
  }

  // The outage lasts until a connection is ready while none that failed is still trying
  // (one that ended, closed on purpose, tries no more).
  watch(conn) {
    const o = this.outage;
    conn.on('error', (e) => {
      if (!e.syscall) return; // not the network's (a refused password): no outage
      o.down.add(conn);
      if (o.since !== null) return;
      o.since = Date.now();
      o.say(`Redis unavailable (${e.message}); trying again until it answers`);
    });
    conn.on('ready', () => {
      o.down.delete(conn);
      if (o.since === null || o.down.size) return;
      o.say(`Redis answers again (unavailable for ${((Date.now() - o.since) / 1000).toFixed(1)}s)`);
      o.since = null;
      o.failed = false;
    });
    conn.on('end', () => o.down.delete(conn));
  }

  // A value keep() read less than KEEP_MS ago, else undefined (nothing is read).
  recalled(key) {
    const hit = this.kept.get(key);
    return hit && hit[0] > Date.now() ? hit[1] : undefined;
  }

  // A value read from Redis by `read()`, kept KEEP_MS (a queue not sharded: no command per job).
  async keep(key, read) {
    const hit = this.recalled(key);
    if (hit !== undefined) return hit;
    const value = await read();
    this.kept.set(key, [Date.now() + KEEP_MS, value]);
    return value;
  }

  // Put a draft on its queue's shard, as taskrunner's Python producer does: by the hash of
  // `c:<concurrency key>` (the task's name by default) when its task has max_concurrency,
  // else `r:<task>` when it has a rate limit (as sent, else as declared), else
  // `u:<unique key>`, else `i:<id>` for an id given; else round robin. A draft given no
  // queue goes to the task's, as its workers declared it, else `default` (as with Python's
  // producer: the settings enqueue.lua fills in are that queue's). Before anything
  // names its queue (a parent's edge). The job's arguments are checked against the task's
  // declared `params` where the declaration is at hand: read for its queue or a sharded
  // queue's placement, or read so less than KEEP_MS ago; never read for the check alone (a
  // plain queue's job costs no command more, as with Python's producer, which checks when it
  // looked it up anyway).
  async place(d, opts = {}) {
    const { task, args, kwargs, fed } = d.call;
    // Redis's error is thrown, as with Python's producer (a NOPERM taken for "nothing declared"
    // put the job in default, unchecked, and kept that 10 s); a declaration that is not JSON
    // declares nothing.
    const read = () => this.keep(`task ${task}`, async () => {
      const raw = await this.redis.hget(this.g + 'tasks', task);
      try { return JSON.parse(raw) || {}; } catch { return {}; }
    });
    if (d.unnamed) {
      const { queue } = await read();
      move(d, typeof queue === 'string' && NAME.test(queue) ? queue : 'default');
    }
    const n = SHARD.test(d.queue) ? 1
      : Number(await this.keep(`shards ${d.queue}`, () => this.redis.hget(this.q(d.queue) + 'meta', 'shards')));
    const declared = !(n > 1) ? this.recalled(`task ${task}`) : await read();
    checkArguments(task, (declared || {}).params, args, kwargs, fed);
    if (!(n > 1)) return d;
    const f = {};
    for (let i = 0; i < d.fields.length; i += 2) f[d.fields[i]] = d.fields[i + 1];
    let key = null;
    if (f.max_concurrency || declared.max_concurrency) key = `c:${f.concurrency_key || f.task}`;
    else if (f.rate_limit || declared.rate_limit) key = `r:${f.task}`;
    else if (f.unique_key !== undefined) key = `u:${f.unique_key}`;
    else if (opts.id) key = `i:${opts.id}`;
    const i = key === null ? (this.turn++) % n : crc32(key) % n;
    if (i > 0) move(d, `${d.queue}~${i}`);
    return d;
  }

  // A job as enqueue.lua takes it (Enqueue): {id, queue, delay, fields}, `unnamed` when given
  // no queue (place() puts it in the task's). `opts`: queue, id,
  // delay, expires (expiry()), maxDuration, retries, retryBackoff, timeoutPolicy, maxLost, headers, and flow
  // control (flow()): priority, concurrencyKey, and with `unique` (a job alone, not part of
  // a workflow) uniqueKey, uniqueFor, uniqueUntil. `fed`: the job is given its parent's result
  // (or error) first (checkArguments).
  draft(task, args = [], kwargs = {}, opts = {}, { unique = false, fed = false } = {}) {
    const unnamed = opts.queue === undefined || opts.queue === null; // '' is a name, and not a valid one
    const queue = unnamed ? 'default' : SHARD.test(opts.queue) ? opts.queue : checkName('queue', opts.queue);
    const id = opts.id || ulid();
    if (!ID.test(id)) throw new Error(`invalid job id ${JSON.stringify(id)}`);
    const fields = ['task', checkName('task', task), 'queue', queue, 'args', JSON.stringify(args),
      'kwargs', JSON.stringify(kwargs), 'producer', `${os.hostname()}:${process.pid}:node`];
    const optional = { maxDuration: 'max_duration', retries: 'retries', retryBackoff: 'retry_backoff',
      timeoutPolicy: 'timeout_policy', maxLost: 'max_lost' };
    for (const [k, field] of Object.entries(optional)) if (opts[k] !== undefined) fields.push(field, String(opts[k]));
    if (opts.headers && Object.keys(opts.headers).length) fields.push('headers', JSON.stringify(opts.headers));
    if (opts.expires !== undefined) fields.push('expires', String(expiry(opts.expires)));
    fields.push(...flow(task, args, kwargs, opts, unique));
    return { id, queue, delay: opts.delay || 0, fields, call: { task, args, kwargs, fed }, unnamed };
  }

  // One enqueue.lua call for jobs of `queue` (and of `others`, one Redis server only): its
  // answers. KEYS[2] registers the queues; on a cluster, where it is in another slot, SADD
  // does (once per queue and producer).
  async call(queue, drafts, others = []) {
    const args = [drafts.length];
    for (const d of drafts) args.push(d.id, d.delay, d.fields.length / 2, ...d.fields);
    if (!this.cluster) {
      return this.scripts.call('enqueue', [this.q(queue), this.g + 'queues', ...others.map((q) => this.q(q))], args);
    }
    if (!this.registered.has(queue)) {
      await this.redis.sadd(this.g + 'queues', queue);
      this.registered.add(queue);
    }
    return this.scripts.call('enqueue', [this.q(queue)], args);
  }

  // Enqueue jobs in one enqueue.lua call, into the first one's queue: KEYS[3..] are the other
  // queues of the jobs and of their parents (Workflows). Nothing is written when a queue
  // refuses one. On a cluster, jobs of several queues are several calls (across). Answers
  // 1 or 0 per job.
  async write(drafts, parentQueues = []) {
    const first = drafts[0].queue;
    const others = [...new Set([...drafts.map((d) => d.queue), ...parentQueues])].filter((q) => q !== first).sort();
    if (this.cluster && others.length) return this.across(drafts);
    const answers = await this.call(first, drafts, others);
    const closed = answers.indexOf(-2);
    if (closed >= 0) throw new Refused(`queue ${drafts[closed].queue} is closed`);
    if (answers.includes(-1)) throw new Refused(`queue ${first} is full`);
    return answers;
  }

  // Across slots (PROTOCOL.md, Workflows: Across slots): a workflow over several queues of a
  // cluster, written as taskrunner's Python producer writes it. Parents go before their
  // children: a parent is written with cross_children naming its children of other queues
  // (each child with cross_slot 1), and an existing parent (dependsOn) learns of its child by
  // attach.lua first. One enqueue.lua call per level and queue, level by level: a job's level
  // is one more than its parents' in other queues, as high as its parents' in its own; then
  // each parent goes as late as its children allow (a parent in its child's queue is written
  // in the child's call: written a call before, it could fail before the child exists, which
  // enqueue.lua then refuses). The drafts are in an order where parents come first. A
  // refusal kills the jobs written before.
  async across(drafts) {
    const key = (q, id) => `${q} ${id}`;
    const mine = new Set(drafts.map((d) => key(d.queue, d.id)));
    const level = new Map();
    const cross = new Map(); // parent -> its children in other queues, "<queue> <id> <takes>"
    const children = new Map(); // parent -> its children among the drafts, [queue, id]
    const attach = new Map(); // [parent queue, child queue, child id, takes] as JSON -> parent ids
    for (const d of drafts) {
      const f = {};
      for (let i = 0; i < d.fields.length; i += 2) f[d.fields[i]] = d.fields[i + 1];
      const words = (f.parents || '').split(' ').filter(Boolean);
      let lv = 0;
      let far = false;
      for (let i = 0; i < words.length; i += 2) {
        const [q, pid] = [words[i], words[i + 1]];
        if (mine.has(key(q, pid))) push(children, key(q, pid), [d.queue, d.id]);
        if (q === d.queue) {
          lv = Math.max(lv, level.get(key(q, pid)) || 0);
          continue;
        }
        far = true;
        if (mine.has(key(q, pid))) {
          lv = Math.max(lv, level.get(key(q, pid)) + 1);
          push(cross, key(q, pid), `${d.queue} ${d.id} ${f.takes || '-'}`);
        } else {
          push(attach, JSON.stringify([q, d.queue, d.id, f.takes || '-']), pid);
        }
      }
      level.set(key(d.queue, d.id), lv);
      if (far) d.fields.push('cross_slot', '1');
    }
    for (const d of [...drafts].reverse()) {
      const kids = children.get(key(d.queue, d.id));
      if (kids) level.set(key(d.queue, d.id), Math.min(...kids.map(([q, id]) => level.get(key(q, id)) - (q !== d.queue))));
    }
    for (const d of drafts) {
      if (cross.has(key(d.queue, d.id))) d.fields.push('cross_children', cross.get(key(d.queue, d.id)).join(' '));
    }
    const news = []; // what attach.lua left for children of parents that completed
    for (const [k, pids] of attach) {
      const [pq, cq, cid, takes] = JSON.parse(k);
      news.push(...entries(await this.scripts.call('attach', [this.q(pq)], [cq, cid, takes, ...pids]), pids.length));
    }
    const calls = new Map();
    for (const d of drafts) push(calls, JSON.stringify([level.get(key(d.queue, d.id)), d.queue]), d);
    const answers = new Map();
    for (const [k, part] of [...calls].sort(([a], [b]) => JSON.parse(a)[0] - JSON.parse(b)[0])) {
      const q = JSON.parse(k)[1];
      const got = await this.call(q, part);
      part.forEach((d, i) => answers.set(key(d.queue, d.id), got[i]));
      if (Math.min(...got) < 0) {
        const written = drafts.filter((d) => answers.get(key(d.queue, d.id)) === 1);
        for (const d of written) await this.kill(d.id, d.queue, `taskrunner: its workflow was refused by queue ${q}`);
        const gone = written.length ? ` (the jobs of it written before were killed: ${written.length})` : '';
        const why = got.includes(-2) ? 'closed' : 'full (its bound is reached)';
        throw new Refused(`queue ${q} is ${why}: the workflow was not enqueued${gone}`);
      }
    }
    if (news.length) await this.carry(news);
    return drafts.map((d) => answers.get(key(d.queue, d.id)));
  }

  // Carrying (Across slots): apply outbox entries with join.lua in their children's slots,
  // then XDEL them from their outboxes; then the entries those calls left in turn.
  async carry(found) {
    while (found.length) {
      const byChild = new Map();
      for (const e of found) push(byChild, e.child.split(' ')[0], e);
      const answers = await Promise.all([...byChild].map(([cq, es]) => this.scripts.call('join', [this.q(cq)],
        [this.failedTtl, ...es.flatMap((e) => [e.child.split(' ')[1], e.parent, e.task || '', e.state,
          ...NEWS.map((n) => e[n] || '')])])));
      const following = [];
      [...byChild.values()].forEach((es, i) => following.push(...entries(answers[i], es.length)));
      const byOutbox = new Map();
      for (const e of found) push(byOutbox, e.parent.split(' ')[0], e.sid);
      await Promise.all([...byOutbox].map(([q, ids]) => this.redis.xdel(this.q(q) + 'outbox', ...ids)));
      found = following;
    }
  }

  // Kill: a job not running ends killed at once; a running one's worker is told on its
  // control list. Answers, as Python's Job.kill: 'killed' (by this call), 'running' (its
  // worker acts on the request), or 'already <state>' for a job that had already ended
  // ('already killed', 'already completed', ...): nothing done; '' for no such job.
  async kill(id, queue, who) {
    const answer = await this.scripts.call('kill', [this.q(queue)], [id, who, this.failedTtl]);
    const [state, worker, attempt] = answer;
    if (state === 'ended') return `already ${answer[1]}`;
    if (state === 'running' && worker) {
      const control = this.g + 'control:' + worker;
      await this.redis.lpush(control, JSON.stringify({ kill: id, attempt: Number(attempt), reason: 'killed' }));
      await this.redis.expire(control, 3600);
    }
    return state;
  }

  // The (queue, id) of jobs to wait for: {id, queue} objects (what enqueue answers) as they
  // are, ids looked up in the queues of P:{_}:queues. Throws for an id no queue has.
  async parents(jobs) {
    const out = [];
    const queues = jobs.some((j) => typeof j === 'string') ? (await this.redis.smembers(this.g + 'queues')).sort() : [];
    for (const j of jobs) {
      if (typeof j !== 'string') {
        out.push([SHARD.test(j.queue) ? j.queue : checkName('queue', j.queue), j.id]);
        continue;
      }
      const found = [];
      for (const q of queues) if (await this.redis.exists(this.q(q) + 'job:' + j)) found.push(q);
      if (!found.length) throw new Refused(`no job ${j}`);
      out.push([found[0], j]);
    }
    return out;
  }

  // Enqueue: one job; answers {id, queue, created}. Throws when the queue is closed or full.
  // Workflows: opts.dependsOn, jobs ({id, queue}, or ids) that must complete first (it
  // waits in state "waiting"; canceled if one does not complete); opts.onSuccess and
  // opts.onFailure, callbacks {task, args, kwargs, immutable, ...draft opts} written in the
  // same call: on_success given its result first in its args, on_failure {id, task, state,
  // error_type, error} (unless immutable); the other ends canceled.
  // Flow control (flow()): opts.priority, opts.concurrencyKey, and for a job that is no
  // workflow's part opts.uniqueKey/uniqueFor/uniqueUntil: a duplicate (another job of the queue
  // holds its unique key) adds nothing and answers {id: that job's id, queue, created: false,
  // duplicate: true}.
  async enqueue(task, args = [], kwargs = {}, opts = {}) {
    const job = await this.place(this.draft(task, args, kwargs, opts,
      { unique: !(opts.dependsOn || opts.onSuccess || opts.onFailure) }), opts);
    const drafts = [job];
    let parentQueues = [];
    if (opts.dependsOn) {
      if (!Array.isArray(opts.dependsOn) || !opts.dependsOn.length) throw new Error('dependsOn takes a list of jobs');
      const parents = await this.parents(opts.dependsOn);
      job.fields.push('parents', parents.map(([q, id]) => `${q} ${id}`).join(' '));
      parentQueues = parents.map(([q]) => q);
    }
    for (const [cb, edge, takes] of [[opts.onSuccess, [], 'result'], [opts.onFailure, ['on_parent_failure', 'only'],
      'error']]) {
      if (!cb) continue;
      const d = await this.place(this.draft(cb.task, cb.args, cb.kwargs, cb, { fed: !cb.immutable }), cb);
      d.fields.push('parents', `${job.queue} ${job.id}`, ...edge, ...(cb.immutable ? [] : ['takes', takes]));
      drafts.push(d);
    }
    const [answer] = await this.write(drafts, parentQueues);
    if (typeof answer === 'string') return { id: answer, queue: job.queue, created: false, duplicate: true };
    return { id: job.id, queue: job.queue, created: answer === 1 };
  }

  // A chain: steps {task, args, kwargs, immutable, ...draft opts} run one after the other,
  // each given its parent's result first in its args (unless immutable); one call writes
  // them all. Answers the last step {id, queue}: its result is the chain's.
  async chain(steps) {
    if (!steps.length) throw new Error('a chain needs at least one step');
    const drafts = [];
    for (const [i, s] of steps.entries()) {
      drafts.push(await this.place(this.draft(s.task, s.args, s.kwargs, s, { fed: i > 0 && !s.immutable }), s));
    }
    drafts.slice(1).forEach((d, i) => {
      const takes = steps[i + 1].immutable ? [] : ['takes', 'result'];
      d.fields.push('parents', `${drafts[i].queue} ${drafts[i].id}`, ...takes);
    });
    await this.write(drafts);
    const last = drafts[drafts.length - 1];
    return { id: last.id, queue: last.queue };
  }

  // A group: jobs side by side, written by one call. Answers [{id, queue}] in order.
  async group(members) {
    if (!members.length) throw new Error('a group needs at least one member');
    const drafts = [];
    for (const m of members) drafts.push(await this.place(this.draft(m.task, m.args, m.kwargs, m), m));
    await this.write(drafts);
    return drafts.map((d) => ({ id: d.id, queue: d.queue }));
  }

  // A chord: a group and a callback run once every member ended, given the array of their
  // results first in its args (unless immutable); a member that does not complete cancels
  // it, unless onMemberFailure is "continue" (null in its place). One call. Answers the
  // callback {id, queue}.
  async chord(members, callback, { onMemberFailure = 'cancel' } = {}) {
    if (!members.length) throw new Error('a chord needs at least one member');
    const drafts = [];
    for (const m of members) drafts.push(await this.place(this.draft(m.task, m.args, m.kwargs, m), m));
    const cb = await this.place(this.draft(callback.task, callback.args, callback.kwargs, callback,
      { fed: !callback.immutable }), callback);
    cb.fields.push('parents', drafts.map((d) => `${d.queue} ${d.id}`).join(' '));
    if (!callback.immutable) cb.fields.push('takes', 'results');
    if (onMemberFailure === 'continue') cb.fields.push('on_parent_failure', 'continue');
    await this.write([...drafts, cb]);
    return { id: cb.id, queue: cb.queue };
  }

  // Wait: watch.lua counts us in as a waiter, then BLPOP notify:<id>, looking again every
  // 5 s at most (a token may be lost with a Redis restart). Answers the job record. Rides out
  // a Redis outage (unavailable()) until `timeout`, as Python's `wait` does, then throws
  // Unreachable: the job's state is unknown. No such job: Refused.
  async wait(id, queue = 'default', timeout = 60) {
    const p = this.q(queue);
    const deadline = Date.now() + timeout * 1000;
    const blocker = this.connection();
    let last = null; // the last sign of an outage, for the message
    const seen = (e) => { if (unavailable(e)) last = e; };
    blocker.on('error', seen); // its failures are its requests' (unheard, each was printed with a stack)
    this.redis.on('error', seen);
    // A request answered, else Unreachable a second past the deadline (a client that holds
    // its requests while Redis is down, maxRetriesPerRequest null, would wait for good).
    let timer;
    const due = new Promise((resolve, reject) => {
      timer = setTimeout(() => reject(last || new Unreachable('Redis did not answer')), deadline - Date.now() + 1000);
    });
    due.catch(() => {});
    const bounded = (request) => Promise.race([request, due]);
    try {
      for (;;) {
        try {
          const state = await bounded(this.scripts.call('watch', [p], [id]));
          if (state === '') throw new Refused(`no job ${id} in queue ${queue}`);
          if (FINAL.has(state)) return await bounded(this.redis.hgetall(p + 'job:' + id));
          const left = (deadline - Date.now()) / 1000;
          if (left <= 0) throw new Error(`job ${id} is still ${state} after ${timeout}s`);
          await bounded(blocker.blpop(p + 'notify:' + id, Math.max(0.01, Math.min(left, 5))));
          last = null;
        } catch (e) {
          if (!unavailable(e)) throw e;
          last = e;
          const left = deadline - Date.now();
          if (left <= 0) throw new Unreachable(`cannot reach Redis, the state of job ${id} is unknown: ${e.message}`);
          await sleep(Math.min(1, left / 1000));
        }
      }
    } finally {
      clearTimeout(timer);
      this.redis.off('error', seen);
      blocker.disconnect();
    }
  }

  async close() { await this.redis.quit(); }
}

// Why a handler was stopped: the client finishes the delivery accordingly.
class Stop extends Error {
  constructor(reason) {
    super(reason);
    this.reason = reason; // 'killed' | 'timeout' | 'lost' | 'shutdown'
  }
}

const sleep = (s) => new Promise((resolve) => setTimeout(resolve, s * 1000));

// What a handler threw, as a job's error type, message and traceback: an Error's name,
// message and stack; anything else thrown (a string, null, a plain object) is an `Error` with
// its text (null's field reads threw in the consumer, leaving the job claimed for good).
// Total: a value neither JSON nor String() can take (a circular object without a prototype)
// is its Object.prototype.toString text; it threw in run(), whose job then stayed running.
function thrown(e) {
  try {
    if (e instanceof Error) return [String(e.name || 'Error'), String(e.message), String(e.stack || '')];
    const text = typeof e === 'string' ? e : JSON.stringify(e);
    if (text !== undefined) return ['Error', text, ''];
  } catch { /* a BigInt, a circular object, a throwing getter */ }
  try {
    return ['Error', String(e), ''];
  } catch {
    return ['Error', Object.prototype.toString.call(e), ''];
  }
}

const ABANDONED = Symbol('abandoned'); // Consumer.answered: the consumer stopped before Redis answered
// Seconds a stopping consumer waits for a PING before it takes Redis for unavailable (the
// producer's socket timeout).
const SILENT_S = 5;

// A consumer runs one job at a time with `handlers[task](args, kwargs, ctx)`; ctx has the job's
// id, queue, attempt and headers (an object, {} when none); ctx.signal is an
// AbortSignal that fires when the job must stop (kill request, max duration, lost, shutdown).
// JavaScript cannot preempt a function: the delivery is finished at once and whatever the
// handler returns later is dropped, so handlers should honour the signal.
class Consumer {
  constructor(tr, handlers, { queues = ['default'], name } = {}) {
    if (tr.cluster) throw new Error('the Node consumer needs one Redis server, not a Redis Cluster (README: Limits)');
    this.tr = tr;
    this.handlers = handlers;
    this.queues = queues.map((q) => (SHARD.test(q) ? q : checkName('queue', q))); // a sharded queue: name its shards
    this.host = os.hostname();
    this.name = checkName('worker', name || `node.${this.host}.${process.pid}`);
    this.beatEvery = Number(setting('TASKRUNNER_HEARTBEAT', 2));
    this.deadAfter = Number(setting('TASKRUNNER_DEAD_AFTER', 10));
    this.defaultMaxDuration = setting('TASKRUNNER_MAX_DURATION', '300');
    this.idleBlock = Number(setting('TASKRUNNER_IDLE_BLOCK', 5));
    this.resultTtl = setting('TASKRUNNER_RESULT_TTL', '86400');
    this.backoffCap = setting('TASKRUNNER_RETRY_BACKOFF_MAX', '600');
    this.failedTtl = tr.failedTtl;
    this.shutdownGrace = Number(setting('TASKRUNNER_SHUTDOWN_GRACE', 20));
    this.killGrace = Number(setting('TASKRUNNER_KILL_GRACE', 5)); // only for how long stopping may last (stop())
    this.current = null; // the delivery running: {queue, id, attempt, task, ..., controller}
    this.orphans = false; // a claim's answer may have been lost: we may hold jobs we do not run
    this.throttled = null; // seconds until a rate limit's token (the last claim's answer), or null
    this.reconnects = 0;
    tr.redis.on('reconnecting', () => { this.reconnects += 1; });
    tr.tellOutages((line) => console.error(`${this.name}: ${line}`));
    this.processed = 0;
    this.stopping = false;
    this.ended = false; // start() has ended
    this.stopAt = null; // when the running job's grace ends (Date.now() ms), once stopping
    this.graceTimer = null; // stop()'s: the running job's grace, and its watch on Redis
    this.lookTimer = null;
    // Why the consumer gave up on Redis while stopping (stop()), once it did: what waits for
    // Redis then answers ABANDONED (answered()), so that the consumer stops in bounded time,
    // not after ioredis's tries (a minute and more, then an error: exit 1) or, Redis stopped
    // or hung (no error at all), never. `quits`: how each wait in progress is told.
    this.abandoned = null;
    this.quits = new Set();
    this.startedAt = Date.now() / 1000;
  }

  // Heartbeat: the info fields of PROTOCOL.md; pidns and boot_id let a dispatcher on this
  // machine see at once that our PID is gone (Linux; left out where /proc has neither).
  info() {
    const info = { name: this.name, host: this.host, ip: '127.0.0.1', pid: process.pid, queues: this.queues,
      concurrency: 1, busy: this.current ? 1 : 0, processed: this.processed, started_at: this.startedAt, kind: 'node' };
    try { info.pidns = fs.readlinkSync('/proc/self/ns/pid'); } catch { /* not Linux */ }
    try { info.boot_id = fs.readFileSync('/proc/sys/kernel/random/boot_id', 'utf8').trim(); } catch { /* idem */ }
    return info;
  }

  // A name a live worker holds (its heartbeat less than dead_after ago) is refused, as a
  // worker refuses it: two consumers of one name popped each other's kill requests and handed
  // each other's jobs back as never begun (a job killed while running ran again).
  async nameFree() {
    const [last, [s, us]] = await Promise.all([this.tr.redis.zscore(this.tr.g + 'workers', this.name),
      this.tr.redis.time()]);
    const age = Number(s) + Number(us) / 1e6 - Number(last);
    if (last !== null && age < this.deadAfter) {
      throw Object.assign(new Error(`worker name ${JSON.stringify(this.name)} is in use by a live worker (heartbeat `
        + `${age.toFixed(1)}s ago); pick another name (--name)`), { name: 'NameInUse' });
    }
  }

  // Beat, then look at the job we run: no longer ours (requeued by the dispatcher or an
  // operator) -> stop it without finishing; kill requested (its message may be lost) -> stop.
  async heartbeat() {
    const ttl = Math.floor(this.deadAfter * 3 + 60);
    await this.tr.scripts.call('heartbeat', [this.tr.g], [this.name, JSON.stringify(this.info()), ttl]);
    const d = this.current;
    if (!d) return;
    const p = this.tr.q(d.queue);
    const [[attempts, killRequested], mine] = await Promise.all([
      this.tr.redis.hmget(p + 'job:' + d.id, 'attempts', 'kill_requested'), this.tr.redis.hexists(p + 'running', d.id)]);
    if (attempts !== String(d.attempt) || !mine) this.abort(d, 'lost');
    else if (killRequested) this.abort(d, 'killed');
  }

  abort(d, reason) {
    if (this.current === d && !d.controller.signal.aborted) d.controller.abort(new Stop(reason));
  }

  // Claim one job (claim.lua), queues in priority order, for this process; null when none.
  // A value after the jobs (10 a job) is the seconds until a rate limit that held a job
  // back has a token again (PROTOCOL.md, Flow control): kept in this.throttled.
  async claim() {
    const head = JSON.stringify({ worker: this.name, host: this.host, ip: '127.0.0.1' }).slice(0, -1);
    const got = await this.tr.scripts.call('claim', this.queues.map((q) => this.tr.q(q)),
      [head, this.name, this.host, '127.0.0.1', 1, this.defaultMaxDuration, process.pid, '']);
    this.throttled = got.length % 10 === 1 ? Number(got[got.length - 1]) : null;
    if (got.length < 10) return null;
    const [qi, id, attempt, task, args, kwargs, maxDuration, policy, headers] = got;
    return { queue: this.queues[qi - 1], id, attempt, task, args, kwargs, maxDuration: Number(maxDuration), policy,
      headers: headers || '{}' };
  }

  // Finish one delivery: outcome and v1..v4 as in PROTOCOL.md (Finish). Answers 1, 0 or 2.
  // Sent again until Redis answers: a finish that ran twice answers 2 and changes nothing.
  // Not sent once the consumer gave up on Redis (stop()): the dispatcher requeues the job.
  async finish(d, outcome, v1 = '', v2 = '', v3 = '', v4 = '') {
    for (;;) {
      try {
        const got = await this.answered(this.tr.scripts.call('finish', [this.tr.q(d.queue)],
          [this.resultTtl, this.backoffCap, this.failedTtl, d.id, d.attempt, outcome, '', v1, v2, v3, v4]));
        return got === ABANDONED ? null : got[0];
      } catch (e) {
        this.tr.failed(`finish ${d.id}`, e);
        if (await this.answered(sleep(1)) === ABANDONED) return null;
      }
    }
  }

  // After a claim whose answer may be lost, hand back (outcome "return": it never began)
  // every delivery the holding hashes give us that we do not run.
  async releaseOrphans(keep) {
    for (const queue of this.queues) {
      const running = await this.tr.redis.hgetall(this.tr.q(queue) + 'running');
      for (const [id, raw] of Object.entries(running)) {
        let entry;
        try { entry = JSON.parse(raw); } catch { continue; }
        const mine = [keep, this.current].some((d) => d && d.id === id && d.queue === queue);
        if (entry.worker === this.name && !mine) {
          await this.finish({ queue, id, attempt: entry.attempt }, 'return', `${this.name} never got it`);
        }
      }
    }
    this.orphans = false;
  }

  // The job is this.current until run() ends, however it ends (a throw that left it set kept
  // the job running for good: the heartbeat kept it alive).
  async run(d) {
    d.controller = new AbortController();
    this.current = d;
    // A job whose claim was in flight as the stop came runs under the stop's grace too, as a
    // worker's claim in flight lands under its stop_at: it ran on unbounded.
    if (this.stopping) this.graceFor(d);
    try {
      await this.runCurrent(d);
    } finally {
      this.current = null;
      this.processed += 1;
    }
  }

  // One delivery: its handler, then its finish (PROTOCOL.md, Finish) as it ended.
  async runCurrent(d) {
    const stopped = new Promise((resolve) => d.controller.signal.addEventListener('abort', () => resolve()));
    // Max duration: past it, a job of policy "kill" is stopped; "flag" runs on (the
    // dispatcher flags it stuck).
    const timer = d.policy === 'kill' ? setTimeout(() => this.abort(d, 'timeout'), d.maxDuration * 1000) : null;
    let outcome;
    try {
      const handler = this.handlers[d.task];
      if (!handler) throw Object.assign(new Error(`no handler for task ${d.task}`), { name: 'NotRegistered' });
      const ctx = { id: d.id, queue: d.queue, attempt: d.attempt, headers: JSON.parse(d.headers),
        signal: d.controller.signal };
      const result = await Promise.race([handler(JSON.parse(d.args), JSON.parse(d.kwargs), ctx), stopped]);
      // A value JSON has no form for (a function, a symbol) is null, as undefined.
      outcome = d.controller.signal.aborted ? null : ['completed', JSON.stringify(result === undefined ? null : result) ?? 'null'];
    } catch (e) {
      outcome = ['error', ...thrown(e), String(0.5 + Math.random() / 2)];
    } finally {
      clearTimeout(timer);
    }
    if (d.controller.signal.aborted) {
      const reason = d.controller.signal.reason.reason;
      outcome = {
        killed: ['killed', '', 'killed on request'],
        timeout: ['error', 'TimeLimitExceeded', `ran past its max duration (${d.maxDuration}s)`, '', '1'],
        shutdown: ['requeue', '0', 'front', `${this.name} shutting down`],
        lost: null, // no longer ours: its new holder's record stays
      }[reason];
    }
    if (outcome) await this.finish(d, ...outcome);
  }

  // Kill messages: {"kill": id, "attempt": n, "reason": "killed"|"timeout"} on control:<name>.
  // One for a delivery we do not run just ended, or never reached us: look for orphans.
  // On `conn`, a connection of its own (serve() closes it when it gives up on Redis).
  async listen(conn) {
    try {
      while (!this.stopping) {
        let got;
        try {
          got = await conn.brpop(this.tr.g + 'control:' + this.name, 1);
        } catch (e) { // Redis unavailable: no one awaits this loop's promise, so a throw ended the process
          if (this.stopping) break; // closed by serve(), or no more to read
          this.tr.failed('reading kill requests', e);
          await sleep(1);
          continue;
        }
        if (!got) continue;
        let msg;
        try { msg = JSON.parse(got[1]); } catch { continue; }
        const d = this.current;
        if (d && msg && msg.kill === d.id && String(msg.attempt) === String(d.attempt)) {
          this.abort(d, msg.reason === 'timeout' ? 'timeout' : 'killed');
        } else {
          this.orphans = true; // we may hold it without knowing (a lost claim answer)
        }
      }
    } finally {
      conn.disconnect();
    }
  }

  // Connect, waiting for a Redis that is down, as taskrunner's worker does (it stopped at
  // once, "Connection is closed.", having said it would try again); a Redis that answers but
  // refuses us (a password, ...) is a mistake: its error, at once. False: stopped meanwhile.
  async connect() {
    let why = null;
    const seen = (e) => { why = e; };
    this.tr.redis.on('error', seen);
    try {
      for (;;) {
        try {
          await this.tr.redis.connect();
          return true;
        } catch (e) {
          if (!(why || e).syscall) throw why || e; // a network error (connect, read, getaddrinfo) has one
          this.tr.redis.disconnect();
          if (this.stopping) return false;
          await sleep(1);
          if (this.stopping) return false;
        }
      }
    } finally {
      this.tr.redis.off('error', seen);
    }
  }

  // A request's answer, or ABANDONED once the consumer gave up on Redis (stop()). Not a
  // Promise.race with a promise that settles only then: each race left a reaction on it for
  // good (about 300 bytes; two or more a job, a busy consumer grew by hundreds of MB an hour).
  answered(request) {
    if (this.abandoned !== null) return Promise.resolve(ABANDONED);
    return new Promise((resolve, reject) => {
      const quit = () => resolve(ABANDONED);
      this.quits.add(quit);
      Promise.resolve(request).then(resolve, reject).finally(() => this.quits.delete(quit));
    });
  }

  // Give up on Redis (stop()), saying `why` once start() has ended.
  abandon(why) {
    if (this.abandoned !== null) return;
    this.abandoned = why;
    for (const quit of this.quits) quit();
  }

  // Run until stopped (stop()): connect, join, serve. Given up on Redis meanwhile, say so.
  async start() {
    try {
      if (await this.answered(this.connect()) !== true) return;
      const joined = this.nameFree().then(() => this.heartbeat())
        .then(() => this.tr.redis.sadd(this.tr.g + 'queues', ...this.queues));
      if (await this.answered(joined) === ABANDONED) return;
      await this.serve();
    } finally {
      this.ended = true; // stop()'s timers, re-armed at each beat, have nothing to watch any more
      clearTimeout(this.graceTimer);
      clearTimeout(this.lookTimer);
      if (this.abandoned !== null) this.tr.outage.say(`stopping without ${this.abandoned}`);
    }
  }

  // The main loop: claim, run, and when there is nothing, block on the queues' wake lists.
  async serve() {
    // One heartbeat at a time, as a worker's: on a Redis stopped or hung they piled up, one a
    // beat, each failed and said at the end ("trying again", after the stop's last line).
    let beating = false;
    const beats = setInterval(() => {
      if (beating) return;
      beating = true;
      this.heartbeat().catch((e) => { if (this.abandoned === null) this.tr.failed('heartbeat', e); })
        .finally(() => { beating = false; });
    }, this.beatEvery * 1000);
    const listener = this.tr.connection();
    const control = this.listen(listener);
    const blocker = this.tr.connection();
    try {
      while (!this.stopping) {
        const before = this.reconnects;
        try {
          const d = await this.answered(this.claim());
          if (d === ABANDONED) break;
          if (this.orphans || this.reconnects !== before) {
            if (await this.answered(this.releaseOrphans(d)) === ABANDONED) break;
          }
          let waited;
          if (d) waited = this.run(d);
          // Redis times a BRPOP out to 0.1 s: a short wait for a rate limit's token is slept.
          else if (this.throttled !== null && this.throttled < 1) waited = sleep(this.throttled);
          else waited = blocker.brpop(...this.queues.map((q) => this.tr.q(q) + 'wake'),
            this.throttled === null ? this.idleBlock : Math.min(this.idleBlock, this.throttled));
          if (await this.answered(waited) === ABANDONED) break;
        } catch (e) {
          this.tr.failed('claim', e);
          this.orphans = true;
          await this.answered(sleep(1));
        }
      }
    } finally {
      clearInterval(beats);
      blocker.disconnect();
      await this.answered(control);
      listener.disconnect(); // given up on Redis: its BRPOP, unanswered, kept the program running
      // Given up on Redis, we said we do not leave: sent anyway and no longer waited for, the
      // leave failed unhandled once the connection closed, and Node ended the program.
      if (this.abandoned === null) await this.answered(this.leave());
    }
  }

  // Stop: no more claims; the running job has shutdownGrace seconds, then goes back to its
  // queue next in line. start() then leaves. While Redis is unavailable (an outage told and the
  // connection that leaves not ready: Redis back, another connection, as the kill requests',
  // may wait seconds to try again; or a PING unanswered for SILENT_S: a Redis stopped or hung
  // fires no error), the consumer gives up on it and stops, the dispatcher finding it dead: at
  // the next beat when it has nothing to report; else (a job running, or stopped, killed or
  // ended meanwhile, its outcome not sent) killGrace + 10 s after the grace at most, as a
  // worker gives up (README.md: SIGTERM).
  stop() {
    if (this.stopping) return;
    this.stopping = true;
    if (this.ended) return;
    this.stopAt = Date.now() + this.shutdownGrace * 1000;
    if (this.current) this.graceFor(this.current);
    const bound = this.shutdownGrace + this.killGrace + 10;
    const giveUpAt = Date.now() + bound * 1000;
    let asked = null; // when the PING not answered yet was sent
    const look = () => {
      if (asked === null) {
        const sent = Date.now();
        asked = sent;
        this.tr.redis.ping().then(() => { if (asked === sent) asked = null; }, () => {});
      }
      const down = this.tr.outage.since !== null && this.tr.redis.status !== 'ready' ? 'Redis is unavailable'
        : asked !== null && Date.now() - asked >= SILENT_S * 1000 ? `Redis did not answer for ${SILENT_S}s` : null;
      if (down && !this.current) {
        this.abandon(`leaving the worker list: ${down} (the dispatcher finds us dead)`);
      } else if (Date.now() >= giveUpAt) {
        const what = this.current ? `reporting job ${this.current.id} or leaving` : 'leaving';
        this.abandon(`${what} the worker list, ${bound}s after the stop: ${down || 'Redis did not answer'} `
          + '(the dispatcher finds us dead)');
      } else {
        this.lookTimer = setTimeout(look, this.beatEvery * 1000).unref();
      }
    };
    this.lookTimer = setTimeout(look, this.beatEvery * 1000).unref();
  }

  // The stop's grace for `d`: until stopAt, then it goes back to its queue (run()'s finish).
  graceFor(d) {
    this.graceTimer = setTimeout(() => this.abort(d, 'shutdown'), Math.max(0, this.stopAt - Date.now())).unref();
  }

  // Leaving cleanly: nothing held any more (run() finished it), so leave the worker list;
  // a holder that left without finishing its jobs would have them requeued only at their
  // deadline.
  async leave() {
    await this.tr.redis.zrem(this.tr.g + 'workers', this.name);
    await this.tr.redis.del(this.tr.g + 'worker:' + this.name, this.tr.g + 'control:' + this.name);
  }
}

module.exports = { TaskRunner, Consumer, Scripts, BadArguments, Refused, Unreachable, unavailable, checkArguments, ulid,
  sleep, uniqueKeyOf };
