-- Delete up to N pending jobs of a queue (callers repeat until none is left, so that one
-- call never blocks Redis for long). Running, delayed, waiting and finished jobs are
-- untouched; the jobs waiting for one deleted end canceled (as for delete.lua). Every
-- priority's list (meta priorities), highest first; a unique job's lock goes with it.
-- KEYS[1]  queue key prefix
-- ARGV[1]  N   ARGV[2] (optional) failed TTL (s) for those canceled; default 604800
-- Returns {deleted, pending left}. N and the TTL must be integers >= 1, else refused (ERR
-- taskrunner: BadCall: purge: ..., nothing changed).
local p = KEYS[1]
local most, ttl = tonumber(ARGV[1]), tonumber(ARGV[2] or '604800')
if not most or most < 1 or most ~= math.floor(most) then
  return redis.error_reply('ERR taskrunner: BadCall: purge: the most jobs to delete (ARGV[1]) must be an integer >= 1')
end
if not ttl or ttl < 1 or ttl ~= math.floor(ttl) then
  return redis.error_reply('ERR taskrunner: BadCall: purge: the failed TTL (ARGV[2]) must be an integer >= 1 '
    .. '(seconds)')
end
local deleted = 0
local levels = redis.call('HGET', p .. 'meta', 'priorities')
local lists, li = pending_lists(p, levels), 1
for _ = 1, most do
  local id = redis.call('RPOP', lists[li])
  while not id and lists[li + 1] do
    li = li + 1
    id = redis.call('RPOP', lists[li])
  end
  if not id then break end
  if redis.call('SREM', p .. 'items', id) == 1 then
    local job = p .. 'job:' .. id
    local f = redis.call('HMGET', job, 'children', 'task', 'cross_children', 'unique_key')
    if f[1] then
      workflows()
      settle_children(p, id, job, {children = f[1], task = f[2], cross_children = f[3] or nil}, 'deleted', now(),
        ttl)
    end
    if f[4] then
      unlock(p, f[4], id)
    end
    redis.call('DEL', job)
    deleted = deleted + 1
  end
end
return {deleted, backlog(p, levels)}
