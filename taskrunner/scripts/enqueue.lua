-- Add jobs to one queue, all in one call.
-- KEYS[1]  queue key prefix
-- ARGV[1]  number of jobs N; then per job: id, delay (s, 0 = now), K, then K field/value pairs
-- Returns one integer per job: 1 added, 0 an id that already exists (nothing changed),
-- -1 the queue is full (its bound is reached; delayed jobs do not count), -2 it is closed.
-- Sets: job:<id> (fields + state, enqueued_at), then pending+items (+wake) or delayed;
-- meta produced_messages/produced_bytes (bytes = length of args + kwargs).
local p = KEYS[1]
local t = now()
local meta = redis.call('HMGET', p .. 'meta', 'bound', 'closed')
local bound, closed = tonumber(meta[1]) or 0, meta[2] == '1'
local out = {}
local i = 2
local added, bytes = 0, 0
for n = 1, tonumber(ARGV[1]) do
  local id, delay, k = ARGV[i], tonumber(ARGV[i + 1]), tonumber(ARGV[i + 2])
  local job = p .. 'job:' .. id
  if closed then
    out[n] = -2
  elseif redis.call('EXISTS', job) == 1 then
    out[n] = 0
  elseif delay <= 0 and bound > 0 and redis.call('LLEN', p .. 'pending') >= bound then
    out[n] = -1
  else
    local state = delay > 0 and 'delayed' or 'pending'
    redis.call('HSET', job, 'id', id, 'enqueued_at', fmt(t), 'attempts', '0', 'state', state,
      unpack(ARGV, i + 3, i + 2 + 2 * k))
    for f = i + 3, i + 1 + 2 * k, 2 do
      if ARGV[f] == 'args' or ARGV[f] == 'kwargs' then bytes = bytes + #ARGV[f + 1] end
    end
    if delay > 0 then
      to_delayed(p, id, job, t + delay)
    else  -- to_pending() without its HSET, done above
      redis.call('SADD', p .. 'items', id)
      redis.call('LPUSH', p .. 'pending', id)
      wake(p)
    end
    added = added + 1
    out[n] = 1
  end
  i = i + 3 + 2 * k
end
if added > 0 then
  redis.call('HINCRBY', p .. 'meta', 'produced_messages', added)
  redis.call('HINCRBY', p .. 'meta', 'produced_bytes', bytes)
  signal_room(p, bound)
end
return out
