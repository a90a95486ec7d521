-- Make existing jobs of this queue parents of a job of another slot (depends_on across slots
-- on a Redis Cluster; docs/PROTOCOL.md, Workflows). Called before the child is enqueued: a
-- child never waits for a parent that does not know it, whatever process dies when.
-- KEYS[1]  the parents' queue key prefix "<P>:{<Q>}:"
-- ARGV[1]  the child's queue (not Q)   ARGV[2] the child's id
-- ARGV[3]  what the child takes from its parents: result, results, error, or - (nothing)
-- ARGV[4..] the parents' ids (at least one)
-- Every parent is checked before any is changed; the call is refused (ERR taskrunner:
-- BadValue: ..., nothing changed) when one does not exist, or ended failed, killed or
-- canceled (the child would never run) without listing the child already (a call sent
-- again, its answer lost: the parent's end dealt with the child). Then per parent:
--   it lists the child in `children` already (this call ran before): nothing; answer 1, or
--     2 when it has completed
--   it has not completed: `children` += "<queue> <id>", `cross_children` += "<queue> <id>
--     <takes>": its end leaves the outbox entry (_lib.lua settle_children()): answer 1
--   it completed: `children` += "<queue> <id>" and an outbox entry now, with its result when
--     the child takes it: answer 2
-- Returns one integer per parent; then, only when entries were left, them (as XRANGE gives
-- them), for the caller to carry once it has enqueued the child.
local p = KEYS[1]
workflows()
local function refuse(kind, message)
  return redis.error_reply('ERR taskrunner: ' .. kind .. ': attach: ' .. message)
end
local here = queue_of(p)
local cq, cid, takes = ARGV[1], ARGV[2], ARGV[3]
if not here or not is_queue(here) then
  return refuse('BadCall', 'KEYS[1] must be a queue key prefix "<prefix>:{<queue>}:"')
elseif #ARGV < 4 or not is_queue(cq) or cq == here or not cid or #cid > 200
    or not string.find(cid, '^[A-Za-z0-9_.:@%-]+$') then
  return refuse('BadCall', 'ARGV is the child\'s queue (another than KEYS[1]\'s), its id, what it takes, then the '
    .. 'parents\' ids')
elseif takes ~= 'result' and takes ~= 'results' and takes ~= 'error' and takes ~= '-' then
  return refuse('BadValue', 'takes must be result, results, error or -')
end
local pair = cq .. ' ' .. cid
local found, listed, seen = {}, {}, {}
for k = 4, #ARGV do
  local f = redis.call('HMGET', p .. 'job:' .. ARGV[k], 'state', 'children', 'task', 'result')
  listed[k] = f[2] and string.find(' ' .. f[2] .. ' ', ' ' .. pair .. ' ', 1, true)
  if seen[ARGV[k]] then
    return refuse('BadValue', 'parent ' .. ARGV[k] .. ' listed twice')
  elseif not f[1] then
    return refuse('BadValue', 'parent ' .. ARGV[k] .. ' not found in queue ' .. here
      .. ' (never enqueued, or expired)')
  elseif (f[1] == 'failed' or f[1] == 'killed' or f[1] == 'canceled') and not listed[k] then
    return refuse('BadValue', 'parent ' .. ARGV[k] .. ' (queue ' .. here .. ') ended ' .. f[1]
      .. ': the job would never run')
  end
  found[k], seen[ARGV[k]] = f, true
end
local out = {}
for k = 4, #ARGV do
  local id, f = ARGV[k], found[k]
  local job = p .. 'job:' .. id
  if not listed[k] then
    redis.call('HSET', job, 'children', f[2] and f[2] .. ' ' .. pair or pair)
    if f[1] == 'completed' then
      emit(p, cq, cid, {queue = here, id = id, task = f[3] or '?', state = 'completed'},
        (takes == 'result' or takes == 'results') and (f[4] or 'null') or nil)
    else
      local cross = redis.call('HGET', job, 'cross_children')
      redis.call('HSET', job, 'cross_children', (cross and cross .. ' ' or '') .. pair .. ' ' .. takes)
    end
  end
  out[#out + 1] = f[1] == 'completed' and 2 or 1
end
if #emitted > 0 then
  out[#out + 1] = emitted
end
return out
