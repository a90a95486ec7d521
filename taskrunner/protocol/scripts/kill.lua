-- Kill a job. Pending, delayed or waiting: it ends killed at once (the jobs waiting for it
-- end canceled; those in other slots get an outbox entry, see _lib.lua, carried by the
-- dispatcher). Running: flag the request and
-- tell the caller which worker holds it, so the caller can message that worker; a
-- delivery that is later lost with the flag set also ends killed (see lose()).
-- KEYS[1]  queue key prefix
-- ARGV[1]  id   ARGV[2] who asked   ARGV[3] failed TTL (s): how long a killed job is kept
--          (the setting; the record's own failed_ttl wins): an integer >= 1, else refused
--          (ERR kill: ..., nothing changed; it used to end the job killed, then fail at its
--          EXPIRE, the record kept for ever and its waiters and children left waiting)
-- Returns {"killed"} (killed by this call); {"running", worker, attempts} (kill requested:
-- "", "0" when the record lacks them); {"ended", state} for any other state, a job that had
-- ended (completed, failed, killed, canceled): nothing done (before 2026-11-27 {state}, which
-- for a killed job read as a kill by this call); {""} when there is no such job.
local p = KEYS[1]
local id = ARGV[1]
local ttl = tonumber(ARGV[3])
if not ttl or ttl < 1 or ttl ~= math.floor(ttl) then
  return redis.error_reply('ERR kill: the failed TTL (ARGV[3]) must be an integer >= 1 (seconds)')
end
local job = p .. 'job:' .. id
local t = now()
local f = redis.call('HMGET', job, 'state', 'priority')
local state = f[1]
if not state then
  return {''}
end
local why = 'killed by ' .. ARGV[2]
if state == 'pending' or state == 'delayed' or state == 'waiting' then
  redis.call('SREM', p .. 'items', id)
  redis.call('LREM', pending_of(p, f[2]), 0, id)
  redis.call('ZREM', p .. 'delayed', id)
  redis.call('ZREM', p .. 'waiting', id)
  finalize(p, id, job, load(job), 'killed', t, ttl,
    {'error_type', 'Killed', 'error', why, 'killed_by', ARGV[2]}, 'Killed')
  return {'killed'}
end
if state == 'running' then
  redis.call('HSET', job, 'kill_requested', fmt(t), 'killed_by', ARGV[2])
  local f = redis.call('HMGET', job, 'worker', 'attempts')
  return {'running', f[1] or '', f[2] or '0'}
end
return {'ended', state}
