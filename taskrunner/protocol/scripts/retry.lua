-- Run a failed or killed job again (an operator's retry): it becomes pending, at the back,
-- with its counts of failures, losses and Retry requests back to 0. A unique job takes its
-- lock again (for its unique_for) unless another job holds it now. In a workflow (see
-- docs/PROTOCOL.md, Workflows) it also brings back the steps its end canceled: each step
-- whose `canceled_by` names it (those after it, transitively) waits again (state waiting,
-- `waiting_on` counted afresh from its parents' states), unless another of its parents
-- ended so that it cannot run: then it stays canceled and names that parent (a retry of that
-- one brings it back). The steps that counted it as done (on_parent_failure continue) count
-- it again. A step that never joined (killed while it waited) waits again for its parents.
-- KEYS[1]  queue key prefix
-- It leaves the failure indexes of its state too (see _lib.lua). A job whose `expires` has
-- passed (every one that ended Expired) loses it, and `opt` its name: else it would expire
-- again at its claim (docs/PROTOCOL.md, Expiry).
-- ARGV[1]  id   ARGV[2] who asked
-- ARGV[3]  (optional) "1": steps in other queues may be touched (one Redis server); else
--          only this queue's (a Redis Cluster: a step with a parent or child in another
--          queue is left as it is)
-- Returns the state before ("" when there is no such job: its record expired, and its id
-- leaves p failed, p killed and their failure indexes, see forget_gone in _lib.lua); only
-- failed and killed change.
-- Refused (nothing changed): a step that never joined whose parents ended so that it
-- cannot run ("ERR retry: ...").
local p = KEYS[1]
local id = ARGV[1]
workflows()
local job = p .. 'job:' .. id
local r = redis.call('HMGET', job, 'state', 'children', 'parents', 'waiting_on', 'on_parent_failure', 'takes',
  'args', 'task', 'priority', 'unique_key', 'unique_for', 'error_type', 'expires', 'opt')
local state = r[1]
if not state then
  forget_gone(p, id, {'failed', 'killed'})
  return ''
end
if state ~= 'failed' and state ~= 'killed' then
  return state
end
local t = now()
local here = string.match(p, '{([^{}]*)}:$')
local me = here .. ' ' .. id
local anywhere = ARGV[3] == '1'

-- The states of the steps read, by "<queue> <id>" (false: no record).
local states = {}
local function state_of(name)
  if states[name] == nil then
    local q, i = string.match(name, '^(%S+) (%S+)$')
    states[name] = redis.call('HGET', sibling(p, q) .. 'job:' .. i, 'state') or false
  end
  return states[name]
end

local ENDED = {completed = true, failed = true, killed = true, canceled = true}
-- How a step with edge `kind` (its on_parent_failure) sees a parent in state `s`: 'open' (it
-- may still complete), 'done' (counted), 'blocked' (the step can no longer run). A parent
-- whose record is gone counts as completed (it expired after its result TTL, most likely).
local function edge(kind, s)
  if s and not ENDED[s] then
    return 'open'
  end
  if s == 'completed' or not s then
    return kind == 'only' and 'blocked' or 'done'
  end
  return (kind == 'continue' or kind == 'only') and 'done' or 'blocked'
end

-- Are all these "<queue> <id> ..." in queues this call may touch?
local function reachable(list)
  if anywhere then
    return true
  end
  for q in string.gmatch(list or '', '(%S+) %S+') do
    if q ~= here then
      return false
    end
  end
  return true
end

-- A step that never joined: it waits again, or runs if its parents are done.
local open = 0
if r[3] and (tonumber(r[4]) or 0) > 0 then
  if not reachable(r[3]) then
    return redis.error_reply('ERR retry: job ' .. id .. ' waits for steps in other queues (a Redis Cluster)')
  end
  for q, i in string.gmatch(r[3], '(%S+) (%S+)') do
    local how = edge(r[5], state_of(q .. ' ' .. i))
    if how == 'blocked' then
      return redis.error_reply('ERR retry: job ' .. id .. ' waits for step ' .. i .. ', which is ' ..
        (state_of(q .. ' ' .. i) or 'gone') .. ': it could never run (retry that step)')
    end
    if how == 'open' then
      open = open + 1
    end
  end
end

redis.call('ZREM', p .. state, id)
unindex_failure(p, state, id, r[8], r[12])
redis.call('PERSIST', job)
redis.call('HDEL', job, 'kill_requested', 'finished_at', 'result', 'stuck', 'stuck_at')
redis.call('HSET', job, 'failures', '0', 'lost', '0', 'retry_requests', '0')  -- a fresh budget
if r[13] and not (tonumber(r[13]) and tonumber(r[13]) > t) then  -- its expiry passed: the retry runs it
  redis.call('HDEL', job, 'expires')
  if r[14] then  -- (a record without `opt` has its optional fields read by name)
    local names = {}
    for name in string.gmatch(r[14], '%S+') do
      if name ~= 'expires' then names[#names + 1] = name end
    end
    redis.call('HSET', job, 'opt', table.concat(names, ' '))
  end
end
local action = {'action:' .. fmt(t), 'retried by ' .. ARGV[2]}
if r[10] then  -- a unique job (never a workflow's step): its lock again, unless another holds it
  if r[11] then
    redis.call('SET', p .. 'unique:' .. r[10], id, 'NX', 'EX', r[11])
  else
    redis.call('SET', p .. 'unique:' .. r[10], id, 'NX')
  end
end
if r[3] and (tonumber(r[4]) or 0) > 0 then
  states[me] = 'waiting'
  redis.call('HSET', job, 'state', 'waiting', 'waiting_on', open > 0 and open or 1, unpack(action))
  redis.call('ZADD', p .. 'waiting', t, id)
  if open == 0 then  -- all done: as the join makes it pending, with what it takes from them
    local q, i = string.match(r[3], '(%S+) (%S+)$')
    local pjob = sibling(p, q) .. 'job:' .. i
    local pr = redis.call('HMGET', pjob, 'task', 'state', 'error_type', 'error')
    join(p, id, job, {queue = q, id = i, task = pr[1] or '?', state = pr[2] or 'gone', job = pjob,
      error_type = pr[3] or nil, error = pr[4] or nil}, {'waiting', r[5], r[6], r[7], '1', false, r[9]})
  end
else
  to_pending(p, id, job, false, action, r[9])
end
if not r[2] then
  return state
end

-- The steps its end canceled, each once, parents before children where the graph allows
-- (breadth first from it): name -> {prefix, id, job, kind, parents}.
local steps, order = {}, {}
local frontier = {r[2]}  -- lists of children, "<queue> <id> ..."
while #frontier > 0 do
  local next_frontier = {}
  for _, children in ipairs(frontier) do
    for q, cid in string.gmatch(children or '', '(%S+) (%S+)') do
      local name = q .. ' ' .. cid
      if not steps[name] and (anywhere or q == here) then
        local cp = sibling(p, q)
        local cjob = cp .. 'job:' .. cid
        local c = redis.call('HMGET', cjob, 'state', 'canceled_by', 'on_parent_failure', 'parents', 'children')
        if c[1] == 'canceled' and c[2] == me and c[3] ~= 'only' and reachable(c[4]) then
          steps[name] = {cp, cid, cjob, c[3], c[4]}
          order[#order + 1] = name
          next_frontier[#next_frontier + 1] = c[5]
        end
      end
    end
  end
  frontier = next_frontier
end

-- Which come back: all but those with a parent that blocks them (ended otherwise, and not
-- coming back itself); repeated until nothing changes (a parent found blocked blocks its
-- children in turn).
local back, blocker = {}, {}
for _, name in ipairs(order) do
  back[name] = true
end
local changed = true
while changed do
  changed = false
  for _, name in ipairs(order) do
    if back[name] then
      local s = steps[name]
      for q, i in string.gmatch(s[5] or '', '(%S+) (%S+)') do
        local pname = q .. ' ' .. i
        if pname ~= me and not back[pname] and edge(s[4], state_of(pname)) == 'blocked' then
          back[name], blocker[name], changed = false, pname, true
          break
        end
      end
    end
  end
end

-- Who a step that stays canceled names now: its blocking parent, as settle_children() names
-- a failed step (or the step that one names, when it was canceled too).
local blamed = {}
local function blame(name)
  if blamed[name] then
    return blamed[name][1], blamed[name][2]
  end
  local pname = blocker[name]
  local by, why
  if steps[pname] then
    by, why = blame(pname)
  else
    local q, i = string.match(pname, '^(%S+) (%S+)$')
    local e = redis.call('HMGET', sibling(p, q) .. 'job:' .. i, 'state', 'task', 'error_type', 'error', 'canceled_by')
    if e[1] == 'canceled' then
      by, why = e[5] or pname, e[4] or ''
    else
      by = pname
      why = string.format('step %s (task %s) %s: %s: %s', i, e[2] or '?', e[1] or 'gone', e[3] or '?',
        string.sub(e[4] or '', 1, 200))
    end
  end
  blamed[name] = {by, why}
  return by, why
end

-- Steps that come back (and the job itself) are no longer done for the steps that counted
-- them so (on_parent_failure continue, still waiting).
local function uncount(children)
  for q, cid in string.gmatch(children or '', '(%S+) (%S+)') do
    if anywhere or q == here then
      local cjob = sibling(p, q) .. 'job:' .. cid
      local c = redis.call('HMGET', cjob, 'state', 'on_parent_failure')
      if c[1] == 'waiting' and c[2] == 'continue' then
        redis.call('HINCRBY', cjob, 'waiting_on', 1)
      end
    end
  end
end
uncount(r[2])

local note = 'brought back: step ' .. id .. ' retried by ' .. ARGV[2]
for _, name in ipairs(order) do
  local s = steps[name]
  local cp, cid, cjob = s[1], s[2], s[3]
  if back[name] then
    local n = 0
    for q, i in string.gmatch(s[5] or '', '(%S+) (%S+)') do
      local pname = q .. ' ' .. i
      if pname == me or back[pname] or edge(s[4], state_of(pname)) == 'open' then
        n = n + 1
      end
    end
    local c = redis.call('HMGET', cjob, 'enqueued_at', 'children')
    redis.call('ZREM', cp .. 'canceled', cid)
    redis.call('PERSIST', cjob)
    redis.call('HDEL', cjob, 'canceled_by', 'error_type', 'error', 'finished_at')
    redis.call('HSET', cjob, 'state', 'waiting', 'waiting_on', n, 'action:' .. fmt(t), note)
    redis.call('ZADD', cp .. 'waiting', tonumber(c[1]) or t, cid)
    uncount(c[2])
  else
    local by, why = blame(name)
    redis.call('HSET', cjob, 'canceled_by', by, 'error', why)
  end
end
return state
