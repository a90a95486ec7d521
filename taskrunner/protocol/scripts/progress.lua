-- Record running jobs' progress and log lines, many jobs in one call: a worker batches what
-- its children reported since its last sync (docs/PROTOCOL.md, Progress and logs).
-- KEYS[1]  queue key prefix
-- ARGV[1]  log lines kept per job, an integer 1..10000 (the oldest go first)
-- then 6 values per job:
--   id
--   attempt   the delivery's fencing token (the record's attempts when it was claimed)
--   progress  "" (unchanged) or a number 0..1
--   note      text kept with the progress (ignored when progress is "")
--   lines     "" or new log lines, joined by "\n", each a JSON array [time, attempt, text]
--   dropped   lines the caller dropped already (it keeps at most the cap per job), >= 0
-- Record fields written: progress, progress_note, progress_at (server time); logs (the kept
-- lines, "\n"-joined, oldest first); logs_dropped (how many lines the cap dropped). They live
-- in the record, so they expire and are deleted with it.
-- A delivery that no longer holds the job (requeued, killed, ended) changes nothing.
-- Returns one integer per job: 1 recorded, 0 fenced off (another delivery holds the job),
-- 2 this delivery is no longer running. Bad arguments are refused (an error, nothing changed).
local p = KEYS[1]
local cap = tonumber(ARGV[1])
if not cap or cap < 1 or cap > 10000 or cap ~= math.floor(cap) or (#ARGV - 1) % 6 ~= 0 then
  return redis.error_reply('ERR taskrunner: BadCall: progress: ARGV is the lines kept per job (1..10000), then 6 '
    .. 'values per job (id, attempt, progress, note, lines, dropped); got ' .. #ARGV .. ' values')
end
for i = 2, #ARGV, 6 do
  local progress = ARGV[i + 2]
  if progress ~= '' then
    local x = amount(progress, nil)
    if not x or x > 1 then
      return redis.error_reply('ERR taskrunner: BadValue: progress: ARGV[' .. i + 2 .. '] must be "" or a number '
        .. 'from 0 to 1')
    end
  end
  local dropped = tonumber(ARGV[i + 5])
  if not dropped or dropped < 0 or dropped ~= math.floor(dropped) then
    return redis.error_reply('ERR taskrunner: BadValue: progress: ARGV[' .. i + 5 .. '] (dropped) must be an '
      .. 'integer >= 0')
  end
  local lines = ARGV[i + 4]
  if lines ~= '' then
    for line in string.gmatch(lines, '[^\n]+') do
      local ok, v = pcall(cjson.decode, line)
      if not ok or type(v) ~= 'table' or #v ~= 3 or type(v[3]) ~= 'string' then
        return redis.error_reply('ERR taskrunner: BadValue: progress: ARGV[' .. i + 4 .. '] holds a line that is '
          .. 'not a JSON array [time, attempt, text]')
      end
    end
  end
end
local t = now()
local out = {}
for i = 2, #ARGV, 6 do
  local id, attempt, progress, note, lines = ARGV[i], ARGV[i + 1], ARGV[i + 2], ARGV[i + 3], ARGV[i + 4]
  local job = p .. 'job:' .. id
  local v = redis.call('HMGET', job, 'attempts', 'logs', 'logs_dropped')
  local ok = holder_check(p, id, v[1], attempt, false)
  out[#out + 1] = ok
  if ok == 1 then
    local fields = {}
    if progress ~= '' then
      fields = {'progress', progress, 'progress_note', note, 'progress_at', fmt(t)}
    end
    if lines ~= '' then
      local kept = {}
      for line in string.gmatch((v[2] or '') .. '\n' .. lines, '[^\n]+') do
        kept[#kept + 1] = line
      end
      local over = math.max(0, #kept - cap)
      fields[#fields + 1], fields[#fields + 2] = 'logs', table.concat(kept, '\n', over + 1)
      local dropped = over + tonumber(ARGV[i + 5])
      if dropped > 0 then
        fields[#fields + 1], fields[#fields + 2] = 'logs_dropped', (tonumber(v[3]) or 0) + dropped
      end
    end
    if #fields > 0 then
      redis.call('HSET', job, unpack(fields))
    end
  end
end
return out
