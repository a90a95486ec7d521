-- Add jobs to one queue, all in one call. Every job is checked before any is written: a
-- call with one bad job changes nothing and answers an error (below).
-- KEYS[1]  queue key prefix "<P>:{<Q>}:"; Q must be a valid queue name
-- KEYS[2]  optional, never on a Redis Cluster (another slot): the global queue set
--          "<P>:{_}:queues"; Q is added to it (the dispatcher sweeps the queues listed there)
-- ARGV[1]  number of jobs N; then per job: id, delay (s, 0 = now), K, then K field/value
--          pairs; then, optionally, the payload limit in bytes (default 1048576)
-- Fields a producer may send (any other is refused): task (required), queue (if sent, Q),
-- args (JSON array, default []), kwargs (JSON object, default {}), max_duration (s > 0),
-- retries (0 to 2^31-1), retry_backoff (s >= 0), timeout_policy (kill|flag), max_lost
-- (1 to 2^31-1), producer (text). Those of max_duration, retries, retry_backoff,
-- timeout_policy and max_lost a producer did not send come from the task's declaration,
-- <p>tasks[task] (JSON, written by workers), when there is one; numbers are written back
-- in plain decimal notation.
-- Returns one integer per job: 1 added, 0 an id that already exists (nothing changed),
-- -1 the queue is full (its bound is reached; delayed jobs do not count), -2 it is closed.
-- Errors: "ERR taskrunner: <Kind>: <message>", Kind one of InvalidName, NotJSON,
-- PayloadTooLarge, BadValue, BadCall.
-- Sets: job:<id> (fields + state, enqueued_at), then pending+items (+wake) or delayed;
-- meta produced_messages/produced_bytes (bytes = length of args + kwargs).
local p = KEYS[1]
local WHOLE_MAX = 2147483647
local SECONDS_MAX = 9007199254740992  -- 2^53: whole seconds up to here are exact doubles

local function refuse(kind, message)
  return redis.error_reply('ERR taskrunner: ' .. kind .. ': ' .. message)
end

local function is_name(s)
  return #s <= 200 and string.find(s, '^[A-Za-z0-9][A-Za-z0-9_.:@%-]*$') ~= nil
end

-- A number as plain decimal text, as every reader parses it (the claim reads max_duration
-- only in this form): whole numbers without a point, others with the fewest digits that
-- give the same double, never an exponent (below 0.0001: to the microsecond).
local function decimal(x)
  if x == math.floor(x) then
    return string.format('%d', x)
  end
  if x < 0.0001 then
    local s = string.gsub(string.format('%.6f', x), '%.?0+$', '')
    return s
  end
  local s = string.format('%.15g', x)
  if tonumber(s) ~= x then
    s = string.format('%.17g', x)
  end
  return s
end

-- The checks of the numeric and policy fields: text (or a number from a declaration) to
-- the text to store, or nil when the value is not acceptable.
local function seconds(v, positive)
  local x = tonumber(v)
  if not x or x ~= x or x < 0 or x >= SECONDS_MAX then return nil end
  local s = decimal(x)
  if positive and tonumber(s) <= 0 then return nil end
  return s
end
local CHECK = {
  max_duration = function(v) return seconds(v, true) end,
  retry_backoff = function(v) return seconds(v, false) end,
  retries = function(v)
    local x = tonumber(v)
    if x and x == math.floor(x) and x >= 0 and x <= WHOLE_MAX then return string.format('%d', x) end
  end,
  max_lost = function(v)
    local x = tonumber(v)
    if x and x == math.floor(x) and x >= 1 and x <= WHOLE_MAX then return string.format('%d', x) end
  end,
  timeout_policy = function(v)
    if v == 'kill' or v == 'flag' then return v end
  end,
}
local RULE = {max_duration = 'a number of seconds > 0 and < 2^53', retry_backoff = 'a number of seconds >= 0 and < 2^53',
  retries = 'a whole number from 0 to 2147483647', max_lost = 'a whole number from 1 to 2147483647',
  timeout_policy = 'kill or flag'}
local DECLARED = {'max_duration', 'retries', 'retry_backoff', 'timeout_policy', 'max_lost'}
local OTHER = {task = true, queue = true, args = true, kwargs = true, producer = true}

local json = cjson.new()
json.decode_invalid_numbers(false)  -- NaN, Infinity, hex, leading zeros: not JSON

-- Every number of a decoded value is finite (1e999 parses, as infinity, which no JSON
-- reader gives back).
local function finite(v)
  if type(v) == 'number' then
    return v == v and v ~= math.huge and v ~= -math.huge
  elseif type(v) == 'table' then
    for _, x in pairs(v) do
      if not finite(x) then return false end
    end
  end
  return true
end

-- args (opening '[') or kwargs ('{'): nil when it is JSON of that kind, else why not.
local function bad_json(v, opening)
  if string.match(v, '^%s*(.)') ~= opening then
    return opening == '[' and 'is not a JSON array' or 'is not a JSON object'
  end
  local ok, decoded = pcall(json.decode, v)
  if not ok then
    return 'is not JSON (' .. tostring(decoded) .. ')'
  end
  if string.find(v, '[eE]%+?%d%d%d') and not finite(decoded) then
    return 'holds a number too large for a double'
  end
end

local queue = string.match(p, '{([^{}]*)}:$')
if not queue or not is_name(queue) then
  return refuse('InvalidName', 'KEYS[1] must be "<prefix>:{<queue>}:" with a queue name of letters, digits and '
    .. '_.:@- (at most 200, starting with a letter or digit), not ' .. string.format('%q', string.sub(p, 1, 250)))
end
local registry = KEYS[2]
if registry and registry ~= string.sub(p, 1, #p - #queue - 3) .. '{_}:queues' then
  return refuse('BadCall', 'KEYS[2] must be the global queue set "<prefix>:{_}:queues" of KEYS[1]\'s prefix')
end
local n_jobs = tonumber(ARGV[1])
if not n_jobs or n_jobs < 0 or n_jobs ~= math.floor(n_jobs) then
  return refuse('BadCall', 'ARGV[1] must be the number of jobs')
end
local limit = 1048576

-- Pass 1: check every job, and build what each one writes.
local declarations = {}  -- task -> its declaration (false: none), read once per call
local jobs = {}
local i = 2
for n = 1, n_jobs do
  local id, delay_s, k = ARGV[i], ARGV[i + 1], tonumber(ARGV[i + 2])
  if not k or k < 0 or k ~= math.floor(k) or i + 2 + 2 * k > #ARGV then
    return refuse('BadCall', 'job ' .. n .. ': expected id, delay, K and K field/value pairs')
  end
  if #id > 200 or not string.find(id, '^[A-Za-z0-9_.:@%-]+$') then
    return refuse('InvalidName', 'job ' .. n .. ': invalid job id ' .. string.format('%q', string.sub(id, 1, 250))
      .. ': use 1-200 letters, digits and _.:@-')
  end
  local what = 'job ' .. id .. ': '
  local delay = tonumber(delay_s)
  if not delay or delay ~= delay or delay < 0 or delay >= SECONDS_MAX then
    return refuse('BadValue', what .. 'delay must be a number of seconds >= 0 and < 2^53')
  end
  local f = {}
  for a = i + 3, i + 1 + 2 * k, 2 do
    local name, value = ARGV[a], ARGV[a + 1]
    if f[name] then
      return refuse('BadCall', what .. 'field ' .. name .. ' given twice')
    elseif CHECK[name] then
      local v = CHECK[name](value)
      if not v then
        return refuse('BadValue', what .. name .. ' must be ' .. RULE[name] .. ', not '
          .. string.format('%q', string.sub(value, 1, 50)))
      end
      f[name] = v
    elseif OTHER[name] then
      f[name] = value
    else
      return refuse('BadCall', what .. 'unknown field ' .. string.format('%q', string.sub(name, 1, 50)))
    end
  end
  if not f.task then
    return refuse('BadCall', what .. 'the task field is required')
  elseif not is_name(f.task) then
    return refuse('InvalidName', what .. 'invalid task name ' .. string.format('%q', string.sub(f.task, 1, 250))
      .. ': use letters, digits and _.:@- (at most 200, starting with a letter or digit)')
  elseif f.queue and f.queue ~= queue then
    return refuse('BadValue', what .. 'field queue is ' .. string.format('%q', string.sub(f.queue, 1, 250))
      .. ' but KEYS[1] is queue ' .. queue)
  end
  for _, kind in ipairs({'args', 'kwargs'}) do
    if f[kind] then
      local why = bad_json(f[kind], kind == 'args' and '[' or '{')
      if why then
        return refuse('NotJSON', what .. kind .. ' ' .. why)
      end
    end
  end
  local args, kwargs = f.args or '[]', f.kwargs or '{}'
  local decl = declarations[f.task]
  if decl == nil then
    local raw = redis.call('HGET', p .. 'tasks', f.task)
    decl = false
    if raw then
      local ok, d = pcall(cjson.decode, raw)
      if not ok or type(d) ~= 'table' then
        return refuse('BadValue', 'the declaration of task ' .. f.task .. ' in ' .. p .. 'tasks is not a JSON object')
      end
      decl = d
    end
    declarations[f.task] = decl
  end
  local record = {'id', id, 'task', f.task, 'queue', queue, 'args', args, 'kwargs', kwargs}
  for _, name in ipairs(DECLARED) do
    local v = f[name]
    if not v and decl and decl[name] ~= nil then
      v = CHECK[name](decl[name])
      if not v then
        return refuse('BadValue', 'the declaration of task ' .. f.task .. ' in ' .. p .. 'tasks: ' .. name
          .. ' must be ' .. RULE[name])
      end
    end
    if v then
      record[#record + 1] = name
      record[#record + 1] = v
    end
  end
  if f.producer then
    record[#record + 1] = 'producer'
    record[#record + 1] = f.producer
  end
  jobs[n] = {id = id, delay = delay, record = record, bytes = #args + #kwargs}
  i = i + 3 + 2 * k
end
if i <= #ARGV then
  limit = tonumber(ARGV[i])
  if i < #ARGV or not limit or limit < 0 or limit ~= math.floor(limit) then
    return refuse('BadCall', 'after the ' .. n_jobs .. ' jobs only the payload limit (bytes) may follow')
  end
end
for _, job in ipairs(jobs) do
  if job.bytes > limit then
    return refuse('PayloadTooLarge', 'job ' .. job.id .. ': args and kwargs take ' .. job.bytes
      .. ' bytes; the limit is ' .. limit)
  end
end

-- Pass 2: write.
if registry then
  redis.call('SADD', registry, queue)
end
local t = now()
local meta = redis.call('HMGET', p .. 'meta', 'bound', 'closed')
local bound, closed = tonumber(meta[1]) or 0, meta[2] == '1'
local out = {}
local added, bytes = 0, 0
for n, j in ipairs(jobs) do
  local job = p .. 'job:' .. j.id
  if closed then
    out[n] = -2
  elseif redis.call('EXISTS', job) == 1 then
    out[n] = 0
  elseif j.delay <= 0 and bound > 0 and redis.call('LLEN', p .. 'pending') >= bound then
    out[n] = -1
  else
    local state = j.delay > 0 and 'delayed' or 'pending'
    redis.call('HSET', job, 'enqueued_at', fmt(t), 'attempts', '0', 'state', state, unpack(j.record))
    bytes = bytes + j.bytes
    if j.delay > 0 then
      to_delayed(p, j.id, job, t + j.delay)
    else  -- to_pending() without its HSET, done above
      redis.call('SADD', p .. 'items', j.id)
      redis.call('LPUSH', p .. 'pending', j.id)
      wake(p)
    end
    added = added + 1
    out[n] = 1
  end
end
if added > 0 then
  redis.call('HINCRBY', p .. 'meta', 'produced_messages', added)
  redis.call('HINCRBY', p .. 'meta', 'produced_bytes', bytes)
  signal_room(p, bound)
end
return out
