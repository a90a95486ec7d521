-- A worker says it is alive, with what it runs.
-- KEYS[1]  global key prefix, e.g. "tr:{_}:"
-- ARGV[1]  worker name   ARGV[2] info JSON   ARGV[3] seconds to keep the info
-- Sets workers (ZSET name -> server time of last beat) and worker:<name> (STRING info);
-- takes the name off workers:dead if the dispatcher had buried it (a paused worker
-- that came back). Returns the server time.
local g = KEYS[1]
local t = now()
redis.call('ZADD', g .. 'workers', t, ARGV[1])
redis.call('SET', g .. 'worker:' .. ARGV[1], ARGV[2], 'EX', tonumber(ARGV[3]))
redis.call('ZREM', g .. 'workers:dead', ARGV[1])
return fmt(t)
