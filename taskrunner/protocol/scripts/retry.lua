-- Run a failed or killed job again (an operator's retry): it becomes pending, at the back,
-- with its counts of failures, losses and Retry requests back to 0.
-- KEYS[1]  queue key prefix
-- ARGV[1]  id   ARGV[2] who asked
-- Returns the state before ("" when there is no such job); only failed and killed change.
local p = KEYS[1]
local id = ARGV[1]
local job = p .. 'job:' .. id
local state = redis.call('HGET', job, 'state')
if state ~= 'failed' and state ~= 'killed' then
  return state or ''
end
local t = now()
redis.call('ZREM', p .. state, id)
redis.call('PERSIST', job)
redis.call('HDEL', job, 'kill_requested', 'finished_at', 'result', 'stuck', 'stuck_at')
redis.call('HSET', job, 'failures', '0', 'lost', '0', 'retry_requests', '0')  -- a fresh budget
to_pending(p, id, job, false, {'action:' .. fmt(t), 'retried by ' .. ARGV[2]})
return state
