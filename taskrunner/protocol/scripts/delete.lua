-- Delete a job that is not running (kill it first): every trace of it goes. The jobs
-- waiting for one that had not completed end canceled (they would wait for ever). A unique
-- job's lock goes with it, a failed or killed one leaves the failure indexes (see _lib.lua).
-- KEYS[1]  queue key prefix
-- ARGV[1]  id   ARGV[2] (optional) failed TTL (s) for those canceled, an integer >= 1;
--          default 604800
-- ARGV[3]  (optional) the states it may delete, e.g. "failed killed" (a bulk delete of the
--          failed ones: a job retried meanwhile is left as it is); default: any but running
-- Children in other slots get an outbox entry (see _lib.lua), carried by the dispatcher.
-- Returns the state before; "" when there is no such job (its record expired: its id leaves the
-- sets of the states it may delete and their failure indexes, see forget_gone in _lib.lua);
-- "running" or a state not in ARGV[3] (refused: nothing changed). Bad arguments are refused
-- (ERR taskrunner: BadCall: delete: ..., nothing changed): a TTL of 0 used to delete the
-- records of the steps it canceled at once.
local p = KEYS[1]
local id = ARGV[1]
local ttl = tonumber(ARGV[2] or '604800')
if not ttl or ttl < 1 or ttl ~= math.floor(ttl) then
  return redis.error_reply('ERR taskrunner: BadCall: delete: the failed TTL (ARGV[2]) must be an integer >= 1 '
    .. '(seconds)')
end
local SETS = {'delayed', 'waiting', 'completed', 'failed', 'killed', 'canceled'}  -- the states kept in a ZSET
local may = SETS
if ARGV[3] then
  local known = {pending = true, delayed = true, waiting = true, completed = true, failed = true, killed = true,
    canceled = true}
  may = {}
  for w in string.gmatch(ARGV[3], '%S+') do
    if not known[w] then
      return redis.error_reply('ERR taskrunner: BadCall: delete: ARGV[3] lists the states it may delete (pending, delayed, waiting, '
        .. 'completed, failed, killed, canceled, space-separated); got ' .. string.format('%q', string.sub(w, 1, 50)))
    end
    if w ~= 'pending' then
      may[#may + 1] = w
    end
  end
end
local job = p .. 'job:' .. id
local f = redis.call('HMGET', job, 'state', 'priority', 'unique_key')
local state = f[1]
if not state then
  forget_gone(p, id, may)
  return ''
end
if state == 'running' then
  return state
end
if ARGV[3] and not string.find(' ' .. ARGV[3] .. ' ', ' ' .. state .. ' ', 1, true) then
  return state
end
redis.call('SREM', p .. 'items', id)
redis.call('LREM', pending_of(p, f[2]), 0, id)
if f[3] then
  unlock(p, f[3], id)
end
for _, k in ipairs(SETS) do
  redis.call('ZREM', p .. k, id)
end
local f = redis.call('HMGET', job, 'children', 'task', 'cross_children', 'error_type')
if state == 'failed' or state == 'killed' then
  unindex_failure(p, state, id, f[2], f[4])
end
if f[1] and state ~= 'completed' then
  workflows()
  settle_children(p, id, job, {children = f[1], task = f[2], cross_children = f[3] or nil}, 'deleted', now(),
    ttl)
end
redis.call('DEL', job, p .. 'notify:' .. id)
return state
