-- Claim up to N jobs from queues in strict priority order (one round trip).
-- KEYS[i]  key prefix of queue i, highest priority first
-- ARGV[1]  holding entry head: JSON object text without its closing brace,
--          e.g. {"worker":"w1","host":"h","ip":"10.0.0.1"
-- ARGV[2]  worker name   ARGV[3] host   ARGV[4] ip
-- ARGV[5]  deadline bucket width (s)   ARGV[6] default max duration (s)
-- ARGV[7..] one pair per job wanted (N = (#ARGV - 6) / 2): the PID of the process that will
--          run it, and "ahead": "" when it starts at once, else the seconds of work queued
--          before it in that process. Jobs claimed for the same PID then queue one behind
--          the other (a worker's prefetch): each one's deadline is its start at the latest,
--          when everything ahead of it used its whole max duration, plus its own. They all
--          go in the deadline bucket of the first one (one SADD for them): a bucket may be
--          due before a job's deadline, never after; stuck.lua then moves it on.
-- The antirez claim, batched: LRANGE the oldest ids, SADD them to processing (an id
-- already there is another delivery's: a stale duplicate), SREM them from items (an id
-- not there was killed or deleted meanwhile), LTRIM them off pending; record each in the
-- holding hash and its deadline bucket; attempts+1 is the delivery's fencing token.
-- An exclusive queue (meta exclusive = 1) gives a job only while none of it runs.
-- Pause, priorities, unique jobs (docs/PROTOCOL.md, of that name), read with the same HMGET
-- of meta: a paused queue (meta paused = 1) gives nothing; a queue with priorities (meta
-- priorities, e.g. "95") gives from pending:9, pending:5, then pending, each FIFO (a
-- flow-controlled one: one flow_pick() pass per list); a job whose unique lock ends when
-- it starts (unique_until "start") releases it here.
-- A job's record names in `opt` (written at enqueue) the optional fields it has that the
-- claim reads (headers, soft_limit, unique_key when its lock ends at the start, expires):
-- most have none, and reading an absent field costs Redis a scan of the whole record. A
-- record without `opt` (enqueued by an older version) has the first three and unique_until
-- read.
-- Expiry (docs/PROTOCOL.md, Expiry): a job whose `expires` (an absolute time) is at or before
-- now is not delivered: it leaves processing and ends killed, error_type Expired, through
-- finalize() as kill.lua ends a pending job (unique lock, workflow children, history), and
-- the claim goes on to the next job. It is not counted in consumed_messages/bytes (those
-- count deliveries); a flow pass takes it without a token or a slot, and not in its window
-- of FLOW_WINDOW jobs. A call ends EXPIRED_MAX at most (about, on a plain queue: a batch
-- read is ended whole), then stops and leaves a wake token (its claimer claims on).
-- Counts meta consumed_messages/consumed_bytes; a bounded queue signals room (notfull). A
-- queue found with no job left (not a flow-controlled one) loses its wake token: it is stale.
-- Returns {queue index, id, attempt, task, args, kwargs, max_duration, timeout_policy,
-- headers, soft limit}* (headers: the record's JSON object text, "" when it has none;
-- soft limit: the record's soft_limit, "" if none).
-- Flow control (docs/PROTOCOL.md, Flow control): a queue whose meta has `flow` (it has had
-- jobs with rate_limit or max_concurrency) or `rate` (a queue-wide rate limit) is claimed
-- from through flow_pick() below, which looks at its FLOW_WINDOW oldest jobs and leaves
-- those held back by a rate limit or a full concurrency key in place; other queues pay
-- nothing for it. When a rate limit held a job back and fewer than N jobs were claimed,
-- the answer has one more value at the end: the seconds until the earliest such job's
-- token is due (the claimer sleeps that long at most before it claims again).
-- Refuses (an error, nothing changed) arguments that would write a holding entry the
-- dispatcher cannot read or a holder it cannot judge: the job would then come back only
-- at its deadline. ARGV[1] must decode (with "}" added) to a JSON object whose "worker" is
-- ARGV[2], a valid name; PIDs are decimal integers > 0; "ahead" is "" or seconds >= 0.
if #ARGV < 6 or (#ARGV - 6) % 2 ~= 0 then
  return redis.error_reply('ERR claim: ARGV is 6 values, then a (pid, ahead) pair per job wanted; got '
    .. #ARGV .. ' values')
end
if not is_name(ARGV[2]) then
  return redis.error_reply('ERR claim: invalid worker name (ARGV[2]): use 1-200 of A-Z a-z 0-9 _.:@-, '
    .. 'starting with a letter or digit')
end
-- The head a client builds from ARGV[2..4] needs no decoding when host and ip are made of
-- letters, digits and .:_- (no character that JSON escapes: the text is then that object's;
-- an anchored match of those, cheaper than searching for the others); any other is decoded.
local head_ok = ARGV[1] == '{"worker":"' .. ARGV[2] .. '","host":"' .. ARGV[3] .. '","ip":"' .. ARGV[4] .. '"'
  and string.find(ARGV[3] .. ARGV[4], '^[%w.:_%-]*$')
if not head_ok then
  local ok, head = pcall(cjson.decode, ARGV[1] .. '}')
  head_ok = ok and type(head) == 'table' and head.worker == ARGV[2]
end
if not head_ok then
  return redis.error_reply('ERR claim: ARGV[1] must be a JSON object without its closing brace, '
    .. 'with "worker" equal to ARGV[2], e.g. {"worker":"w1","host":"h","ip":"10.0.0.1"')
end
local width = ARGV[5] == '1' and 1 or tonumber(ARGV[5])  -- the usual 1 without tonumber (~1.7k instructions)
if width ~= 1 and (not width or width < 1 or width ~= math.floor(width)) then
  return redis.error_reply('ERR claim: bucket width (ARGV[5]) must be an integer >= 1')
end
if not json_decimal(ARGV[6]) then
  return redis.error_reply('ERR claim: default max duration (ARGV[6]) must be seconds written like 300 or 0.5')
end
-- A PID is 1 to 10 digits, the first not 0: a length and one find ('%d*' is matched in one
-- loop, where '%d?' repeated recurses once per digit). A PID equal to the pair's before (a
-- worker's prefetch asks several jobs for one process) is checked already: comparing two Lua
-- strings is one pointer compare (each string is made once).
local pid_ok
for i = 7, #ARGV, 2 do
  local pid = ARGV[i]
  if pid ~= pid_ok then
    if #pid > 10 or not string.find(pid, '^[1-9]%d*$') then
      return redis.error_reply('ERR claim: pid (ARGV[' .. i .. ']) must be a decimal integer > 0, not "'
        .. string.sub(pid, 1, 40) .. '"')
    end
    pid_ok = pid
  end
  if ARGV[i + 1] ~= '' and not amount(ARGV[i + 1], nil) then
    return redis.error_reply('ERR claim: ahead (ARGV[' .. i + 1 .. ']) must be "" or seconds >= 0')
  end
end
local t = now()
local ts = fmt(t)
local want = (#ARGV - 6) / 2

-- >>> Flow control (issue 17): rate limits and concurrency keys --------------------------
-- A rate limiter is GCRA with no burst: its state <p>limit (the queue's) or <p>limit:<task>
-- is a hash with `tat`, the time from which the next start is allowed (each start moves it
-- to max(tat, now) + period / N), and, for people, `win` (floor(now / period)), `used`
-- (starts in that period) and `before` (starts in the one before). Read once per call,
-- written once per call when spent, and expired once it says nothing (tat and the next
-- period passed). A concurrency key's slots are <p>slots:<key> (see _lib.lua).
local FLOW_WINDOW = 100  -- the oldest jobs a flow-controlled queue's claim looks at
local wait_min  -- seconds until the earliest token due of a rate limit that held a job back
-- The limiters and slot sets this call read, and the functions below: made by flow_control()
-- when the call meets a flow-controlled queue (a closure made at every call costs even a plain
-- queue's claim).
local limiters, slot_sets, held_back, limiter, spend, slots_of, flow_pick

local function flow_control()
  if limiters then return end  -- made already in this call
  limiters, slot_sets = {}, {}

  function held_back(d)
    if not wait_min or d < wait_min then wait_min = d end
  end

  function limiter(key, spec)
    local l = limiters[key]
    if l then return l end
    local interval, period = rate_of(spec)
    if not interval then return nil end  -- enqueue.lua and `queue rate` refuse such specs
    local v = redis.call('HMGET', key, 'tat', 'win', 'used', 'before')
    l = {key = key, interval = interval, period = period, tat = tonumber(v[1]) or 0, win = tonumber(v[2]) or 0,
      used = tonumber(v[3]) or 0, before = tonumber(v[4]) or 0}
    limiters[key] = l
    return l
  end

  function spend(l)
    l.tat = math.max(l.tat, t) + l.interval
    local w = math.floor(t / l.period)
    if l.win ~= w then
      l.before = l.win == w - 1 and l.used or 0
      l.win, l.used = w, 0
    end
    l.used = l.used + 1
    l.dirty = true
  end

  -- The holders of a concurrency key (their count, for this call). A full key is checked
  -- against the holding hash first: a holder whose delivery is gone is dropped (no path
  -- leaves one, but a slot must never stay taken for ever if one did).
  function slots_of(p, key, most)
    local s = slot_sets[key]
    if s then return s end
    local n_held = redis.call('SCARD', key)
    if n_held >= most then
      local ids = redis.call('SMEMBERS', key)
      local live = redis.call('HMGET', p .. 'running', unpack(ids))
      local gone = {}
      for i, id in ipairs(ids) do
        if not live[i] then gone[#gone + 1] = id end
      end
      if #gone > 0 then
        redis.call('SREM', key, unpack(gone))
        n_held = n_held - #gone
      end
    end
    s = {n = n_held}
    slot_sets[key] = s
    return s
  end

  -- Up to k claimable ids of a flow-controlled queue, oldest first (taken off its list
  -- `pending`: one priority's, see below),
  -- with their slots and tokens spent), from its FLOW_WINDOW oldest, read k first (then as
  -- many again as were read, while jobs are still wanted and held back): a
  -- job whose task's rate limit has no token now, or whose concurrency key is full, stays
  -- where it is and the jobs behind it go ahead; the queue's own limit (`qlim`) stops the
  -- pass once spent. Stale ids (see the claim) are dropped, as by the plain claim. [expires]
  -- A job past its expiry is taken (the claim ends it) and counts neither among the k nor in
  -- the window, up to `budget` of them (the pass then stops): a window of expired jobs hid
  -- the live ones behind it, and the claim answered none with them pending.
  function flow_pick(p, k, qlim, pending, budget)
    if qlim and qlim.tat > t then
      if redis.call('LLEN', pending) > 0 then held_back(qlim.tat - t) end
      return {}
    end
    -- picked: the ids in fresh that are to run; expired: the others (they are not in the window)
    local fresh, keep, seen, done, looked, picked, expired = {}, {}, {}, false, 0, 0, 0
    while not done and looked - expired < FLOW_WINDOW do
      local c = math.min(math.max(k - picked, looked), FLOW_WINDOW - looked + expired)  -- k, then doubling
      local ids = redis.call('LRANGE', pending, -looked - c, -looked - 1)
      if #ids == 0 then break end
      looked = looked + #ids
      local held = redis.call('SMISMEMBER', p .. 'processing', unpack(ids))
      local listed = redis.call('SMISMEMBER', p .. 'items', unpack(ids))
      for i = #ids, 1, -1 do  -- oldest (rightmost) first
        local id = ids[i]
        if held[i] == 0 and listed[i] == 1 and not seen[id] then
          seen[id] = true
          local ok, tl, s, key, gone = not done, nil, nil, nil, false
          if ok then
            local job = p .. 'job:' .. id
            local f = redis.call('HMGET', job, 'task', 'rate_limit', 'max_concurrency', 'concurrency_key', 'opt')
            -- [expires] one past its expiry takes no token and no slot: the claim ends it
            if f[5] and f[5] ~= '' and string.find(f[5], 'expires', 1, true) then
              local at = tonumber(redis.call('HGET', job, 'expires'))
              gone = at ~= nil and t >= at
              ok = not gone
            end
            if ok and f[1] and f[2] then
              tl = limiter(p .. 'limit:' .. f[1], f[2])
              if tl and tl.tat > t then
                ok = false
                held_back(tl.tat - t)
              end
            end
            local most = tonumber(f[3])
            if ok and f[1] and most then
              key = slots_key(p, f[4], f[1])
              s = slots_of(p, key, most)
              ok = s.n < most
            end
          end
          if gone then  -- the claim ends it (Expired)
            fresh[#fresh + 1] = id
            expired = expired + 1
            done = expired >= budget  -- the call ends no more: the jobs behind stay
          elseif ok then
            fresh[#fresh + 1] = id
            picked = picked + 1
            if tl then spend(tl) end
            if s then
              s.n = s.n + 1
              redis.call('SADD', key, id)
            end
            if qlim then spend(qlim) end
            done = picked >= k or (qlim ~= nil and qlim.tat > t)
          else
            keep[#keep + 1] = id
          end
        end
      end
      if #ids < c then break end  -- the whole list was read
    end
    if #keep < looked then  -- else nothing was taken or dropped: the list stays as it is
      redis.call('LTRIM', pending, 0, -looked - 1)
      if #keep > 0 then
        local back = {}
        for i = #keep, 1, -1 do back[#back + 1] = keep[i] end  -- newest first: the oldest ends rightmost
        redis.call('RPUSH', pending, unpack(back))
      end
    end
    if done and qlim and qlim.tat > t and (#keep > 0 or redis.call('LLEN', pending) > 0) then
      held_back(qlim.tat - t)
    end
    return fresh
  end
end
-- <<< Flow control ---------------------------------------------------------------------

-- The last max duration text found good and its number, first ARGV[6] (checked above): a
-- batch's jobs mostly share one (the default, or their task's), and a string compared with it
-- (one pointer compare) saves json_decimal()'s patterns and a tonumber (~8k instructions a job).
local md_default = tonumber(ARGV[6])
local md_ok, md_ok_n = ARGV[6], md_default
local queued = {}  -- pid -> seconds of work ahead of its next job
local bucket_names = {}
-- The answer, 10 values a job, n_out of them so far. A batch's is made at its full size at once
-- ({unpack({}, 1, k)}: a table of k empty slots), where an empty table would be resized as it
-- grows (at 1, 2, 3, 5, 9, 17, ... values: ~2k instructions a job at 8 a call); up to 100
-- jobs (unpack's values go on Lua's stack). Its empty slots end it: the answer is the values
-- up to the first (# could answer any border, so n_out counts).
local out = want > 1 and want <= 100 and {unpack({}, 1, 10 * want)} or {}
local n_out = 0
local n = 0
-- [expires] The most jobs one call ends Expired, about (a batch read is ended whole): each
-- costs a finalize() (~65 us), and a backlog of them (no worker while they passed) was ended
-- in one call that held Redis for seconds (20,000: 1.3 s; 100,000: past a client's socket
-- timeout, other clients answered BUSY). A call that reaches it stops there and leaves the
-- queue a wake token: its claimer, found short, is woken at once and claims on.
local EXPIRED_MAX = 200
local expired_all = 0
for qi = 1, #KEYS do
  local p = KEYS[qi]
  local pending, processing, items = p .. 'pending', p .. 'processing', p .. 'items'
  local meta = redis.call('HMGET', p .. 'meta', 'bound', 'exclusive', 'flow', 'rate', 'paused', 'priorities')
  local limit = want
  if meta[2] == '1' then
    limit = redis.call('SCARD', processing) == 0 and math.min(want, n + 1) or n
  end
  local flow = meta[3] == '1' or meta[4] ~= false  -- flow control: one flow_pick() pass
  if flow then flow_control() end
  local qlim = meta[4] and limiter(p .. 'limit', meta[4]) or nil
  -- [flow: pause, priorities] nothing from a paused queue; the lists in claim order
  if meta[5] == '1' then limit = n end
  local lists, li = meta[6] and pending_lists(p, meta[6]), 1
  if lists then pending = lists[1] end
  -- [/flow]
  local taken, bytes, expired = 0, 0, 0
  local entries, buckets = {}, {}
  local more  -- jobs are left in `pending` (nil: not known, LLEN asks)
  while n < limit and expired_all < EXPIRED_MAX do
    local fresh
    local moved = false  -- fresh already moved from items to processing
    if flow then
      fresh = flow_pick(p, limit - n, qlim, pending, EXPIRED_MAX - expired_all)
    else
      -- One id more than wanted, left in the list: whether jobs are left, without an LLEN.
      -- A number argument is formatted by the call's bridge ('%.17g', ~2.5k instructions): an
      -- unbatched claim's -2 (here and in LTRIM) is passed as text.
      local start = n - limit - 1
      if start == -2 then start = '-2' end
      local ids = redis.call('LRANGE', pending, start, '-1')
      while #ids == 0 and lists and lists[li + 1] do  -- [flow: priorities] this level is empty: the next
        li = li + 1
        pending = lists[li]
        ids = redis.call('LRANGE', pending, start, '-1')
      end
      if #ids == 0 then
        more = false
        -- No job left in the queue: a wake token there is stale (left while no one listened;
        -- a job that comes after this call leaves its own), and would only wake an idle worker
        -- for a claim that finds nothing.
        redis.call('DEL', p .. 'wake')
        break
      end
      local lo = 1  -- ids[lo..] are taken off the list
      more = #ids > limit - n
      if more then lo = 2 end
      local stop = lo - #ids - 2
      redis.call('LTRIM', pending, '0', stop == -2 and '-2' or stop)
      fresh = {}
      if lo == #ids then
        -- One id (an unbatched claim): SREM from items and SADD to processing answer both
        -- checks below, 2 commands instead of 4. Held by another delivery: back in items.
        local id = ids[lo]
        if redis.call('SREM', items, id) == 1 then
          if redis.call('SADD', processing, id) == 1 then
            fresh[1] = id
          else
            redis.call('SADD', items, id)
          end
        end
        moved = true
      else
        local held = redis.call('SMISMEMBER', processing, unpack(ids, lo))
        local listed = redis.call('SMISMEMBER', items, unpack(ids, lo))
        local seen = {}
        for i = #ids, lo, -1 do  -- oldest (rightmost) first
          local id = ids[i]
          if held[i - lo + 1] == 0 and listed[i - lo + 1] == 1 and not seen[id] then
            seen[id] = true
            fresh[#fresh + 1] = id
          end
        end
      end
    end
    if #fresh > 0 and not moved then
      redis.call('SADD', processing, unpack(fresh))
      redis.call('SREM', items, unpack(fresh))
    end
    for j = 1, #fresh do  -- not ipairs(): a function call per job
      local id = fresh[j]
      local job = p .. 'job:' .. id
      local f = redis.call('HMGET', job, 'task', 'args', 'kwargs', 'max_duration', 'timeout_policy', 'attempts',
        'opt')
      local headers, soft, at = false, false, nil  -- at: its expiry, once found passed
      if f[1] and f[7] ~= '' then  -- optional fields to read: those `opt` names, or all (no `opt`: older)
        local v, ukey
        if not f[7] then
          v = redis.call('HMGET', job, 'headers', 'soft_limit', 'unique_key', 'unique_until')
          headers, soft, ukey = v[1], v[2], v[4] == 'start' and v[3]
        else
          local names = {}
          for name in string.gmatch(f[7], '%S+') do names[#names + 1] = name end
          v = #names > 0 and redis.call('HMGET', job, unpack(names)) or {}
          for i, name in ipairs(names) do
            if name == 'headers' then headers = v[i]
            elseif name == 'soft_limit' then soft = v[i]
            elseif name == 'unique_key' then ukey = v[i]
            elseif name == 'expires' then at = tonumber(v[i]) end
          end
        end
        if at and t >= at then  -- [expires] not started in time: its lock ends as it ends (finalize)
          ukey = nil
        else
          at = nil
        end
        if ukey then unlock(p, ukey, id) end  -- [flow: unique] its lock ends when it starts
      end
      if not f[1] then
        redis.call('SREM', processing, id)
        finalize(p, id, job, load(job), 'failed', t, 86400, {'error_type', 'CorruptJob',
          'error', 'job record missing or without a task field'}, 'CorruptJob')
      elseif at then  -- [expires] not delivered: it ends killed, Expired, as a kill of a pending job
        redis.call('SREM', processing, id)
        -- kept for the default failed TTL (claim.lua is not told the setting) unless its record has its own
        finalize(p, id, job, load(job), 'killed', t, 604800, {'error_type', 'Expired',
          'error', 'not started before it expired at ' .. utc_text(at)}, 'Expired')
        expired = expired + 1
        expired_all = expired_all + 1
      else
        n = n + 1
        taken = taken + 1
        bytes = bytes + #(f[2] or '') + #(f[3] or '') + #(headers or '')
        local pid, base = ARGV[5 + 2 * n], ARGV[6 + 2 * n]
        local attempt_n = f[6] == '0' and 1 or (tonumber(f[6]) or 0) + 1  -- a first delivery: no tonumber
        local attempt = attempt_n == 1 and '1' or tostring(attempt_n)  -- as text once; formatting a number costs
        local md_s, md = f[4], md_ok_n
        if md_s ~= md_ok then
          if json_decimal(md_s) then
            md = tonumber(md_s)
            md_ok, md_ok_n = md_s, md
          else  -- not "nan", "0x10", "-1", "5.": it is copied into JSON
            md, md_s = md_default, ARGV[6]
          end
        end
        local ahead, first = 0, 0
        if base ~= '' then
          first = tonumber(base)
          ahead = queued[pid] or first
          queued[pid] = ahead + md
        end
        local b = math.floor((t + first + md) / width)
        local b_s = bucket_names[b]  -- formatting numbers is costly: once per bucket
        if not b_s then
          -- '%d' costs half of tostring's '%.14g' (exact up to 2^53; beyond, a default max
          -- duration of more than 2^53 s, as before)
          b_s = b < 9007199254740992 and string.format('%d', b) or tostring(b)
          bucket_names[b] = b_s
        end
        local entry = ARGV[1] .. ',"pid":' .. pid .. ',"started_at":' .. ts .. ',"max_duration":' .. md_s
          .. ',"attempt":' .. attempt .. (ahead > 0 and (',"ahead":' .. ahead) or '') .. '}'
        if attempt_n == 1 then  -- never claimed before, so never stuck: no `stuck 0` (one field less)
          redis.call('HSET', job, 'attempts', '1', 'state', 'running', 'started_at', ts, 'worker', ARGV[2],
            'host', ARGV[3], 'ip', ARGV[4], 'pid', pid, 'bucket', b_s, 'run:1', entry)
        else
          redis.call('HSET', job, 'attempts', attempt, 'state', 'running', 'started_at', ts, 'worker', ARGV[2],
            'host', ARGV[3], 'ip', ARGV[4], 'pid', pid, 'bucket', b_s, 'stuck', '0', 'run:' .. attempt, entry)
        end
        if meta[2] == '1' then  -- its finish wakes the queue's next job (finish.lua): no meta read there
          redis.call('HSET', job, 'exclusive', '1')
        end
        entries[2 * taken - 1], entries[2 * taken] = id, entry  -- the job's pair in the holding hash
        local ids_b = buckets[b]
        if not ids_b then
          ids_b = {}
          buckets[b] = ids_b
        end
        ids_b[#ids_b + 1] = id
        local o = n_out
        n_out = o + 10
        out[o + 1], out[o + 2], out[o + 3], out[o + 4] = qi, id, attempt_n, f[1]
        out[o + 5], out[o + 6], out[o + 7], out[o + 8] = f[2] or '[]', f[3] or '{}', md_s, f[5] or 'kill'
        out[o + 9], out[o + 10] = headers or '', soft or ''
      end
    end
    if flow then  -- one pass (per priority's list): the jobs it left behind wait for a later claim
      if not (lists and lists[li + 1]) then break end
      li = li + 1  -- [flow: priorities]
      pending = lists[li]
    end
  end
  if taken > 0 then
    redis.call('HSET', p .. 'running', unpack(entries))
    for b, ids_b in pairs(buckets) do
      redis.call('SADD', p .. 'dl:' .. bucket_names[b], unpack(ids_b))
      local due = (b + 1) * width  -- formatted as the bucket's name (a number argument costs more)
      redis.call('ZADD', p .. 'buckets', due < 9007199254740992 and string.format('%d', due) or due, bucket_names[b])
    end
    redis.call('HINCRBY', p .. 'meta', 'consumed_messages', taken == 1 and '1' or taken)  -- a number costs a format
    redis.call('HINCRBY', p .. 'meta', 'consumed_bytes', bytes)
    signal_room(p, tonumber(meta[1]) or 0, meta[6])
  elseif expired > 0 then  -- [expires] they left the queue too: room for a producer
    signal_room(p, tonumber(meta[1]) or 0, meta[6])
  end
  if expired_all >= EXPIRED_MAX and n < limit then  -- [expires] cut short: its claimer comes back for the rest
    wake(p)
    break
  end
  if n >= want then
    if more == nil or lists then more = (lists and backlog(p, meta[6]) or redis.call('LLEN', pending)) > 0 end
    if more then wake(p) end
    break
  end
end
-- >>> Flow control: the limiters spent, and when the claimer may try again
if limiters then  -- a flow-controlled queue was met
  for key, l in pairs(limiters) do
    if l.dirty then
      redis.call('HSET', key, 'tat', fmt(l.tat), 'win', l.win, 'used', l.used, 'before', l.before)
      redis.call('PEXPIREAT', key, math.ceil(math.max(l.tat, (l.win + 2) * l.period) * 1000))
    end
  end
end
if wait_min and n < want then
  out[n_out + 1] = string.format('%.6f', wait_min)
end
-- <<< Flow control
return out
