-- Apply outbox entries in the slot of their children (docs/PROTOCOL.md, Workflows: a Redis
-- Cluster). Each entry tells a waiting child that a parent of it in another slot ended; the
-- parent's script left it in the outbox of the parent's queue, in the same call that ended
-- the parent. Idempotent: the child keeps the parents it counted in <p>joined:<id>, so an
-- entry applied twice (a carrier that died before deleting it, two carriers at once) counts
-- once.
-- KEYS[1]  the children's queue key prefix "<P>:{<Q>}:"
-- ARGV[1]  failed TTL (s): kept this long, the record of a child canceled here (the setting;
--          the record's own failed_ttl wins) and <p>joined:<id> after its last change
-- then 8 values per entry, its outbox entry's fields ("" for one it has not): child (its id:
-- the child's queue must be Q), parent ("<queue> <id>"), task, state, result, error_type,
-- error, canceled_by
-- Per entry, with `news` = the JSON object of its task, state and the other fields it has:
--   the child is waiting, has cross_slot 1, lists the parent in its `parents` and the
--     parent's queue is not Q: HSETNX
--     <p>joined:<child> <parent> <news>; set before: answer 0 (counted already). Else EXPIRE
--     it, and the child counts the parent as when a parent of its own slot ends (_lib.lua
--     settle(): waiting_on - 1, or pending with what it takes, the results of a chord's
--     members in other slots read from that hash; or canceled, with its children in turn,
--     those in other slots by entries in this queue's outbox): answer 1
--   there is no such job (its producer writes it after its parents): HSETNX as above and
--     EXPIRE: enqueue.lua applies it when the child is enqueued: answer 2
--   otherwise (it no longer waits; not a cross-slot child of that parent; its `parents` do
--     not list that parent: a job of the child's id written before, with other parents): answer 0
-- Returns one integer per entry; then, only when children canceled here have children in
-- other slots, the entries this call left in the outbox, as XRANGE gives them.
local p = KEYS[1]
workflows()
local function refuse(message)
  return redis.error_reply('ERR taskrunner: BadCall: join: ' .. message)
end
local here = queue_of(p)
if not here or not is_queue(here) then
  return refuse('KEYS[1] must be a queue key prefix "<prefix>:{<queue>}:"')
end
local ttl = tonumber(ARGV[1])
if not ttl or ttl < 1 or ttl % 1 ~= 0 or (#ARGV - 1) % 8 ~= 0 then
  return refuse('ARGV is the failed TTL (whole seconds >= 1), then 8 values per entry (child, parent, task, state, '
    .. 'result, error_type, error, canceled_by); got ' .. #ARGV .. ' values')
end
local STATES = {completed = true, failed = true, killed = true, canceled = true, deleted = true}
local NEWS = {'result', 'error_type', 'error', 'canceled_by'}
for i = 2, #ARGV, 8 do
  local q, pid = string.match(ARGV[i + 1], '^(%S+) (%S+)$')
  if not string.find(ARGV[i], '^[A-Za-z0-9_.:@%-]+$') or #ARGV[i] > 200 or not q or not is_queue(q) then
    return refuse('entry ' .. (i + 6) / 8 .. ': child must be a job id and parent "<queue> <id>"')
  elseif not STATES[ARGV[i + 3]] then
    return refuse('entry ' .. (i + 6) / 8 .. ': state must be completed, failed, killed, canceled or deleted')
  end
end
-- Does `job` list `name` ("<queue> <id>") among its `parents` ("<queue> <id> <queue> <id>
-- ...")? A job with the child's id may exist already, written with other parents (the
-- producer names a child in another slot before it writes it, and a job with that id is
-- enqueued once): news of a parent it does not list must not count for it. A plain find,
-- at a pair's start (an even number of spaces before it): one pass over the field.
local function lists_parent(job, name)
  local parents = redis.call('HGET', job, 'parents') or ''
  local from = 1
  while true do
    local s, e = string.find(parents, name, from, true)
    if not s then
      return false
    end
    if (s == 1 or string.byte(parents, s - 1) == 32) and (e == #parents or string.byte(parents, e + 1) == 32)
        and select(2, string.gsub(string.sub(parents, 1, s - 1), ' ', '')) % 2 == 0 then
      return true
    end
    from = s + 1
  end
end

local t = now()
local out = {}
for i = 2, #ARGV, 8 do
  local id, name = ARGV[i], ARGV[i + 1]
  local job, joined = p .. 'job:' .. id, p .. 'joined:' .. id
  local e = {task = ARGV[i + 2], state = ARGV[i + 3]}
  for k, field in ipairs(NEWS) do
    if ARGV[i + 3 + k] ~= '' then e[field] = ARGV[i + 3 + k] end
  end
  local c = redis.call('HMGET', job, unpack(CHILD))
  local q = string.match(name, '^(%S+) ')
  if not c[1] then
    redis.call('HSETNX', joined, name, cjson.encode(e))
    redis.call('EXPIRE', joined, ttl)
    out[#out + 1] = 2
  elseif c[1] ~= 'waiting' or c[6] ~= '1' or q == here or not lists_parent(job, name)
      or redis.call('HSETNX', joined, name, cjson.encode(e)) == 0 then
    out[#out + 1] = 0
  else
    redis.call('EXPIRE', joined, ttl)
    settle(p, id, far_parent(name, e), c, t, ttl)
    out[#out + 1] = 1
  end
end
if #emitted > 0 then
  out[#out + 1] = emitted
end
return out
