-- Count a queue's history into its stats hash, from where the last count stopped: the jobs
-- per task and state, and histograms of run time and queue wait per task (GET /metrics).
-- Each history entry is counted once, whoever calls this and however often: the stream id
-- counted last is kept in the same hash, moved in the same call. The finish scripts do no
-- work for it; it runs when metrics are read (and before the archiver trims the stream,
-- while someone reads them), so a queue nobody scrapes pays nothing.
-- KEYS[1]  queue key prefix p
-- ARGV[1]  most records to count in this call (a whole number >= 1): entries are read in
--          pieces (10 at first, then as many as should hold the records still to count, at
--          most 100) until this many are counted (an entry holds one record or many): whole
--          entries, so a call counts at most one entry's records more
-- Sets, in p stats (HASH): cursor = the last stream id counted;
--   jobs|<task>|<state>  deliveries that ended or went back in line, by history state
--                        (completed, failed, killed, requeued), and workflow steps canceled
--                        (canceled: never ran, so in no histogram);
--   run|<task>|<i>       deliveries that ended (completed, failed, killed) whose run time
--                        (finished_at - started_at) falls in bucket i (1..#BOUNDS: <= BOUNDS[i];
--                        #BOUNDS + 1: above the last), run_sum|<task> the sum of those times;
--   wait|<task>|<i>, wait_sum|<task>  the same for the queue wait of first deliveries
--                        (attempt 1: started_at - enqueued_at).
-- An entry has a field each, or its values packed in `v` (history() in _lib.lua), or holds
-- several records in `jobs`, three lines each: id, `v`, error type (flush_history()). A task
-- name that is missing, or holds '|', is counted as '?'. Times that are missing or not
-- numbers count in jobs only.
-- Returns the number of records counted (0: none new); fewer than ARGV[1]: none left.
local p = KEYS[1]
local count = tonumber(ARGV[1])
if not count or count < 1 or count % 1 ~= 0 then
  return redis.error_reply('ERR tally: ARGV[1] must be the most records to count, a whole number >= 1')
end
local stats = p .. 'stats'
local cursor = redis.call('HGET', stats, 'cursor')
local BOUNDS = {0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300, 900, 3600}
local ENDED = {completed = true, failed = true, killed = true}
local add, sums = {}, {}
local function observe(kind, task, seconds)
  if not seconds or seconds ~= seconds or seconds < 0 or seconds == math.huge then return end
  local i = #BOUNDS + 1
  for k = 1, #BOUNDS do
    if seconds <= BOUNDS[k] then
      i = k
      break
    end
  end
  local f = kind .. '|' .. task .. '|' .. i
  add[f] = (add[f] or 0) + 1
  f = kind .. '_sum|' .. task
  sums[f] = (sums[f] or 0) + seconds
end
-- One record, its values by name.
local function count_record(v)
  if v.v then  -- the values packed in one field (entries written since 2026-11-26): the first 7 of them
    v.state, v.attempt, v.enqueued_at, v.started_at, v.finished_at, v.pid, v.task =
      string.match(v.v, '^(%S*) (%S*) (%S*) (%S*) (%S*) (%S*) (%S*)')
  end
  local task = v.task
  if not task or task == '' or string.find(task, '|', 1, true) then task = '?' end
  local state = v.state or '?'
  if string.find(state, '|', 1, true) then state = '?' end
  local f = 'jobs|' .. task .. '|' .. state
  add[f] = (add[f] or 0) + 1
  local started, finished = tonumber(v.started_at), tonumber(v.finished_at)
  if ENDED[state] and started and finished then
    observe('run', task, finished - started)
  end
  local enqueued = tonumber(v.enqueued_at)
  if v.attempt == '1' and started and enqueued then
    observe('wait', task, started - enqueued)
  end
end
local counted, read, last = 0, 0, nil
while counted < count do
  -- As many entries as should hold the records still to count, by the records per entry read
  -- so far (10 at first; at most 100): an entry may hold a finish call's hundreds.
  local want = count - counted
  local n = read > 0 and math.ceil(want * read / counted) or 10
  local entries = redis.call('XRANGE', p .. 'history', last and ('(' .. last) or cursor and ('(' .. cursor) or '-',
    '+', 'COUNT', math.max(1, math.min(100, n, want)))
  if #entries == 0 then
    break
  end
  for _, e in ipairs(entries) do
    if counted >= count then
      break
    end
    local v, fields = {}, e[2]
    for i = 1, #fields, 2 do
      v[fields[i]] = fields[i + 1]
    end
    if v.jobs then  -- a batch's records (entries written since 2026-11-27): each line 2 of 3 is a `v`
      local k = 0
      for line in string.gmatch(v.jobs .. '\n', '([^\n]*)\n') do
        k = k + 1
        if k % 3 == 2 then
          count_record({v = line})
          counted = counted + 1
        end
      end
    else
      count_record(v)
      counted = counted + 1
    end
    last = e[1]
    read = read + 1
  end
end
if not last then
  return 0
end
for f, n in pairs(add) do
  redis.call('HINCRBY', stats, f, n)
end
for f, x in pairs(sums) do
  redis.call('HINCRBYFLOAT', stats, f, x)
end
redis.call('HSET', stats, 'cursor', last)
return counted
