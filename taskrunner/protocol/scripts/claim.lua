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
-- Counts meta consumed_messages/consumed_bytes; a bounded queue signals room (notfull).
-- Returns {queue index, id, attempt, task, args, kwargs, max_duration, timeout_policy,
-- headers, soft limit}* (headers: the record's JSON object text, "" when it has none;
-- soft limit: the record's soft_limit, "" if none).
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
local head_ok, head = pcall(cjson.decode, ARGV[1] .. '}')
if not head_ok or type(head) ~= 'table' or head.worker ~= ARGV[2] then
  return redis.error_reply('ERR claim: ARGV[1] must be a JSON object without its closing brace, '
    .. 'with "worker" equal to ARGV[2], e.g. {"worker":"w1","host":"h","ip":"10.0.0.1"')
end
local width, default_md = tonumber(ARGV[5]), tonumber(ARGV[6])
if not width or width < 1 or width ~= math.floor(width) then
  return redis.error_reply('ERR claim: bucket width (ARGV[5]) must be an integer >= 1')
end
if not json_decimal(ARGV[6]) then
  return redis.error_reply('ERR claim: default max duration (ARGV[6]) must be seconds written like 300 or 0.5')
end
for i = 7, #ARGV, 2 do
  if not string.find(ARGV[i], '^[1-9]%d?%d?%d?%d?%d?%d?%d?%d?%d?$') then
    return redis.error_reply('ERR claim: pid (ARGV[' .. i .. ']) must be a decimal integer > 0, not "'
      .. string.sub(ARGV[i], 1, 40) .. '"')
  end
  if ARGV[i + 1] ~= '' and not amount(ARGV[i + 1], nil) then
    return redis.error_reply('ERR claim: ahead (ARGV[' .. i + 1 .. ']) must be "" or seconds >= 0')
  end
end
local t = now()
local ts = fmt(t)
local want = (#ARGV - 6) / 2
local queued = {}  -- pid -> seconds of work ahead of its next job
local bucket_names = {}
local out = {}
local n = 0
for qi = 1, #KEYS do
  local p = KEYS[qi]
  local pending, processing, items = p .. 'pending', p .. 'processing', p .. 'items'
  local meta = redis.call('HMGET', p .. 'meta', 'bound', 'exclusive')
  local limit = want
  if meta[2] == '1' then
    limit = redis.call('SCARD', processing) == 0 and math.min(want, n + 1) or n
  end
  local taken, bytes = 0, 0
  local entries, buckets = {}, {}
  while n < limit do
    local ids = redis.call('LRANGE', pending, n - limit, -1)
    if #ids == 0 then break end
    redis.call('LTRIM', pending, 0, -#ids - 1)
    local held = redis.call('SMISMEMBER', processing, unpack(ids))
    local listed = redis.call('SMISMEMBER', items, unpack(ids))
    local fresh, seen = {}, {}
    for i = #ids, 1, -1 do  -- oldest (rightmost) first
      local id = ids[i]
      if held[i] == 0 and listed[i] == 1 and not seen[id] then
        seen[id] = true
        fresh[#fresh + 1] = id
      end
    end
    if #fresh > 0 then
      redis.call('SADD', processing, unpack(fresh))
      redis.call('SREM', items, unpack(fresh))
    end
    for _, id in ipairs(fresh) do
      local job = p .. 'job:' .. id
      local f = redis.call('HMGET', job, 'task', 'args', 'kwargs', 'max_duration', 'timeout_policy', 'attempts',
        'headers', 'soft_limit')
      if not f[1] then
        redis.call('SREM', processing, id)
        finalize(p, id, job, load(job), 'failed', t, 86400, {'error_type', 'CorruptJob',
          'error', 'job record missing or without a task field'}, 'CorruptJob')
      else
        n = n + 1
        taken = taken + 1
        bytes = bytes + #(f[2] or '') + #(f[3] or '') + #(f[7] or '')
        local pid, base = ARGV[5 + 2 * n], ARGV[6 + 2 * n]
        local attempt_n = (tonumber(f[6]) or 0) + 1
        local attempt = tostring(attempt_n)  -- as text once, not at each use
        local md_s = f[4]
        local md = tonumber(md_s)
        if not json_decimal(md_s) then  -- not "nan", "0x10", "-1", "5.": it is copied into JSON
          md, md_s = default_md, ARGV[6]
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
          b_s = tostring(b)
          bucket_names[b] = b_s
        end
        local entry = ARGV[1] .. ',"pid":' .. pid .. ',"started_at":' .. ts .. ',"max_duration":' .. md_s
          .. ',"attempt":' .. attempt .. (ahead > 0 and (',"ahead":' .. ahead) or '') .. '}'
        redis.call('HSET', job, 'attempts', attempt, 'state', 'running', 'started_at', ts, 'worker', ARGV[2],
          'host', ARGV[3], 'ip', ARGV[4], 'pid', pid, 'bucket', b_s, 'stuck', '0', 'run:' .. attempt, entry)
        entries[#entries + 1] = id
        entries[#entries + 1] = entry
        local ids_b = buckets[b]
        if not ids_b then
          ids_b = {}
          buckets[b] = ids_b
        end
        ids_b[#ids_b + 1] = id
        local o = #out
        out[o + 1], out[o + 2], out[o + 3], out[o + 4] = qi, id, attempt_n, f[1]
        out[o + 5], out[o + 6], out[o + 7], out[o + 8] = f[2] or '[]', f[3] or '{}', md_s, f[5] or 'kill'
        out[o + 9], out[o + 10] = f[7] or '', f[8] or ''
      end
    end
  end
  if taken > 0 then
    redis.call('HSET', p .. 'running', unpack(entries))
    for b, ids_b in pairs(buckets) do
      redis.call('SADD', p .. 'dl:' .. bucket_names[b], unpack(ids_b))
      redis.call('ZADD', p .. 'buckets', (b + 1) * width, bucket_names[b])
    end
    redis.call('HINCRBY', p .. 'meta', 'consumed_messages', taken)
    redis.call('HINCRBY', p .. 'meta', 'consumed_bytes', bytes)
    signal_room(p, tonumber(meta[1]) or 0)
  end
  if n >= want then
    if redis.call('LLEN', pending) > 0 then wake(p) end
    break
  end
end
return out
