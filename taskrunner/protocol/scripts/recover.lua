-- Put back jobs delivered longer ago than N seconds, oldest first (RedisRQ's RQ.RECOVER):
-- released and pending next in line; their next claim counts a new delivery.
-- KEYS[1]  queue key prefix
-- ARGV[1]  older than (s)   ARGV[2] at most this many   ARGV[3] who asked
-- Returns the ids put back. An age that is not a number of seconds >= 0 and < 2^53 (a
-- negative one would put back every running job, one just started by a live worker too), or
-- a count that is not a whole number >= 1, is refused: ERR taskrunner: BadCall: recover: ...
local p = KEYS[1]
local age, most = tonumber(ARGV[1]), tonumber(ARGV[2])
if not age or not (age >= 0 and age < 9007199254740992) then
  return redis.error_reply('ERR taskrunner: BadCall: recover: the age (ARGV[1]) must be a number of seconds >= 0 '
    .. 'and < 2^53')
end
if not most or most < 1 or most ~= math.floor(most) then
  return redis.error_reply('ERR taskrunner: BadCall: recover: the count (ARGV[2]) must be a whole number >= 1')
end
local t = now()
local cutoff = t - age
local due = {}
local entries = redis.call('HGETALL', p .. 'running')
for i = 1, #entries, 2 do
  local ok, e = pcall(cjson.decode, entries[i + 1])
  local started = ok and tonumber(e.started_at) or 0
  if started < cutoff then
    due[#due + 1] = {started, entries[i]}
  end
end
table.sort(due, function(a, b) return a[1] < b[1] or (a[1] == b[1] and a[2] < b[2]) end)
local out = {}
for i = 1, math.min(#due, most) do
  local id = due[i][2]
  local job = p .. 'job:' .. id
  local r = load(job)
  release(p, id, r)
  redis.call('HINCRBY', job, 'requeues', 1)
  history(p, id, r, 'requeued', t, nil)
  local ek, ev = ended(redis.call('HGET', job, 'attempts') or '0', t,
    string.format('recovered by %s (delivered %.0fs before)', ARGV[3], t - due[i][1]))
  to_pending(p, id, job, true, {'last_requeued_at', fmt(t), ek, ev}, r[PRIORITY])
  out[#out + 1] = id
end
return out
