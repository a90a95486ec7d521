-- Delete a job that is not running (kill it first): every trace of it goes.
-- KEYS[1]  queue key prefix
-- ARGV[1]  id
-- Returns the state before; "" when there is no such job; "running" (refused).
local p = KEYS[1]
local id = ARGV[1]
local job = p .. 'job:' .. id
local state = redis.call('HGET', job, 'state')
if not state or state == 'running' then
  return state or ''
end
redis.call('SREM', p .. 'items', id)
redis.call('LREM', p .. 'pending', 0, id)
for _, k in ipairs({'delayed', 'completed', 'failed', 'killed'}) do
  redis.call('ZREM', p .. k, id)
end
redis.call('DEL', job, p .. 'notify:' .. id)
return state
