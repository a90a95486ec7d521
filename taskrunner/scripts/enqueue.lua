-- Add jobs to one queue, all in one call.
-- KEYS[1]  queue key prefix
-- ARGV[1]  number of jobs N; then per job: id, delay (s, 0 = now), K, then K field/value pairs
-- Returns one integer per job: 1 added, 0 an id that already exists (nothing changed).
-- Sets: job:<id> (fields + state, enqueued_at), then pending+items (+wake) or delayed.
local p = KEYS[1]
local t = now()
local out = {}
local i = 2
for n = 1, tonumber(ARGV[1]) do
  local id, delay, k = ARGV[i], tonumber(ARGV[i + 1]), tonumber(ARGV[i + 2])
  local job = p .. 'job:' .. id
  if redis.call('EXISTS', job) == 1 then
    out[n] = 0
  else
    redis.call('HSET', job, 'id', id, 'enqueued_at', fmt(t), 'attempts', '0', unpack(ARGV, i + 3, i + 2 + 2 * k))
    if delay > 0 then
      to_delayed(p, id, job, t + delay)
    else
      to_pending(p, id, job, false)
    end
    out[n] = 1
  end
  i = i + 3 + 2 * k
end
return out
