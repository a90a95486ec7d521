-- The process running a delivery is gone (its worker's heartbeat expired, its PID is
-- dead, or its worker found it orphaned): requeue it at the front, or end it as killed
-- (kill requested) or failed WorkerLost (lost max_lost times). Fenced by delivery. A job
-- that ends here settles its children (_lib.lua: canceled; those in other slots by an
-- outbox entry, carried by the dispatcher).
-- KEYS[1]  queue key prefix
-- ARGV[1]  failed TTL (s): how long a job that ends killed or failed here is kept (the
--          setting; the record's own failed_ttl wins); then per job: id, attempt, reason,
--          owner ("" = any worker), began: "1" when the delivery may have begun (it counts
--          towards max_lost), "0" when it had not (sent ahead to a process behind the job
--          that process ran: requeued all the same, not counted; the caller decides, from
--          the holding entries: docs/PROTOCOL.md, Lose)
-- Returns per job: the new state, or "" when the delivery is not (or no longer) held
-- by that owner. Bad arguments are refused (ERR lose: ...) before any job is touched.
local p = KEYS[1]
local ttl = tonumber(ARGV[1])
if not ttl or ttl < 1 or ttl % 1 ~= 0 then
  return redis.error_reply('ERR lose: the failed TTL (ARGV[1]) must be an integer >= 1 (seconds)')
end
if (#ARGV - 1) % 5 ~= 0 then
  return redis.error_reply('ERR lose: ARGV is the failed TTL, then 5 values per job (id, attempt, reason, owner, '
    .. 'began); got ' .. #ARGV .. ' values')
end
for i = 6, #ARGV, 5 do
  if ARGV[i] ~= '1' and ARGV[i] ~= '0' then
    return redis.error_reply('ERR lose: began (ARGV[' .. i .. ']) must be "1" (it may have begun) or "0" '
      .. '(it had not)')
  end
end
local t = now()
local out = {}
for i = 2, #ARGV, 5 do
  local id, attempt, reason, owner = ARGV[i], ARGV[i + 1], ARGV[i + 2], ARGV[i + 3]
  local job = p .. 'job:' .. id
  local r = load(job)
  local result = ''
  if holder_check(p, id, r[ATTEMPTS], attempt) == 1 and (owner == '' or r[WORKER] == owner) then
    result = lose(p, id, job, r, attempt, t, ttl, reason, false, nil, ARGV[i + 4] == '0')
  end
  out[#out + 1] = result
end
return out
