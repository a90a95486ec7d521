-- Flag a running delivery that passed its max duration as stuck and move it to the
-- bucket of its next check. Fenced by delivery.
-- KEYS[1]  queue key prefix
-- ARGV[1]  id   ARGV[2] attempt   ARGV[3] next check time   ARGV[4] bucket width (s)
-- Returns {worker, timeout_policy, first time flagged (1/0)}, or {} if not held.
local p = KEYS[1]
local id, attempt = ARGV[1], ARGV[2]
local job = p .. 'job:' .. id
if holder_check(p, id, load(job), attempt) ~= 1 then
  return {}
end
local width = tonumber(ARGV[4])
local nb = math.floor(tonumber(ARGV[3]) / width)
local old = redis.call('HGET', job, 'bucket')
if old then
  local bk = p .. 'dl:' .. old
  redis.call('SREM', bk, id)
  if redis.call('SCARD', bk) == 0 then redis.call('ZREM', p .. 'buckets', old) end
end
redis.call('SADD', p .. 'dl:' .. nb, id)
redis.call('ZADD', p .. 'buckets', (nb + 1) * width, nb)
local first = redis.call('HGET', job, 'stuck') ~= '1' and 1 or 0
redis.call('HSET', job, 'bucket', nb, 'stuck', '1')
if first == 1 then
  redis.call('HSET', job, 'stuck_at', fmt(now()))
end
local f = redis.call('HMGET', job, 'worker', 'timeout_policy')
return {f[1] or '', f[2] or 'kill', first}
