-- Read a job's state for a waiter and, unless it has ended, count the waiter in, so
-- that finalize() pushes a token to notify:<id> for it (the waiter then BLPOPs it).
-- KEYS[1]  queue key prefix   ARGV[1] id
-- Returns the state ("" when there is no such job).
local job = KEYS[1] .. 'job:' .. ARGV[1]
local state = redis.call('HGET', job, 'state')
if not state then
  return ''
end
if state ~= 'completed' and state ~= 'failed' and state ~= 'killed' and state ~= 'canceled' then
  redis.call('HINCRBY', job, 'waiters', 1)
end
return state
