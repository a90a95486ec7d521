-- Flag a running delivery that passed its max duration as stuck and move it to the
-- bucket of its next check. Fenced by delivery.
-- KEYS[1]  queue key prefix
-- ARGV[1]  id   ARGV[2] attempt   ARGV[3] next check time   ARGV[4] bucket width (s)
-- ARGV[5]  "check": the caller saw the job in a due bucket (the dispatcher), and a job
--          sent ahead to a process (holding entry "ahead") may not be due yet: then it
--          only moves to the bucket of its deadline, unflagged. Without it the caller
--          knows (the worker running it saw it pass its time).
-- Returns {worker, timeout_policy, first time flagged (1/0)}, or {} if not flagged.
local p = KEYS[1]
local id, attempt = ARGV[1], ARGV[2]
local job = p .. 'job:' .. id
local r = load(job)
if holder_check(p, id, r[ATTEMPTS], attempt) ~= 1 then
  return {}
end
local t = now()
local width = tonumber(ARGV[4])
local next_check, flag = tonumber(ARGV[3]), true
if ARGV[5] == 'check' then
  local ok, e = pcall(cjson.decode, redis.call('HGET', p .. 'running', id))
  if ok and type(e) == 'table' then
    local deadline = amount(e.started_at, 0) + amount(e.ahead, 0) + amount(e.max_duration, 0)
    if deadline > t then
      next_check, flag = deadline, false
    end
  end
end
local nb = math.floor(next_check / width)
local old = r[BUCKET]
if old then
  local bk = p .. 'dl:' .. old
  redis.call('SREM', bk, id)
  if redis.call('SCARD', bk) == 0 then redis.call('ZREM', p .. 'buckets', old) end
end
redis.call('SADD', p .. 'dl:' .. nb, id)
redis.call('ZADD', p .. 'buckets', (nb + 1) * width, nb)
if not flag then
  redis.call('HSET', job, 'bucket', nb)
  return {}
end
local f = redis.call('HMGET', job, 'stuck', 'timeout_policy')
local first = f[1] ~= '1' and 1 or 0
redis.call('HSET', job, 'bucket', nb, 'stuck', '1')
if first == 1 then
  redis.call('HSET', job, 'stuck_at', fmt(t))
end
return {r[WORKER] or '', f[2] or 'kill', first}
