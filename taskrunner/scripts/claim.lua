-- Claim up to N jobs from queues in strict priority order (one round trip).
-- KEYS[i]  key prefix of queue i, highest priority first
-- ARGV[1]  holding entry head: JSON object text without its closing brace,
--          e.g. {"worker":"w1","host":"h","ip":"10.0.0.1"
-- ARGV[2]  worker name   ARGV[3] host   ARGV[4] ip
-- ARGV[5]  deadline bucket width (s)   ARGV[6] default max duration (s)
-- ARGV[7..] the PID of the process that will run each claimed job (N = #ARGV - 6)
-- Per job, the antirez claim: LINDEX the oldest id, SADD it to processing (0: another
-- claimer owns it), SREM it from items (0: killed or deleted meanwhile), then RPOP it;
-- record it in the holding hash and its deadline bucket; attempts+1 is the fencing token.
-- An exclusive queue (meta exclusive = 1) gives a job only while none of it runs.
-- Counts meta consumed_messages/consumed_bytes; a bounded queue signals room (notfull).
-- Returns {queue index, id, attempt, task, args, kwargs, max_duration, timeout_policy}*.
local t = now()
local width, default_md = tonumber(ARGV[5]), tonumber(ARGV[6])
local want = #ARGV - 6
local out = {}
local n = 0
for qi = 1, #KEYS do
  local p = KEYS[qi]
  local pending = p .. 'pending'
  local meta = redis.call('HMGET', p .. 'meta', 'bound', 'exclusive')
  local limit = want
  if meta[2] == '1' then
    limit = redis.call('SCARD', p .. 'processing') == 0 and math.min(want, n + 1) or n
  end
  local taken, bytes = 0, 0
  while n < limit do
    local id = redis.call('LINDEX', pending, -1)
    if not id then break end
    local own = redis.call('SADD', p .. 'processing', id)
    local queued = own == 1 and redis.call('SREM', p .. 'items', id)
    redis.call('RPOP', pending)
    if own == 1 and queued == 0 then
      redis.call('SREM', p .. 'processing', id)
    elseif own == 1 then
      local job = p .. 'job:' .. id
      local f = redis.call('HMGET', job, 'task', 'args', 'kwargs', 'max_duration', 'timeout_policy')
      if not f[1] then
        redis.call('SREM', p .. 'processing', id)
        finalize(p, id, job, load(job), 'failed', t, 86400, {'error_type', 'CorruptJob',
          'error', 'job record missing or without a task field'}, 'CorruptJob')
      else
        n = n + 1
        taken = taken + 1
        bytes = bytes + #(f[2] or '') + #(f[3] or '')
        local pid = ARGV[6 + n]
        local attempt = redis.call('HINCRBY', job, 'attempts', 1)
        local md = tonumber(f[4]) or default_md
        local b = math.floor((t + md) / width)
        local entry = ARGV[1] .. ',"pid":' .. pid .. ',"started_at":' .. fmt(t)
          .. ',"max_duration":' .. md .. ',"attempt":' .. attempt .. '}'
        redis.call('HSET', job, 'state', 'running', 'started_at', fmt(t), 'worker', ARGV[2],
          'host', ARGV[3], 'ip', ARGV[4], 'pid', pid, 'bucket', b, 'stuck', '0', 'run:' .. attempt, entry)
        redis.call('SADD', p .. 'dl:' .. b, id)
        redis.call('ZADD', p .. 'buckets', (b + 1) * width, b)
        redis.call('HSET', p .. 'running', id, entry)
        local o = #out
        out[o + 1], out[o + 2], out[o + 3], out[o + 4] = qi, id, attempt, f[1]
        out[o + 5], out[o + 6], out[o + 7], out[o + 8] = f[2] or '[]', f[3] or '{}', tostring(md), f[5] or 'kill'
      end
    end
  end
  if taken > 0 then
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
