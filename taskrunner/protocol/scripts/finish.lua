-- Record how deliveries ended (ack many in one round trip), fenced by delivery.
-- KEYS[1]  queue key prefix
-- ARGV[1]  result TTL (s)   ARGV[2] retry backoff cap (s)   ARGV[3] failed TTL (s)
-- (each the setting for a job whose record has no result_ttl, retry_backoff_max, failed_ttl)
-- then 8 values per job: id, attempt, outcome, began, v1, v2, v3, v4 where `began` is how
-- many seconds before now the job's start is to be recorded ("" if unknown: started_at stays
-- the claim's; else started_at = now - began: docs/PROTOCOL.md, finish.lua), and
--   completed  v1 = result JSON
--   failed     v1 = error type, v2 = message, v3 = traceback         (final)
--   error      as failed, v4 = jitter factor: retried with backoff while retries remain
--   killed     v2 = reason
--   requeue    v1 = delay (s), v2 = "front" to put it next in line, v3 = why (optional),
--              v4 = "retry" when the task asked for it (raise Retry): counted in
--              retry_requests; past the record's max_retries (default 3) the job ends
--              failed MaxRetriesExceeded instead. Other requeues (a worker stopping) count
--              only in requeues.
--   lost       v1 = why its process died (requeue, or WorkerLost after max_lost)
--   return     v1 = why: the job never began (prefetched, then handed back); next in line,
--              no history record, nothing counted but the delivery
-- Returns one integer per job: 1 applied; 0 fenced off (another delivery holds the job);
-- 2 nothing to do (this delivery was already released, e.g. a retried call). Then, only when
-- a job that ended has children in other slots (a Redis Cluster), one more value: the
-- entries this call left in outboxes, as XRANGE gives them ({stream id, {field, value, ...}}),
-- for the caller to carry to join.lua (docs/PROTOCOL.md, Workflows).
-- The fence and the release are batched: one HMGET of the holding hash for all jobs, one
-- HDEL/SREM each for those released; the finished sets get one ZADD per state, the history
-- one entry for the call (docs/PROTOCOL.md, Keys: `p history`). One job alone: its HDEL is
-- the check, and its SREMs, ZADD and history entry name it (no lists built).
-- An exclusive queue with jobs waiting gets a wake token (its next job may run now), and so
-- does a queue where a job gave back a concurrency slot (one held back for it may run).
-- A job that ends with children (a workflow's, see finalize() and settle_children() in
-- _lib.lua) settles them in this same call: pending once it completed, else canceled.
-- Arguments that are not so are refused (an error, nothing changed): a bad TTL used to fail
-- in the middle, after some jobs had changed, and an unknown outcome failed the job.
local p = KEYS[1]
-- The TTLs: their text when it is an integer's digits, as settings are (one string.find each;
-- EXPIRE then formats no number per job), else the number they are. The backoff cap is only
-- checked here: a retry reads it (amount()).
local ttl, failed_ttl = ARGV[1], ARGV[3]
if not (string.find(ttl, '^[1-9]%d*$') and string.find(failed_ttl, '^[1-9]%d*$')) then
  for k, what in pairs({[1] = 'result', [3] = 'failed'}) do
    local x = tonumber(ARGV[k])
    if not x or x < 1 or x ~= math.floor(x) then
      return redis.error_reply('ERR finish: the ' .. what .. ' TTL (ARGV[' .. k .. ']) must be an integer >= 1 (seconds)')
    end
  end
  ttl = string.find(ttl, '^[1-9]%d*$') and ttl or tonumber(ttl)
  failed_ttl = string.find(failed_ttl, '^[1-9]%d*$') and failed_ttl or tonumber(failed_ttl)
end
if not (string.find(ARGV[2], '^%d+$') or amount(ARGV[2], nil)) or (#ARGV - 3) % 8 ~= 0 then
  return redis.error_reply('ERR finish: ARGV is the result TTL, the backoff cap (seconds >= 0), the failed TTL, '
    .. 'then 8 values per job (id, attempt, outcome, began, v1, v2, v3, v4); got ' .. #ARGV .. ' values')
end
local OUTCOMES  -- made by the first outcome that is not `completed` (most calls: none)
local t = now()
local ts = fmt(t)  -- now's text (fmt()'s last answer: no number formatted)
local ids = {}
for i = 4, #ARGV, 8 do
  local outcome = ARGV[i + 2]
  if outcome ~= 'completed' then
    OUTCOMES = OUTCOMES or {completed = true, failed = true, error = true, killed = true, requeue = true, lost = true,
      ['return'] = true}
    if not OUTCOMES[outcome] then
      return redis.error_reply('ERR finish: unknown outcome "' .. string.sub(outcome, 1, 40) .. '" (ARGV['
        .. i + 2 .. ']): completed, failed, error, killed, requeue, lost or return')
    end
  end
  if ARGV[i + 3] ~= '' and not amount(ARGV[i + 3], nil) then
    return redis.error_reply('ERR finish: began (ARGV[' .. i + 3 .. ']) must be "" or seconds >= 0')
  end
  ids[#ids + 1] = ARGV[i]
end
if #ids == 0 then
  return {}
end
-- One job (an unbatched finish): its holding entry is checked by the HDEL that removes it,
-- once its fence is checked, instead of an HMGET before and an HDEL after; it is released by
-- a command each and added to its finished set by finalize(), with no table of ids (each
-- table a call makes costs Redis more than a command: its making, growing and collection).
local single = #ids == 1
local held = not single and redis.call('HMGET', p .. 'running', unpack(ids))
local out, records = {}, {}
local taken, dl, index  -- a batch's: ids released, the same by deadline bucket, and by end state
if not single then
  taken, dl, index = {}, {}, {}
end
local freed = false  -- a concurrency slot was given back: a job held back for it may run
for k, id in ipairs(ids) do
  local r = load(p .. 'job:' .. id)
  records[k] = r
  if r[ATTEMPTS] ~= ARGV[4 + (k - 1) * 8 + 1] then
    out[k] = 0
  elseif single and redis.call('HDEL', p .. 'running', id) == 0 or not single and not held[k] then
    out[k] = 2
  else
    out[k] = 1
    if r[MAX_CONCURRENCY] then  -- flow control: its concurrency slot goes with the delivery
      free_slot(p, id, r)
      freed = true
    end
    if single then
      redis.call('SREM', p .. 'processing', id)
      if r[BUCKET] then
        redis.call('SREM', p .. 'dl:' .. r[BUCKET], id)
      end
    else
      taken[#taken + 1] = id
      if r[BUCKET] then
        local list = dl[r[BUCKET]] or {}
        dl[r[BUCKET]] = list
        list[#list + 1] = id
      end
    end
  end
end
if taken and #taken > 0 then
  -- Each id taken was held (HMGET above), so fewer entries removed than ids means a delivery
  -- named twice in this call: the first answers 1, the others 2 (the removals and a slot's
  -- SREM done twice for it change nothing). Checked here, once, not by a search per job.
  if redis.call('HDEL', p .. 'running', unpack(taken)) < #taken then
    local seen = {}
    for k, id in ipairs(ids) do
      if out[k] == 1 then
        if seen[id] then out[k] = 2 end
        seen[id] = true
      end
    end
  end
  redis.call('SREM', p .. 'processing', unpack(taken))
  for b, list in pairs(dl) do
    redis.call('SREM', p .. 'dl:' .. b, unpack(list))
  end
end
-- The fields that end a delivery, with its timeline entry and, when the worker says, when
-- it began.
local function ending(fields, ek, ev, r, began)
  fields[#fields + 1], fields[#fields + 2] = ek, ev
  if began then
    fields[#fields + 1], fields[#fields + 2] = 'started_at', r[STARTED_AT]
  end
  return fields
end
-- A delivery reached failed or killed (completed: below, its own few lines).
local function finish(id, job, r, attempt, began, state, fields, error_type)
  local ek, ev = ended(attempt, t, state == 'failed' and 'failed ' .. error_type or state)
  finalize(p, id, job, r, state, t, state == 'completed' and ttl or failed_ttl, ending(fields, ek, ev, r, began),
    error_type, index)
end
-- The task asked to run again (raise Retry): counted in retry_requests. Past the record's
-- max_retries (3 when it has none; read only here, so that jobs that never ask pay nothing)
-- the job ends failed MaxRetriesExceeded: true; else false.
local function retry_refused(id, job, r, attempt, began)
  local asked = redis.call('HINCRBY', job, 'retry_requests', 1)
  local most = tonumber(redis.call('HGET', job, 'max_retries')) or 3
  if asked <= most then
    return false
  end
  finish(id, job, r, attempt, began, 'failed', {'error_type', 'MaxRetriesExceeded', 'error',
    string.format('asked to retry %d times; max_retries is %d', asked, most)}, 'MaxRetriesExceeded')
  return true
end
-- Last first: jobs put back next in line (RPUSH) then keep the order they were given in.
for k = #ids, 1, -1 do
  local id = ids[k]
  if out[k] == 1 then
    local i = 4 + (k - 1) * 8
    local attempt, outcome, began = ARGV[i + 1], ARGV[i + 2], ARGV[i + 3] ~= ''
    local v1, v2, v3, v4 = ARGV[i + 4], ARGV[i + 5], ARGV[i + 6], ARGV[i + 7]
    local job = p .. 'job:' .. id
    local r = records[k]
    if began then  -- formatted here, not by fmt(): its last answer stays `now`'s text
      r[STARTED_AT] = string.format('%.6f', t - ARGV[i + 3])
    end
    if outcome == 'completed' then
      -- The hot path: the record's end written here, as finalize() would (its timeline entry
      -- as ended() makes it), by one HSET of its own arguments (no table of fields, no unpack,
      -- no calls of ended() or fmt(): `ts` is now's text), then conclude() the rest.
      if began then
        redis.call('HSET', job, 'state', 'completed', 'finished_at', ts, 'result', v1, 'end:' .. attempt,
          ts .. ' completed', 'started_at', r[STARTED_AT])
      else
        redis.call('HSET', job, 'state', 'completed', 'finished_at', ts, 'result', v1, 'end:' .. attempt,
          ts .. ' completed')
      end
      conclude(p, id, job, r, 'completed', t, ttl, nil, index)
    elseif outcome == 'lost' then
      lose(p, id, job, r, attempt, t, failed_ttl, v1, true, index)
    elseif outcome == 'return' then
      local ek, ev = ended(attempt, t, 'returned before it began: ' .. v1)
      to_pending(p, id, job, true, {ek, ev}, r[PRIORITY])
    elseif outcome == 'killed' then
      finish(id, job, r, attempt, began, 'killed', {'error_type', 'Killed', 'error', v2}, 'Killed')
    elseif outcome == 'requeue' and v4 == 'retry' and retry_refused(id, job, r, attempt, began) then
      -- ended failed
    elseif outcome == 'requeue' then
      redis.call('HINCRBY', job, 'requeues', 1)
      history(p, id, r, 'requeued', t, nil, index)
      local delay = amount(v1, 0)
      local why = v3 ~= '' and v3 or (v2 == 'front' and 'worker shutting down'
        or string.format('requeued itself (Retry, %gs)', delay))
      local ek, ev = ended(attempt, t, 'requeued: ' .. why)
      local extra = ending({'last_requeued_at', fmt(t)}, ek, ev, r, began)
      if delay > 0 then
        to_delayed(p, id, job, t + delay, extra)
      else
        to_pending(p, id, job, v2 == 'front', extra, r[PRIORITY])
      end
    else
      local failures = redis.call('HINCRBY', job, 'failures', 1)
      local retries = tonumber(r[RETRIES]) or 0
      if outcome == 'error' and failures <= retries then
        history(p, id, r, 'requeued', t, v1, index)
        local base = amount(r[RETRY_BACKOFF], 1)
        -- the task's cap, else ARGV[2]
        local most = amount(redis.call('HGET', job, 'retry_backoff_max'), nil) or amount(ARGV[2], 0)
        local delay = math.min(base * 2 ^ (failures - 1), most) * math.min(amount(v4, 1), 1)
        local ek, ev = ended(attempt, t, string.format('failed %s, retry %d of %d in %.2fs', v1, failures,
          retries, delay))
        local fields = {'error_type', v1, 'error', v2, 'traceback', v3}
        to_delayed(p, id, job, t + delay, ending(fields, ek, ev, r, began))
      else
        finish(id, job, r, attempt, began, 'failed', {'error_type', v1, 'error', v2, 'traceback', v3}, v1)
      end
    end
  end
end
if index then
  flush_history(p, index)  -- before the loop below: index is then state -> ids only
  for state, list in pairs(index) do  -- a batch's finished sets, one ZADD each
    local args, n = {}, 0  -- counted, not #args (a length is a search of the table)
    for _, id in ipairs(list) do
      args[n + 1], args[n + 2] = ts, id
      n = n + 2
    end
    redis.call('ZADD', p .. state, unpack(args))
  end
end
-- Exclusive: known from the records (claim.lua marks a delivery of an exclusive queue), so
-- that other queues read no meta here; the queue's meta then says whether it still is.
local exclusive = false
for k = 1, #ids do
  if out[k] == 1 and records[k][EXCLUSIVE] then exclusive = true end
end
local meta = exclusive and not freed and redis.call('HMGET', p .. 'meta', 'exclusive', 'priorities')
if freed or meta and meta[1] == '1' and backlog(p, meta[2]) > 0 then
  wake(p)
end
if emitted and #emitted > 0 then  -- children in other slots: the caller carries these (join.lua)
  out[#out + 1] = emitted
end
return out
