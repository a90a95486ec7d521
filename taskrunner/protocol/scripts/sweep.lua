-- One dispatcher pass over a queue: promote due delayed jobs, list due deadlines,
-- trim the finished-job indexes (the failure indexes with them, see _lib.lua).
-- KEYS[1]  queue key prefix
-- ARGV[1]  most delayed jobs to promote   ARGV[2] most deadline buckets to read
-- ARGV[3]  result TTL (s): entries of `completed` older than this are trimmed
-- ARGV[4]  failed TTL (s): the same for `failed`, `killed` (the dead letters) and `canceled`
-- ARGV[5]  "0": promote and read deadlines only, no trim (the dispatcher trims every 10 s,
--          not every pass); absent or anything else: trim too
-- A TTL of meta longest_result_ttl / longest_failed_ttl (a task's own, see finalize()) wins
-- when it is longer: its jobs stay listed as long as their records live.
-- Every count and TTL is checked first (an error, nothing changed): a bad count used to fail
-- after the due delayed jobs were promoted.
-- Returns {promoted count, id, holding entry, id, holding entry, ...} for every job in a
-- due bucket that still runs. Ids in a due bucket that no longer run are dropped here;
-- running ones stay until the dispatcher acts on them (lose.lua / stuck.lua), so a
-- dispatcher that dies between the two calls loses nothing.
local p = KEYS[1]
local WHAT = {'most delayed jobs to promote', 'most deadline buckets to read', 'result TTL', 'failed TTL'}
for k = 1, 4 do
  local x = tonumber(ARGV[k])
  if not x or x < 1 or x ~= math.floor(x) then
    return redis.error_reply('ERR sweep: the ' .. WHAT[k] .. ' (ARGV[' .. k .. ']) must be an integer >= 1'
      .. (k > 2 and ' (seconds)' or ''))
  end
end
local t = now()
local promoted = 0
for _, id in ipairs(redis.call('ZRANGEBYSCORE', p .. 'delayed', '-inf', t, 'LIMIT', 0, tonumber(ARGV[1]))) do
  redis.call('ZREM', p .. 'delayed', id)
  local job = p .. 'job:' .. id
  local f = redis.call('HMGET', job, 'state', 'priority')
  if f[1] == 'delayed' then
    to_pending(p, id, job, false, nil, f[2])
    promoted = promoted + 1
  end
end
local out = {promoted}
for _, b in ipairs(redis.call('ZRANGEBYSCORE', p .. 'buckets', '-inf', t, 'LIMIT', 0, tonumber(ARGV[2]))) do
  local bk = p .. 'dl:' .. b
  for _, id in ipairs(redis.call('SMEMBERS', bk)) do
    local entry = redis.call('HGET', p .. 'running', id)
    if entry and redis.call('HGET', p .. 'job:' .. id, 'bucket') == b then
      out[#out + 1] = id
      out[#out + 1] = entry
    else
      redis.call('SREM', bk, id)
    end
  end
  if redis.call('SCARD', bk) == 0 then
    redis.call('ZREM', p .. 'buckets', b)
  end
end
if ARGV[5] == '0' then
  return out
end
local longest = redis.call('HMGET', p .. 'meta', 'longest_result_ttl', 'longest_failed_ttl')
local result_ttl = math.max(tonumber(ARGV[3]), tonumber(longest[1]) or 0)
local failed_ttl = math.max(tonumber(ARGV[4]), tonumber(longest[2]) or 0)
for _, state in ipairs({'completed', 'failed', 'killed', 'canceled'}) do
  local before = t - (state == 'completed' and result_ttl or failed_ttl)
  local trimmed = redis.call('ZREMRANGEBYSCORE', p .. state, '-inf', before)
  if trimmed > 0 and (state == 'failed' or state == 'killed') then
    -- The failure indexes hold the same ids with the same scores: trim those too. A pair
    -- whose index lost nothing costs one command; one left empty leaves the facets.
    local s = p .. state .. ':'
    for _, pair in ipairs(redis.call('SMEMBERS', s .. 'facets')) do
      if redis.call('ZREMRANGEBYSCORE', s .. 'te:' .. pair, '-inf', before) > 0 then
        local task, error_type = string.match(pair, '^(%S+) (.*)$')
        redis.call('ZREMRANGEBYSCORE', s .. 'task:' .. task, '-inf', before)
        redis.call('ZREMRANGEBYSCORE', s .. 'error:' .. error_type, '-inf', before)
        if redis.call('EXISTS', s .. 'te:' .. pair) == 0 then
          redis.call('SREM', s .. 'facets', pair)
        end
      end
    end
  end
end
return out
