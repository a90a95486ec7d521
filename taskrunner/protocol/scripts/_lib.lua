-- Shared helpers: a script is loaded with those it uses (directly or through another) put
-- before it (scripts/__init__.py, prelude()): each one carried is made again at every call.
-- Every top-level statement here is a definition (`local function f`, `local a, b = ...`,
-- `f = function` for one declared above), so that a script can carry only some.
--
-- Every per-queue script gets KEYS[1] = the queue's key prefix, e.g. "tr:{emails}:",
-- and touches only keys that start with it (one hash slot, see docs/PROTOCOL.md; enqueue.lua
-- may also get the global queue set, off a cluster):
--   <p>pending      LIST  ids waiting; producers LPUSH, claims take from the right
--   <p>pending:<n>  LIST  the same for jobs of priority n (1-9), claimed before pending (0)
--   <p>items        SET   ids that are in `pending` and may be claimed
--   <p>processing   SET   ids claimed and not yet released
--   <p>running      HASH  id -> holding entry (JSON: worker, host, ip, pid, started_at, ...)
--   <p>dl:<b>       SET   ids whose deadline falls in bucket b (b = floor(deadline / width))
--   <p>buckets      ZSET  b -> end time of bucket b, one member per non-empty bucket
--   <p>delayed      ZSET  id -> time the job becomes due
--   <p>wake         LIST  0 or 1 token; idle workers BRPOP it
--   <p>meta         HASH  bound, closed, exclusive, paused; produced_/consumed_ messages and
--                          bytes; longest_result_ttl, longest_failed_ttl (see finalize());
--                          priorities (see below); duplicates|<task> (unique jobs refused);
--                          flow, rate (flow control, see claim.lua); retired (a shard a
--                          smaller shard count left: enqueue.lua answers it closed)
--   <p>unique:<key> STRING the id of the job holding unique key <key> (see below)
--   <p>notfull      LIST  0 or 1 token; producers blocked on a full bounded queue BRPOP it
--   <p>completed|failed|killed|canceled  ZSET  id -> finish time
--   <p>waiting      ZSET  id -> enqueue time, for jobs waiting for their parents (workflows)
--   <p>job:<id>     HASH  the job record; its timeline: run:<n> (the holding entry of
--                          delivery n) and end:<n> ("<time> <how it ended>")
--   <p>notify:<id>  LIST  one token per waiter when the job ends
--   <p>tasks        HASH  task -> its declaration (JSON), written by workers; enqueue reads it
--   <p>history      STREAM one entry per finished or requeued delivery, or per finish call
--                          that ended several (history() below), for the archiver
--   <p>history:extra STRING the records of <p>history beyond one per entry (its records:
--                          XLEN + this), kept by flush_history() and trim.lua
--   <p>history:batch STRING the range an archiver is writing, which trim.lua may forget
--   <p>stats        HASH  tally.lua's counts of <p>history: cursor, jobs|, run|, wait| ...
--   <p>outbox       STREAM one entry per parent that ended with a child in another slot (Redis
--                          Cluster), until a carrier has applied it with join.lua there
--   <p>joined:<id>  HASH  "<queue> <id>" -> JSON: the parents in other slots that waiting job <id>
--                          counted (or that ended before it was enqueued), with their news
--   <p>limit, <p>limit:<task>  HASH  a rate limiter's state (the queue's, a task's): tat,
--                          win, used, before (see "Flow control" below)
--   <p>slots:<key>  SET   ids of the running jobs that hold a slot of concurrency key <key>
--   <p><s>:task:<task>, <p><s>:error:<type>, <p><s>:te:<task> <type>  ZSET  id -> finish time:
--                          the failed (s = failed) or killed (s = killed) jobs of a task, an
--                          error type, both (see "Failure indexes" below)
--   <p><s>:facets   SET   "<task> <type>" of every <p><s>:te: index that may hold ids

-- fmt()'s last answer: a number and its text.
local fmt_x, fmt_s

-- The server's time, in seconds. Its text ("<seconds>.<6 digits>", what
-- string.format('%.6f') gives for it: the same for every microsecond) is fmt()'s last answer
-- from TIME's own digits, so that a script writes its `now` without formatting a number
-- (the digits taken as numbers by arithmetic: tonumber() would read each twice).
local function now()
  local t = redis.call('TIME')
  local us = t[2]
  fmt_x = t[1] + us / 1000000
  if #us < 6 then
    us = string.sub('00000' .. us, -6)
  end
  fmt_s = t[1] .. '.' .. us
  return fmt_x
end

-- Seconds as text with microseconds. The last answer is kept: a script formats its `now`
-- many times (number formatting is a good part of a script's cost).
local function fmt(x)
  if x ~= fmt_x then
    fmt_x, fmt_s = x, string.format('%.6f', x)
  end
  return fmt_s
end

-- Epoch seconds as a UTC time to the second, e.g. "2026-11-27 08:39:18 UTC" (Redis's Lua
-- has no os.date): the civil date of a day count (H. Hinnant's days_from_civil, inverted).
local function utc_text(x)
  local s = math.floor(x)
  local z = math.floor(s / 86400) + 719468
  local doe = z % 146097
  local yoe = math.floor((doe - math.floor(doe / 1460) + math.floor(doe / 36524) - math.floor(doe / 146096)) / 365)
  local doy = doe - (365 * yoe + math.floor(yoe / 4) - math.floor(yoe / 100))
  local mp = math.floor((5 * doy + 2) / 153)
  local month = mp < 10 and mp + 3 or mp - 9
  local year = yoe + (z - doe) / 146097 * 400 + (month <= 2 and 1 or 0)
  local sec = s % 86400
  return string.format('%04d-%02d-%02d %02d:%02d:%02d UTC', year, month, doy - math.floor((153 * mp + 2) / 5) + 1,
    math.floor(sec / 3600), math.floor(sec % 3600 / 60), sec % 60)
end

-- A number read from a record or an argument, or `default` when it is not a finite one
-- >= 0 (tonumber() takes "nan", "inf" and "0x10", which another client may have written).
local function amount(text, default)
  local x = tonumber(text)
  if x == nil or x ~= x or x < 0 or x == math.huge then
    return default
  end
  return x
end

-- Leave one token for an idle worker, never more (a hint; claims re-check everything).
local function wake(p)
  if redis.call('LLEN', p .. 'wake') == 0 then
    redis.call('LPUSH', p .. 'wake', '1')
  end
end

-- A job record as load() reads it is the HMGET's answer itself, its fields by position
-- (false when absent), not a table of named fields: making that table (15 fields) and
-- collecting it cost ~8k instructions per job, the most of any piece of Lua in a batched
-- finish. These name the positions: r[TASK] is the record's task (OWN_: the record's own
-- result_ttl, failed_ttl, which win over the settings).
local ATTEMPTS, BUCKET, WAITERS, TASK, ENQUEUED_AT, STARTED_AT, WORKER = 1, 2, 3, 4, 5, 6, 7
local HOST, PID, OWN_RESULT_TTL, CHILDREN, MAX_CONCURRENCY, UNIQUE_KEY, EXCLUSIVE = 8, 9, 10, 11, 12, 13, 14
-- The record's key, until its rare fields (below) are read.
local JOB = 15
-- The fields of a job record that only some ends of a delivery need (a failure, a retry, a
-- requeue, a kill, a concurrency key, a priority, a workflow across slots): load() leaves them
-- out, and the first lookup of one of them reads them all (a second HMGET), so that a job that
-- completes pays for none of them. None of them is written by a script before it reads them.
local KILL_REQUESTED, MAX_LOST, RETRIES, RETRY_BACKOFF, OWN_FAILED_TTL, CROSS_CHILDREN = 16, 17, 18, 19, 20, 21
local CONCURRENCY_KEY, PRIORITY = 22, 23
local rare_fields  -- their metatable, made by the first load() (most calls load no record)

-- The fields of a job record that the functions below need, read in one HMGET (positions
-- above); the rare ones when first looked up. `exclusive`: "1" once claimed from an
-- exclusive queue.
local function load(job)
  rare_fields = rare_fields or {__index = function(r, k)
    local job = rawget(r, JOB)
    if not job then return nil end
    r[JOB] = nil
    local v = redis.call('HMGET', job, 'kill_requested', 'max_lost', 'retries', 'retry_backoff', 'failed_ttl',
      'cross_children', 'concurrency_key', 'priority')  -- false when absent, as load()'s
    for i = 1, 8 do
      r[KILL_REQUESTED - 1 + i] = v[i]
    end
    return rawget(r, k)
  end}
  local r = redis.call('HMGET', job, 'attempts', 'bucket', 'waiters', 'task', 'enqueued_at', 'started_at', 'worker',
    'host', 'pid', 'result_ttl', 'children', 'max_concurrency', 'unique_key', 'exclusive')
  r[JOB] = job
  return setmetatable(r, rare_fields)
end

-- Priorities (docs/PROTOCOL.md, Pause, priorities, unique jobs). A job of priority n (1-9, its record's
-- `priority`) waits in <p>pending:<n>; one of priority 0, or none, in <p>pending. meta
-- `priorities` lists the levels a queue has used, highest first ("95"), so that the claim
-- looks at those lists only, and a queue that never used one (no field) looks at pending
-- alone, as before: no command more. A level is added by the first job that uses it.

-- The pending list of a job of priority `prio` (its record's text; nil, "0", or anything
-- but a digit 1-9: none). Jobs put back in line pass here too, and register the level
-- should meta have lost it (one HGET, for jobs with a priority only).
local function pending_of(p, prio)
  if not prio or not string.find(prio, '^[1-9]$') then
    return p .. 'pending'
  end
  local levels = redis.call('HGET', p .. 'meta', 'priorities') or ''
  if not string.find(levels, prio, 1, true) then
    local list = {}
    for c in string.gmatch(levels .. prio, '%d') do list[#list + 1] = c end
    table.sort(list, function(a, b) return a > b end)
    redis.call('HSET', p .. 'meta', 'priorities', table.concat(list))
  end
  return p .. 'pending:' .. prio
end

-- The pending lists of a queue in claim order, from meta `priorities` (nil: pending alone).
local function pending_lists(p, levels)
  local lists = {}
  for c in string.gmatch(levels or '', '[1-9]') do lists[#lists + 1] = p .. 'pending:' .. c end
  lists[#lists + 1] = p .. 'pending'
  return lists
end

-- Jobs waiting in all the pending lists (LLEN pending for a queue without priorities).
local function backlog(p, levels)
  local n = 0
  for _, list in ipairs(pending_lists(p, levels)) do n = n + redis.call('LLEN', list) end
  return n
end

-- Unique jobs (docs/PROTOCOL.md, Pause, priorities, unique jobs). A job enqueued with `unique_key` K holds
-- <p>unique:K (its id; EX its unique_for, when it has one) from its enqueue until it
-- starts (unique_until "start": released by the claim) or ends (completed, failed for
-- good, killed, canceled: finalize(); deleted, purged: those scripts). A retry, a requeue
-- and a delivery lost with its process keep it. Released only by its holder: the key may
-- have expired and been taken by another job meanwhile.
local function unlock(p, key, id)
  local lk = p .. 'unique:' .. key
  if redis.call('GET', lk) == id then
    redis.call('DEL', lk)
  end
end

-- >>> Flow control (issue 17): rate limits and concurrency keys ------------------------
-- A job with `max_concurrency` holds a slot of its concurrency key (`concurrency_key`, else
-- its task) while its delivery lives: the claim adds its id to <p>slots:<key>, and every
-- release (below, and finish.lua's batched one) removes it, so a slot lives exactly as long
-- as the holding entry: whatever ends or returns the delivery (finish, lose, recover,
-- requeue) gives it back. A job without max_concurrency costs nothing here.

-- The set of slot holders of a job's concurrency key (its record's `concurrency_key`, else
-- its task), for a job with max_concurrency.
local function slots_key(p, concurrency_key, task)
  return p .. 'slots:' .. (concurrency_key or task or '?')
end

-- A delivery of `r` (a record load() read) was released: give its slot back; true when it
-- held one (the caller then leaves a wake token: a job held back for that key may run now).
local function free_slot(p, id, r)
  if not r[MAX_CONCURRENCY] then
    return false
  end
  redis.call('SREM', slots_key(p, r[CONCURRENCY_KEY], r[TASK]), id)
  return true
end

-- A rate limit "N/s", "N/m" or "N/h" (N a whole number, 1 to 999999999): the seconds
-- between two starts (the GCRA's emission interval) and the period in seconds; nil when
-- it is not one.
local PERIODS = {s = 1, m = 60, h = 3600}
local function rate_of(spec)
  local n, u = string.match(spec or '', '^([1-9]%d?%d?%d?%d?%d?%d?%d?%d?)/([smh])$')
  if not n then return nil end
  return PERIODS[u] / tonumber(n), PERIODS[u]
end
-- <<< Flow control ---------------------------------------------------------------------

-- Forget that a job runs: holding entry (unless the caller removed it already), processing
-- set, deadline bucket, concurrency slot (then a wake token: a job held back for the slot
-- may run). An emptied bucket stays in the index until the sweep drops it.
local function release(p, id, r, running_gone)
  if not running_gone then
    redis.call('HDEL', p .. 'running', id)
  end
  redis.call('SREM', p .. 'processing', id)
  if r[BUCKET] then
    redis.call('SREM', p .. 'dl:' .. r[BUCKET], id)
  end
  if free_slot(p, id, r) then
    wake(p)
  end
end

-- Make a job claimable again; `front` puts it next in line (of its priority, `prio`: the
-- record's `priority`). `extra`: more fields to set.
local function to_pending(p, id, job, front, extra, prio)
  redis.call('HSET', job, 'state', 'pending', unpack(extra or {}))
  redis.call('HDEL', job, 'due_at')
  redis.call('SADD', p .. 'items', id)
  redis.call(front and 'RPUSH' or 'LPUSH', pending_of(p, prio), id)
  wake(p)
end

-- A bounded queue with room: leave one token for a producer waiting on it. `levels`: meta
-- priorities (nil: none).
local function signal_room(p, bound, levels)
  if bound > 0 and backlog(p, levels) < bound and redis.call('LLEN', p .. 'notfull') == 0 then
    redis.call('LPUSH', p .. 'notfull', '1')
  end
end

local function to_delayed(p, id, job, due, extra)
  redis.call('HSET', job, 'state', 'delayed', 'due_at', fmt(due), unpack(extra or {}))
  redis.call('ZADD', p .. 'delayed', due, id)
end

-- Queue, task and worker names (docs/PROTOCOL.md, Names): 1-200 of [A-Za-z0-9_.:@-], the
-- first a letter or digit.
local function is_name(s)
  return type(s) == 'string' and #s <= 200 and string.find(s, '^%w[%w_.:@%-]*$') ~= nil
end

-- >>> Failure indexes (issue 21) -----------------------------------------------------
-- A job that ends failed or killed is listed, beside <p><state>, by its task, its error
-- type and both (ZSETs id -> finish time), so that the dashboard pages a filtered list with
-- one ZREVRANGE; <p><state>:facets names every pair. Whatever takes a job out of <p><state>
-- takes it out of these too: retry.lua and delete.lua (unindex_failure), sweep.lua (trims
-- them by time as it trims <p><state>, and drops pairs whose index is empty). Completed and
-- canceled jobs are not indexed: a job that completes pays nothing here.

-- The first `n` bytes of UTF-8 text `s`, less the start of a character that byte n cuts:
-- the cut text stays valid UTF-8 (a key, a facet the dashboard shows and filters by).
local function cut_utf8(s, n)
  if #s <= n then
    return s
  end
  local i = n + 1  -- the first byte left out; while it continues a character (10xxxxxx), step
  while i > 1 and i > n - 2 do  -- back to that character's first byte (4 bytes at most)
    local b = string.byte(s, i)
    if b < 0x80 or b >= 0xC0 then
      break
    end
    i = i - 1
  end
  return string.sub(s, 1, i - 1)
end

-- The (task, error type) pair a job is indexed under: a task that is not a name (a corrupt
-- record) is "?", an error type is cut to at most 200 bytes on a character boundary ("?"
-- when there is none; taskrunner/ops/failures.py cuts a filter's the same way).
local function facet_of(task, error_type)
  if not is_name(task) then
    task = '?'
  end
  if not error_type or error_type == '' then
    return task, '?'
  end
  return task, cut_utf8(error_type, 200)
end

local function index_failure(p, state, id, task, error_type, t)
  local s = p .. state .. ':'
  task, error_type = facet_of(task, error_type)
  redis.call('ZADD', s .. 'task:' .. task, t, id)
  redis.call('ZADD', s .. 'error:' .. error_type, t, id)
  redis.call('ZADD', s .. 'te:' .. task .. ' ' .. error_type, t, id)
  redis.call('SADD', s .. 'facets', task .. ' ' .. error_type)
end

-- A failed or killed job leaves <p><state> (retried, deleted): it leaves the indexes too,
-- and its pair leaves the facets once no job has it.
local function unindex_failure(p, state, id, task, error_type)
  local s = p .. state .. ':'
  task, error_type = facet_of(task, error_type)
  redis.call('ZREM', s .. 'task:' .. task, id)
  redis.call('ZREM', s .. 'error:' .. error_type, id)
  local te = s .. 'te:' .. task .. ' ' .. error_type
  redis.call('ZREM', te, id)
  if redis.call('EXISTS', te) == 0 then
    redis.call('SREM', s .. 'facets', task .. ' ' .. error_type)
  end
end

-- A job whose record is gone may still be listed: its own failed_ttl (or result_ttl) was
-- shorter than the TTL the sweep trims its state's set by, so the record expired first. The
-- script that finds it gone (delete.lua, retry.lua) takes its id out of <p><s> for each state
-- s of `states` (ZSETs only), and out of a failed or killed one's failure indexes, whose pair
-- the record no longer gives: the facet whose te: index holds it. So nothing stale stays,
-- and a bulk action that read the id from an index reads it no more.
local function forget_gone(p, id, states)
  for _, s in ipairs(states) do
    redis.call('ZREM', p .. s, id)
    local facets = (s == 'failed' or s == 'killed') and redis.call('SMEMBERS', p .. s .. ':facets') or {}
    for _, pair in ipairs(facets) do
      if redis.call('ZSCORE', p .. s .. ':te:' .. pair, id) then
        unindex_failure(p, s, id, string.match(pair, '^(%S+) (.*)$'))  -- a task has no space
        break
      end
    end
  end
end
-- <<< Failure indexes ------------------------------------------------------------------

-- Each XADD caps the history stream at about this many entries: a backstop for a queue no
-- dispatcher serves. The dispatchers keep it within 500,000 records (history.CAP: XLEN +
-- history:extra, trimmed by trim.lua), which the archiver empties long before.
local HISTORY_MAX = '1000000'

-- Append what just happened to a delivery to the queue's history stream: its id, and one
-- value `v` = "<state> <attempt> <enqueued_at> <started_at> <finished_at> <pid> <task>
-- <worker> <host>" (one space between them, "" for what the record lacks; the host last, as
-- the only one that may hold a space: docs/PROTOCOL.md, Keys) — a field of a stream entry
-- costs Redis more than the text it holds; `error_type` only when there is one (readers take
-- its absence for none). The queue is the stream's.
-- With `index` (a finish call's batch, see finalize()), the record is kept in index.history
-- instead, three lines for the caller's flush_history(): one XADD for the batch (an XADD
-- costs Redis ~13k instructions a job, its fields ~1k).
local function history(p, id, r, state, t, error_type, index)
  local v = state .. ' ' .. (r[ATTEMPTS] or '0') .. ' ' .. (r[ENQUEUED_AT] or '') .. ' ' .. (r[STARTED_AT] or '')
    .. ' ' .. fmt(t) .. ' ' .. (r[PID] or '') .. ' ' .. (r[TASK] or '') .. ' ' .. (r[WORKER] or '') .. ' '
    .. (r[HOST] or '')
  if index then
    local h = index.history
    if not h then
      h = {}
      index.history = h
    end
    local n = #h
    if string.find(v, '\n', 1, true) then  -- a host may hold one (a foreign client's): a line each
      v = string.gsub(v, '\n', ' ')
    end
    if error_type and string.find(error_type, '\n', 1, true) then
      error_type = string.gsub(error_type, '\n', ' ')
    end
    h[n + 1], h[n + 2], h[n + 3] = id, v, error_type or ''
    return
  end
  if error_type and error_type ~= '' then
    redis.call('XADD', p .. 'history', 'MAXLEN', '~', HISTORY_MAX, '*', 'id', id, 'v', v, 'error_type', error_type)
  else
    redis.call('XADD', p .. 'history', 'MAXLEN', '~', HISTORY_MAX, '*', 'id', id, 'v', v)
  end
end

-- The records a batch kept (history() with `index`) as one history entry: one record in the
-- usual shape; more in one field `jobs`, three lines per record (its id, its `v`, its
-- error type or an empty line; none of them holds a newline), and the records beyond the
-- first counted in history:extra (so that the stream's records are known without reading it).
local function flush_history(p, index)
  local h = index.history
  index.history = nil
  if not h then
    return
  elseif #h == 3 then
    if h[3] ~= '' then
      redis.call('XADD', p .. 'history', 'MAXLEN', '~', HISTORY_MAX, '*', 'id', h[1], 'v', h[2], 'error_type', h[3])
    else
      redis.call('XADD', p .. 'history', 'MAXLEN', '~', HISTORY_MAX, '*', 'id', h[1], 'v', h[2])
    end
  else
    redis.call('XADD', p .. 'history', 'MAXLEN', '~', HISTORY_MAX, '*', 'jobs', table.concat(h, '\n'))
    redis.call('INCRBY', p .. 'history:extra', #h / 3 - 1)
  end
end

-- A job reached completed, failed, killed or canceled: record it in the history, index it,
-- expire it, wake its waiters.
-- `fields` is a flat list of extra field/value pairs for the record.
-- `r` is the record as load() read it before this change; `error_type` the new one.
-- `ttl`: the caller's setting for that state (result TTL for completed, failed TTL for
-- failed and killed), a number or an integer's digits (text: EXPIRE takes it as it is, no
-- number formatted per job); the record's own result_ttl / failed_ttl wins. One longer than the
-- setting is kept in meta longest_result_ttl / longest_failed_ttl (only ever raised): the
-- sweep trims the finished sets by the longest, so that such a job stays listed. One shorter
-- does not win for a workflow step that completed with children: a chord's callback reads
-- each member's result from its record when the last member ends (join()), so a member's own
-- result_ttl of 1 s gave the callback null for a result it had.
-- With `index`, a table state -> ids (and `history`: history()), the caller adds the id to
-- the finished set itself (one ZADD for many jobs) and writes the history entry
-- (flush_history(): one for many jobs); without, finalize() does both.
-- The workflow helpers (below; finalize() and settle_children() call each other: a chain
-- cancels step by step), made by workflows() in the calls that need them.
local sibling, queue_of, prepend, emitted, emit, blame, CHILD, far_parent, join, settle, settle_children
local workflows

-- finalize() once the record says how the job ended (its state, finished_at and `fields`),
-- for a caller that wrote them itself (finish.lua's completed jobs: one HSET of its own
-- arguments, no table of fields made to be unpacked); the same arguments less `fields`.
local function conclude(p, id, job, r, state, t, ttl, error_type, index)
  local kind, own = 'result_ttl', r[OWN_RESULT_TTL]
  if state ~= 'completed' then
    kind, own = 'failed_ttl', r[OWN_FAILED_TTL]
  end
  own = own and tonumber(own)
  if own and own >= 1 and own % 1 == 0 and not (r[CHILDREN] and state == 'completed' and own < tonumber(ttl)) then
    if own > tonumber(ttl) and own > (tonumber(redis.call('HGET', p .. 'meta', 'longest_' .. kind)) or 0) then
      redis.call('HSET', p .. 'meta', 'longest_' .. kind, own)
    end
    ttl = own
  end
  history(p, id, r, state, t, error_type, index)  -- a canceled step too (attempt 0: it never ran)
  if index then
    local ids = index[state] or {}
    index[state] = ids
    ids[#ids + 1] = id
  else
    redis.call('ZADD', p .. state, fmt(t), id)  -- now's text (a number would be formatted)
  end
  if state == 'failed' or state == 'killed' then  -- the same score as the finished set's
    index_failure(p, state, id, r[TASK], error_type, fmt(t))
  end
  redis.call('EXPIRE', job, ttl)
  if r[UNIQUE_KEY] then
    unlock(p, r[UNIQUE_KEY], id)
  end
  local waiters = r[WAITERS] and tonumber(r[WAITERS]) or 0
  if waiters > 0 then
    local nk = p .. 'notify:' .. id
    for _ = 1, waiters do
      redis.call('LPUSH', nk, '1')
    end
    redis.call('EXPIRE', nk, 60)
    redis.call('HDEL', job, 'waiters')
  end
  if r[CHILDREN] then
    workflows()
    settle_children(p, id, job, {children = r[CHILDREN], task = r[TASK], cross_children = r[CROSS_CHILDREN]}, state,
      t, ttl)
  end
end

-- The job reached `state`: its record says so, then conclude() (above).
local function finalize(p, id, job, r, state, t, ttl, fields, error_type, index)
  redis.call('HSET', job, 'state', state, 'finished_at', fmt(t), unpack(fields))
  conclude(p, id, job, r, state, t, ttl, error_type, index)
end

-- The timeline field recording how delivery `attempt` ended.
local function ended(attempt, t, what)
  return 'end:' .. attempt, fmt(t) .. ' ' .. what
end

-- The process running delivery `attempt` is gone. A kill request wins; otherwise requeue
-- at the front, until the job has been lost max_lost times (a poison pill): WorkerLost.
-- `released`: the caller released the delivery already. `index` as for finalize().
-- `unbegun`: the delivery had not begun (it waited in a dead worker's prefetch behind the
-- job that ran): requeued the same way, but not counted towards max_lost.
local function lose(p, id, job, r, attempt, t, ttl, reason, released, index, unbegun)
  if not released then
    release(p, id, r)
  end
  if r[KILL_REQUESTED] then
    local ek, ev = ended(attempt, t, 'killed (its process was gone: ' .. reason .. ')')
    finalize(p, id, job, r, 'killed', t, ttl, {'error_type', 'Killed', 'error', 'killed on request', ek, ev},
      'Killed', index)
    return 'killed'
  end
  if not unbegun then
    local lost = redis.call('HINCRBY', job, 'lost', 1)
    local max_lost = tonumber(r[MAX_LOST]) or 5
    if lost >= max_lost then
      local ek, ev = ended(attempt, t, 'failed WorkerLost: ' .. reason)
      finalize(p, id, job, r, 'failed', t, ttl, {'error_type', 'WorkerLost',
        'error', 'the process running the job died ' .. lost .. ' times; last: ' .. reason, ek, ev}, 'WorkerLost',
        index)
      return 'failed'
    end
  end
  redis.call('HINCRBY', job, 'requeues', 1)
  history(p, id, r, 'requeued', t, 'WorkerLost', index)
  local ek, ev = ended(attempt, t, (unbegun and 'requeued, it had not begun: ' or 'requeued: ') .. reason)
  to_pending(p, id, job, true, {'last_requeued_at', fmt(t), 'last_lost_reason', reason, ek, ev}, r[PRIORITY])
  return 'pending'
end

-- Is the caller still the job's holder? 1 yes, 0 another delivery holds it now,
-- 2 this delivery is no longer running (already released or requeued). With `take`, a
-- holder's entry in the holding hash is removed by the same command that checks it.
-- `attempts`: the record's (false when it has none).
local function holder_check(p, id, attempts, attempt, take)
  if attempts ~= attempt then
    return 0
  end
  local cmd = take and 'HDEL' or 'HEXISTS'
  if redis.call(cmd, p .. 'running', id) == 0 then
    return 2
  end
  return 1
end

-- A queue as keys and records name it: a name, or shard i (1-63) of a sharded queue
-- "<name>~<i>" (docs/PROTOCOL.md, Sharded queues), a name no user may give a queue.
local function is_queue(s)
  if is_name(s) then return true end
  if type(s) ~= 'string' then return false end
  local base, i = string.match(s, '^(.+)~([1-9]%d?)$')
  return base ~= nil and is_name(base) and tonumber(i) < 64
end

-- A decimal number as JSON writes it ("30", "0.5"; not "5.", "05", "1e3", "-1", "nan"),
-- so that it can be copied into a JSON entry as it is.
local function json_decimal(s)
  if type(s) ~= 'string' then return false end
  -- The usual cases ("300", "300.0": a Python float's text) in one find: a first digit not 0,
  -- digits, a dot and digits or none, and a last byte that is no dot (46; "5." is no number).
  -- Not past 40 bytes: its two `%d*` try every split of a run of digits (a hostile record's
  -- 10,000 took Redis a second); the finds below are linear.
  if #s <= 40 and string.find(s, '^[1-9]%d*%.?%d*$') and string.byte(s, -1) ~= 46 then return true end
  return (string.find(s, '^%d+$') or string.find(s, '^%d+%.%d+$')) ~= nil and string.find(s, '^0%d') == nil
end

-- Workflows (docs/PROTOCOL.md, Workflows). A job that others wait for has `children`:
-- "<queue> <id> <queue> <id> ..."; a child has `parents` (the same form), `waiting_on` (its
-- parents not yet completed), state `waiting` and an entry in <p>waiting until they are,
-- and `takes` = "result" when its parent's result goes first in its args (a chain's step).
-- A child in another queue lives beside the parent's queue under the same prefix: off a
-- Redis Cluster the parent's script touches it there. On a cluster (another slot) the edge
-- is a cross-slot one: the parent lists the child in `cross_children` too ("<queue> <id>
-- <takes> ..."), and the child has `cross_slot` 1; the parent's end leaves an entry in its
-- own queue's outbox, which a carrier applies with join.lua in the child's slot.

-- They are made by workflows(), by the calls that need them (a job with children ended, a
-- workflow enqueued or joined): each helper carried is made again at every call of a script,
-- and most calls (a plain job's claim, finish) end no job with children. A script calls
-- workflows() before it uses one of them. `emitted`: the entries this script call left in
-- outboxes, as XRANGE gives them ({stream id, {field, value, ...}}): finish.lua, join.lua and
-- attach.lua answer them, for their caller to carry.
workflows = function()
  emitted = emitted or {}  -- this call's (a Function call begins with none: fresh_call())
  if settle then return end  -- made already (by this call; in a Function, by the library's first call)
  -- The key prefix of queue q beside the key prefix p ("tr:{a}:", "b" -> "tr:{b}:").
  function sibling(p, q)
    return string.match(p, '^(.*){[^{}]*}:$') .. '{' .. q .. '}:'
  end

  -- The queue of key prefix p ("tr:{a}:" -> "a").
  function queue_of(p)
    return string.match(p, '{([^{}]*)}:$')
  end

  -- A JSON array's text with `value` (JSON text) put first: '[1,2]' -> '[<value>,1,2]'.
  function prepend(value, args)
    local rest = string.sub(args, string.find(args, '[', 1, true) + 1)
    if string.find(rest, '^%s*%]') then
      return '[' .. value .. ']'
    end
    return '[' .. value .. ',' .. rest
  end

  -- A parent ended (`parent`: queue, id, task, state; error_type, error, canceled_by when it did
  -- not complete): tell its child `cid` of queue `cq`, in another slot, with an entry in the
  -- parent's queue's outbox (prefix p); `result` (JSON text) when the child takes it.
  function emit(p, cq, cid, parent, result)
    local f = {'child', cq .. ' ' .. cid, 'parent', parent.queue .. ' ' .. parent.id, 'task', parent.task,
      'state', parent.state}
    if result then
      f[#f + 1], f[#f + 2] = 'result', result
    end
    for _, k in ipairs({'error_type', 'error', 'canceled_by'}) do
      if parent[k] then
        f[#f + 1], f[#f + 2] = k, parent[k]
      end
    end
    emitted[#emitted + 1] = {redis.call('XADD', p .. 'outbox', '*', unpack(f)), f}
  end

  -- Why the children that `parent` cancels end canceled: {canceled_by, error}. A parent that was
  -- itself canceled passes on its own (the whole rest of a chain names the step that failed).
  function blame(parent)
    if parent.state == 'canceled' then
      return parent.canceled_by or '', parent.error or ''
    end
    local by = parent.queue .. ' ' .. parent.id
    if parent.state == 'completed' then  -- to an on_failure callback
      return by, string.format('not run: step %s (task %s) completed (an on_failure callback)', parent.id, parent.task)
    end
    local why = string.format('step %s (task %s) %s', parent.id, parent.task, parent.state)
    if parent.state ~= 'deleted' then
      why = why .. ': ' .. (parent.error_type or '?') .. ': ' .. cut_utf8(parent.error or '', 200)
    end
    return by, why
  end

  -- The fields of a waiting child that settling it needs, in this order (one HMGET; not its
  -- `parents`, which a chord's callback has thousands of: read only by the join that needs them).
  CHILD = {'state', 'on_parent_failure', 'takes', 'args', 'waiting_on', 'cross_slot', 'priority'}

  -- A parent in another slot, named "<queue> <id>", as its outbox entry gave it (join.lua) or
  -- the child's joined hash keeps it (`e`: its news, decoded): the `parent` table of settle().
  function far_parent(name, e)
    local q, id = string.match(name, '^(%S+) (%S+)$')
    return {queue = q, id = id, task = e.task or '?', state = e.state, result = e.result, error_type = e.error_type,
      error = e.error, canceled_by = e.canceled_by}
  end

  -- `parent` completed (or ended otherwise, for a child that continues then): count it for
  -- child `id` of queue prefix `cp`; the last one makes the child pending, with what it takes
  -- first in its args: its parent's result ("result"), or the array of its parents' results in
  -- the order of its `parents` ("results", a chord's callback: read now, from the parents'
  -- records, or for parents in other slots from its joined hash; one that did not complete, or
  -- whose record is gone, gives null), or how its parent failed ("error", an on_failure
  -- callback: {"id", "task", "state", "error_type", "error"} of the parent). `c`: the child's
  -- CHILD fields (it is waiting). A parent of this slot has `job` (its record, where its result
  -- is read); one of another slot brings its `result`. A waiting job has no due_at (it cannot be
  -- delayed), so none is cleared: about 7 commands a child, the last parent.
  function join(cp, id, job, parent, c)
    if (tonumber(c[5]) or 1) > 1 then
      redis.call('HINCRBY', job, 'waiting_on', -1)
      return
    end
    redis.call('ZREM', cp .. 'waiting', id)
    local takes, own = c[3], c[4]
    local fields = {'state', 'pending', 'waiting_on', '0'}
    if takes == 'error' then
      fields[5], fields[6] = 'args', prepend(cjson.encode({id = parent.id, task = parent.task, state = parent.state,
        error_type = parent.error_type or cjson.null, error = parent.error or cjson.null}), own)
    elseif takes == 'result' then
      fields[5], fields[6] = 'args', prepend(parent.result or parent.job and redis.call('HGET', parent.job, 'result')
        or 'null', own)
    elseif takes == 'results' then
      local results, here = {}, queue_of(cp)
      local joined = c[6] == '1' and cp .. 'joined:' .. id
      for q, pid in string.gmatch(redis.call('HGET', job, 'parents') or '', '(%S+) (%S+)') do
        if joined and q ~= here then
          local news = redis.call('HGET', joined, q .. ' ' .. pid)
          local e = news and cjson.decode(news)
          results[#results + 1] = e and e.state == 'completed' and e.result or 'null'
        else
          local r = redis.call('HMGET', sibling(cp, q) .. 'job:' .. pid, 'state', 'result')
          results[#results + 1] = r[1] == 'completed' and r[2] or 'null'
        end
      end
      fields[5], fields[6] = 'args', prepend('[' .. table.concat(results, ',') .. ']', own)
    end
    redis.call('HSET', job, unpack(fields))
    redis.call('SADD', cp .. 'items', id)
    redis.call('LPUSH', pending_of(cp, c[7]), id)
    wake(cp)
    if c[6] == '1' then
      redis.call('DEL', cp .. 'joined:' .. id)
    end
  end

  -- `parent` ended: waiting child `id` of queue prefix `cp` (its CHILD fields `c`) counts it
  -- (join) when the edge says so — it completed, and the child is not an on_failure callback
  -- (on_parent_failure "only"); or it did not, and the child goes on ("continue") or is such a
  -- callback — else ends canceled, naming the step that failed (blame()), and its own children
  -- are settled in turn, in this same call. `ttl`: the failed TTL (setting) for it.
  function settle(cp, id, parent, c, t, ttl)
    local job = cp .. 'job:' .. id
    local only = c[2] == 'only'
    if parent.state == 'completed' and not only or parent.state ~= 'completed' and (only or c[2] == 'continue') then
      join(cp, id, job, parent, c)
      return
    end
    local by, why = blame(parent)
    redis.call('ZREM', cp .. 'waiting', id)
    finalize(cp, id, job, load(job), 'canceled', t, ttl, {'canceled_by', by, 'error_type', 'Canceled', 'error', why},
      'Canceled')
  end

  -- A job with children ended in `state` (finalize(), or deleted: "deleted"): settle each
  -- child of this slot that is still waiting (one that is not — killed, deleted, canceled by
  -- another parent — is left as it is), and leave an outbox entry for each child in another
  -- slot (`cross_children`), with the result when it takes it. `r`: the job's `children`,
  -- `task` and `cross_children` by name (conclude() takes them from its record).
  function settle_children(p, id, job, r, state, t, ttl)
    local parent = {queue = queue_of(p), id = id, task = r.task or '?', state = state, job = job}
    if state ~= 'completed' and state ~= 'deleted' then  -- its error, as finalize() just wrote it
      local e = redis.call('HMGET', job, 'error_type', 'error', 'canceled_by')
      parent.error_type, parent.error, parent.canceled_by = e[1] or nil, e[2] or nil, e[3] or nil
    end
    local far
    if r.cross_children then
      far = {}
      local result
      for q, cid, takes in string.gmatch(r.cross_children, '(%S+) (%S+) (%S+)') do
        far[q .. ' ' .. cid] = true
        if state == 'completed' and (takes == 'result' or takes == 'results') then
          result = result or redis.call('HGET', job, 'result') or 'null'
          emit(p, q, cid, parent, result)
        else
          emit(p, q, cid, parent, nil)
        end
      end
    end
    for q, cid in string.gmatch(r.children, '(%S+) (%S+)') do
      if not (far and far[q .. ' ' .. cid]) then
        local cp = sibling(p, q)
        local c = redis.call('HMGET', cp .. 'job:' .. cid, unpack(CHILD))
        if c[1] == 'waiting' then
          settle(cp, cid, parent, c, t, ttl)
        end
      end
    end
  end
end

-- A call of a Redis Function begins here (scripts/__init__.py, library()): the library's
-- helpers above are made once, when it loads, and what they keep lives on from one call to
-- the next; what a call must not see of the call before is cleared here: fmt()'s last
-- answer, the outbox entries emitted (what workflows() makes once, and rare_fields, keep
-- nothing of a call). A script called by EVALSHA starts anew and never calls it. A helper
-- given state of its own (a cache, a table it fills) clears it here too (test_scripts.py:
-- test_function_calls_share_no_state, test_every_state_the_helpers_keep_is_cleared_by_fresh_call).
local function fresh_call()
  fmt_x, fmt_s, emitted = nil, nil, nil
end
