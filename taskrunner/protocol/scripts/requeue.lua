-- Put a job back in line now (an operator's requeue). Delayed: due now. Running: released
-- and pending next in line (its worker finds out at its next heartbeat and stops it; a
-- late finish from it is fenced off); no loss is counted.
-- KEYS[1]  queue key prefix
-- ARGV[1]  id   ARGV[2] who asked
-- ARGV[3]  (optional) the states it may requeue, space-separated: "delayed" is the dashboard's
--          "Enqueue now" (a job the dispatcher promoted meanwhile, or a worker claimed, is left
--          as it is); default "delayed running"
-- Returns the state before ("" when there is no such job); only delayed and running change,
-- and only those ARGV[3] lists (another is refused: nothing changed).
-- The job's timeline (an action:<time> field) says what it did: "enqueued now by <who>" for
-- a delayed job (it was not in line: its due time is now), "requeued by <who>" for a running one.
local p = KEYS[1]
local id = ARGV[1]
local may = {delayed = true, running = true}
if ARGV[3] then
  may = {}
  for w in string.gmatch(ARGV[3], '%S+') do
    if w ~= 'delayed' and w ~= 'running' then
      return redis.error_reply('ERR taskrunner: BadCall: requeue: ARGV[3] lists the states it may requeue (delayed, '
        .. 'running, space-separated); got ' .. string.format('%q', string.sub(w, 1, 50)))
    end
    may[w] = true
  end
  if next(may) == nil then  -- an empty list would requeue nothing, silently
    return redis.error_reply('ERR taskrunner: BadCall: requeue: ARGV[3] lists no state (delayed, running)')
  end
end
local job = p .. 'job:' .. id
local f = redis.call('HMGET', job, 'state', 'priority')
local state = f[1]
if not may[state] then
  return state or ''
end
local t = now()
local action = {'action:' .. fmt(t), (state == 'delayed' and 'enqueued now by ' or 'requeued by ') .. ARGV[2]}
if state == 'delayed' then
  redis.call('ZREM', p .. 'delayed', id)
  to_pending(p, id, job, true, action, f[2])
elseif state == 'running' then
  local r = load(job)
  release(p, id, r)
  redis.call('HINCRBY', job, 'requeues', 1)
  history(p, id, r, 'requeued', t, nil)
  local attempt = r[ATTEMPTS]
  local ek, ev = ended(attempt, t, 'requeued by ' .. ARGV[2])
  action[3], action[4], action[5], action[6] = ek, ev, 'last_requeued_at', fmt(t)
  to_pending(p, id, job, true, action, r[PRIORITY])
end
return state or ''
