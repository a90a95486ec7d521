-- Delete up to N pending jobs of a queue (callers repeat until none is left, so that one
-- call never blocks Redis for long). Running, delayed and finished jobs are untouched.
-- KEYS[1]  queue key prefix
-- ARGV[1]  N
-- Returns {deleted, pending left}.
local p = KEYS[1]
local deleted = 0
for _ = 1, tonumber(ARGV[1]) do
  local id = redis.call('RPOP', p .. 'pending')
  if not id then break end
  if redis.call('SREM', p .. 'items', id) == 1 then
    redis.call('DEL', p .. 'job:' .. id)
    deleted = deleted + 1
  end
end
return {deleted, redis.call('LLEN', p .. 'pending')}
