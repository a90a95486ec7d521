-- The process running a delivery is gone (its worker's heartbeat expired, its PID is
-- dead, or its worker found it orphaned): requeue it at the front, or end it as killed
-- (kill requested) or failed WorkerLost (lost max_lost times). Fenced by delivery. A job
-- that ends here settles its children (_lib.lua: canceled; those in other slots by an
-- outbox entry, carried by the dispatcher).
-- KEYS[1]  queue key prefix
-- ARGV[1]  failed TTL (s): how long a job that ends killed or failed here is kept (the
--          setting; the record's own failed_ttl wins); then per job: id, attempt, reason,
--          owner ("" = any worker)
-- Returns per job: the new state, or "" when the delivery is not (or no longer) held
-- by that owner.
local p = KEYS[1]
local ttl = tonumber(ARGV[1])
local t = now()
local out = {}
for i = 2, #ARGV, 4 do
  local id, attempt, reason, owner = ARGV[i], ARGV[i + 1], ARGV[i + 2], ARGV[i + 3]
  local job = p .. 'job:' .. id
  local r = load(job)
  local result = ''
  if holder_check(p, id, r[ATTEMPTS], attempt) == 1 and (owner == '' or r[WORKER] == owner) then
    result = lose(p, id, job, r, attempt, t, ttl, reason)
  end
  out[#out + 1] = result
end
return out
