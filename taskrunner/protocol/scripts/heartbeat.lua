-- A worker (or any consumer holding jobs) says it is alive, with what it runs.
-- KEYS[1]  global key prefix, e.g. "tr:{_}:"
-- ARGV[1]  worker name   ARGV[2] info JSON   ARGV[3] seconds to keep the info (integer >= 1)
-- Sets workers (ZSET name -> server time of last beat) and worker:<name> (STRING info);
-- takes the name off workers:dead if the dispatcher had buried it (a paused worker
-- that came back). Returns the server time.
-- The info must be a JSON object with "name" = ARGV[1], "host" a non-empty string and "pid"
-- an integer from 1 to 2^31 - 1 (the consumer's own process id); "pidns" and "boot_id", by which a dispatcher
-- on the same machine checks that PID, are strings when present. Anything else is refused
-- with an error, nothing changed, so that a consumer learns at its first beat what the
-- dispatcher could not read (docs/PROTOCOL.md, Heartbeat).
local g = KEYS[1]
local function refuse(why)
  return redis.error_reply('ERR heartbeat: ' .. why)
end
if not is_name(ARGV[1]) then
  return refuse('invalid worker name (ARGV[1]): use 1-200 of A-Z a-z 0-9 _.:@-, starting with a letter or digit')
end
local ok, info = pcall(cjson.decode, ARGV[2])
if not ok or type(info) ~= 'table' or info[1] ~= nil then
  return refuse('the info (ARGV[2]) must be a JSON object')
end
if info.name ~= ARGV[1] then
  return refuse('info "name" must be the worker name (ARGV[1])')
end
if type(info.host) ~= 'string' or info.host == '' then
  return refuse('info "host" must be a non-empty string')
end
local pid = info.pid
if type(pid) ~= 'number' or pid ~= math.floor(pid) or pid < 1 or pid >= 2 ^ 31 then
  return refuse('info "pid" must be an integer from 1 to 2^31 - 1 (the process id)')
end
for _, f in ipairs({'pidns', 'boot_id'}) do
  if info[f] ~= nil and type(info[f]) ~= 'string' then
    return refuse('info "' .. f .. '" must be a string, or absent')
  end
end
local ttl = tonumber(ARGV[3])
if not ttl or ttl < 1 or ttl ~= math.floor(ttl) then
  return refuse('the info TTL (ARGV[3]) must be an integer >= 1 (seconds)')
end
local t = now()
redis.call('ZADD', g .. 'workers', t, ARGV[1])
redis.call('SET', g .. 'worker:' .. ARGV[1], ARGV[2], 'EX', ttl)
redis.call('ZREM', g .. 'workers:dead', ARGV[1])
return fmt(t)
