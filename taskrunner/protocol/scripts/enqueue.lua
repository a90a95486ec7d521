-- Add jobs to one queue, all in one call. Every job is checked before any is written: a
-- call with one bad job changes nothing and answers an error (below).
-- KEYS[1]  queue key prefix "<P>:{<Q>}:"; Q must be a valid queue name
-- KEYS[2]  optional, never on a Redis Cluster (another slot): the global queue set
--          "<P>:{_}:queues"; Q is added to it (the dispatcher sweeps the queues listed there)
-- ARGV[1]  number of jobs N; then per job: id, delay (s, 0 = now), K, then K field/value
--          pairs; then, optionally, the payload limit in bytes (default 1048576)
-- Fields a producer may send (any other is refused): task (required), queue (if sent, Q;
-- the record gets queue Q either way), args (JSON array, default []), kwargs (JSON object,
-- default {}), headers (JSON object; none when not sent), max_duration (s > 0), retries
-- (0 to 2^31-1), retry_backoff (s >= 0), timeout_policy (kill|flag), max_lost (1 to
-- 2^31-1), max_retries (0 to 2^31-1), retry_backoff_max (s >= 0), result_ttl and failed_ttl
-- (whole s, 1 to 2^31-1), soft_limit (s > 0, < max_duration), producer (text). A producer
-- that leaves out any of max_duration, retries, retry_backoff, timeout_policy and max_lost
-- gets those, and any of max_retries, retry_backoff_max, result_ttl, failed_ttl and
-- soft_limit it left out too, from the task's declaration, <p>tasks[task] (JSON, written
-- by workers), when there is one. One that sends the first five knows the task: the last
-- five it did not send are left out of the record (their defaults apply; no soft limit),
-- and no declaration is read. Numbers not in plain decimal notation are written back in it.
-- Returns one integer per job: 1 added, 0 an id that already exists (nothing changed),
-- -1 the queue is full (its bound is reached; delayed jobs do not count), -2 it is closed.
-- Errors: "ERR taskrunner: <Kind>: <message>", Kind one of InvalidName, NotJSON,
-- PayloadTooLarge, BadValue, BadCall.
-- Sets: job:<id> (fields + state, enqueued_at), then pending+items (+wake) or delayed;
-- meta produced_messages/produced_bytes (bytes = length of args + kwargs + headers, the
-- payload the limit applies to).
local p = KEYS[1]
local n_jobs = tonumber(ARGV[1])
local WHOLE_MAX = 2147483647
local SECONDS_MAX = 9007199254740992  -- 2^53: whole seconds up to here are exact doubles

local function refuse(kind, message)
  return redis.error_reply('ERR taskrunner: ' .. kind .. ': ' .. message)
end

local function quote(s)
  return string.format('%q', string.sub(s, 1, 250))
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

-- The settings that are whole numbers, and the least each may be.
local WHOLE = {retries = 0, max_lost = 1, max_retries = 0, result_ttl = 1, failed_ttl = 1}

-- The setting `name` (text, or a number from a declaration) as the text to store, or nil
-- when it is not acceptable. Text already in plain decimal is kept as it is.
local function setting(name, v)
  if name == 'timeout_policy' then
    if v == 'kill' or v == 'flag' then return v end
    return nil
  end
  local x = tonumber(v)
  if not x or x ~= x then return nil end
  local plain = type(v) == 'string' and string.find(v, '^%d+%.?%d*$')
  if WHOLE[name] then
    if x % 1 ~= 0 or x < WHOLE[name] or x > WHOLE_MAX then return nil end
    return plain and not string.find(v, '.', 1, true) and v or string.format('%d', x)
  end
  if x < 0 or x >= SECONDS_MAX then return nil end  -- max_duration, retry_backoff(_max), soft_limit: seconds
  local positive = name == 'max_duration' or name == 'soft_limit'
  if plain then
    if x == 0 and positive then return nil end
    return v
  end
  local s = decimal(x)
  if positive and tonumber(s) <= 0 then return nil end
  return s
end

-- setting() of a producer's text, remembered for the call: a batch repeats its values.
local checked = n_jobs ~= 1 and {}
local function setting_of(name, text)
  if not checked then return setting(name, text) end
  local known = checked[name]
  if not known then
    known = {}
    checked[name] = known
  end
  local v = known[text]
  if v == nil then
    v = setting(name, text) or false
    known[text] = v
  end
  return v
end

local function rule(name)
  if name == 'max_duration' or name == 'soft_limit' then return 'a number of seconds > 0 and < 2^53'
  elseif name == 'retry_backoff' or name == 'retry_backoff_max' then return 'a number of seconds >= 0 and < 2^53'
  elseif WHOLE[name] then return 'a whole number from ' .. WHOLE[name] .. ' to 2147483647'
  end
  return 'kill or flag'
end

local strict  -- a JSON decoder that refuses NaN, Infinity, hex and leading zeros, made when needed

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

-- args (opening '[') or kwargs and headers ('{'): nil when it is JSON of that kind, else why not.
-- cjson's shared decoder takes more than the strict one only where a number is expected:
-- text starting with '+', inf or nan (any case), or 0 and a digit or x. Text with none of
-- +, inf, nan, 0x, 0<digit> anywhere decodes alike with both, and the strict decoder
-- (costly to make: a good part of a lone job's cost) is made only for the rest.
local function bad_json(v, opening)
  if string.sub(v, 1, 1) ~= opening and string.match(v, '^%s*(.)') ~= opening then
    return opening == '[' and 'is not a JSON array' or 'is not a JSON object'
  end
  local decoder, lower = cjson, string.lower(v)
  if string.find(lower, '+', 1, true) or string.find(lower, 'inf', 1, true) or string.find(lower, 'nan', 1, true)
      or string.find(lower, '0', 1, true) and string.find(lower, '0[%dx]') then
    if not strict then
      strict = cjson.new()
      strict.decode_invalid_numbers(false)
    end
    decoder = strict
  end
  local ok, decoded = pcall(decoder.decode, v)
  if not ok then
    return 'is not JSON (' .. tostring(decoded) .. ')'
  end
  if string.find(lower, 'e%+?%d%d%d') and not finite(decoded) then
    return 'holds a number too large for a double'
  end
end

local queue = string.match(p, '{([^{}]*)}:$')
if not queue or not is_name(queue) then
  return refuse('InvalidName', 'KEYS[1] must be "<prefix>:{<queue>}:" with a queue name of letters, digits and '
    .. '_.:@- (at most 200, starting with a letter or digit), not ' .. quote(p))
end
local registry = KEYS[2]
if registry and registry ~= string.sub(p, 1, #p - #queue - 3) .. '{_}:queues' then
  return refuse('BadCall', 'KEYS[2] must be the global queue set "<prefix>:{_}:queues" of KEYS[1]\'s prefix')
end
if not n_jobs or n_jobs < 0 or n_jobs % 1 ~= 0 then
  return refuse('BadCall', 'ARGV[1] must be the number of jobs')
end

-- What the task's declaration gives for each of DECLARED, in that order: the text to
-- store, false (none) or true (not acceptable, refused for a job that needs it); false
-- when there is no declaration. Read and checked once per task and call; nil and the
-- refusal when it is not a JSON object.
local DECLARED = {'max_duration', 'retries', 'retry_backoff', 'timeout_policy', 'max_lost', 'max_retries',
  'retry_backoff_max', 'result_ttl', 'failed_ttl', 'soft_limit'}
local declarations  -- task -> fill, made when needed
local function declared(task)
  declarations = declarations or {}
  local fill = declarations[task]
  if fill ~= nil then return fill end
  fill = false
  local raw = redis.call('HGET', p .. 'tasks', task)
  if raw then
    local ok, d = pcall(cjson.decode, raw)
    if not ok or type(d) ~= 'table' then
      return nil, refuse('BadValue', 'the declaration of task ' .. task .. ' in ' .. p .. 'tasks is not a JSON object')
    end
    fill = {}
    for k, name in ipairs(DECLARED) do
      local v = d[name]
      fill[k] = v ~= nil and v ~= cjson.null and (setting(name, v) or true)
    end
  end
  declarations[task] = fill
  return fill
end

-- Pass 1: check every job, and build what each one writes: the producer's fields as they
-- are (ARGV from..to) when they need no change, which is the common case, else a record.
-- plan: four entries a job (one table, not four: a lone job's tables are a good part of
-- its cost): id, delay, the index in ARGV of its first field or its record, size.
local tasks_ok = n_jobs ~= 1 and {}  -- task names found valid in this call (a batch's)
local plan = {}
local largest, i = 0, 2
for n = 1, n_jobs do
  local id, delay_s, k = ARGV[i], ARGV[i + 1], tonumber(ARGV[i + 2])
  if not k or k < 0 or k % 1 ~= 0 or i + 2 + 2 * k > #ARGV then
    return refuse('BadCall', 'job ' .. n .. ': expected id, delay, K and K field/value pairs')
  end
  if #id > 200 or not string.find(id, '^[A-Za-z0-9_.:@%-]+$') then
    return refuse('InvalidName', 'job ' .. n .. ': invalid job id ' .. quote(id)
      .. ': use 1-200 letters, digits and _.:@-')
  end
  local delay = tonumber(delay_s)
  if not delay or delay ~= delay or delay < 0 or delay >= SECONDS_MAX then
    return refuse('BadValue', 'job ' .. id .. ': delay must be a number of seconds >= 0 and < 2^53')
  end
  -- Fields in locals, not a table: this loop is most of the script's cost.
  local task, queue_f, args, kwargs, headers, producer, md, rt, rb, tp, ml, mr, bm, rtl, ftl, sl
  local changed = false  -- a setting written otherwise than sent
  for a = i + 3, i + 1 + 2 * k, 2 do
    local name, value = ARGV[a], ARGV[a + 1]
    local seen
    if name == 'task' then seen = task; task = value
    elseif name == 'args' then seen = args; args = value
    elseif name == 'kwargs' then seen = kwargs; kwargs = value
    elseif name == 'headers' then seen = headers; headers = value
    elseif name == 'queue' then seen = queue_f; queue_f = value
    elseif name == 'producer' then seen = producer; producer = value
    else
      local v = setting_of(name, value)
      if name == 'max_duration' then seen = md; md = v
      elseif name == 'retries' then seen = rt; rt = v
      elseif name == 'retry_backoff' then seen = rb; rb = v
      elseif name == 'timeout_policy' then seen = tp; tp = v
      elseif name == 'max_lost' then seen = ml; ml = v
      elseif name == 'max_retries' then seen = mr; mr = v
      elseif name == 'retry_backoff_max' then seen = bm; bm = v
      elseif name == 'result_ttl' then seen = rtl; rtl = v
      elseif name == 'failed_ttl' then seen = ftl; ftl = v
      elseif name == 'soft_limit' then seen = sl; sl = v
      else
        return refuse('BadCall', 'job ' .. id .. ': unknown field ' .. string.format('%q', string.sub(name, 1, 50)))
      end
      if not v then
        return refuse('BadValue', 'job ' .. id .. ': ' .. name .. ' must be ' .. rule(name) .. ', not '
          .. string.format('%q', string.sub(value, 1, 50)))
      end
      changed = changed or v ~= value
    end
    if seen then
      return refuse('BadCall', 'job ' .. id .. ': field ' .. name .. ' given twice')
    end
  end
  if not task then
    return refuse('BadCall', 'job ' .. id .. ': the task field is required')
  elseif not (tasks_ok and tasks_ok[task]) and not is_name(task) then
    return refuse('InvalidName', 'job ' .. id .. ': invalid task name ' .. quote(task)
      .. ': use letters, digits and _.:@- (at most 200, starting with a letter or digit)')
  elseif queue_f and queue_f ~= queue then
    return refuse('BadValue', 'job ' .. id .. ': field queue is ' .. quote(queue_f)
      .. ' but KEYS[1] is queue ' .. queue)
  end
  if tasks_ok then tasks_ok[task] = true end
  changed = changed or not (args and kwargs and queue_f)  -- the record gets them all
  args, kwargs = args or '[]', kwargs or '{}'
  local why = args ~= '[]' and bad_json(args, '[')
  if why then return refuse('NotJSON', 'job ' .. id .. ': args ' .. why) end
  why = kwargs ~= '{}' and bad_json(kwargs, '{')
  if why then return refuse('NotJSON', 'job ' .. id .. ': kwargs ' .. why) end
  why = headers and bad_json(headers, '{')
  if why then return refuse('NotJSON', 'job ' .. id .. ': headers ' .. why) end
  if not (md and rt and rb and tp and ml) then  -- what the producer left to the declaration
    local fill, refusal = declared(task)
    if refusal then return refusal end
    if fill then
      md, rt, rb, tp, ml = md or fill[1], rt or fill[2], rb or fill[3], tp or fill[4], ml or fill[5]
      mr, bm, rtl, ftl, sl = mr or fill[6], bm or fill[7], rtl or fill[8], ftl or fill[9], sl or fill[10]
      local bad = md == true and 1 or rt == true and 2 or rb == true and 3 or tp == true and 4 or ml == true and 5
        or mr == true and 6 or bm == true and 7 or rtl == true and 8 or ftl == true and 9 or sl == true and 10
      if bad then
        return refuse('BadValue', 'the declaration of task ' .. task .. ' in ' .. p .. 'tasks: ' .. DECLARED[bad]
          .. ' must be ' .. rule(DECLARED[bad]))
      end
      changed = true
    end
  end
  if sl and md and tonumber(sl) >= tonumber(md) then
    return refuse('BadValue', 'job ' .. id .. ': soft_limit (' .. sl .. 's) must be less than max_duration ('
      .. md .. 's): the hard kill comes at max_duration')
  end
  if changed then
    local record = {'queue', queue, 'task', task, 'args', args, 'kwargs', kwargs}
    if headers then record[#record + 1] = 'headers'; record[#record + 1] = headers end
    if md then record[#record + 1] = 'max_duration'; record[#record + 1] = md end
    if rt then record[#record + 1] = 'retries'; record[#record + 1] = rt end
    if rb then record[#record + 1] = 'retry_backoff'; record[#record + 1] = rb end
    if tp then record[#record + 1] = 'timeout_policy'; record[#record + 1] = tp end
    if ml then record[#record + 1] = 'max_lost'; record[#record + 1] = ml end
    if mr then record[#record + 1] = 'max_retries'; record[#record + 1] = mr end
    if bm then record[#record + 1] = 'retry_backoff_max'; record[#record + 1] = bm end
    if rtl then record[#record + 1] = 'result_ttl'; record[#record + 1] = rtl end
    if ftl then record[#record + 1] = 'failed_ttl'; record[#record + 1] = ftl end
    if sl then record[#record + 1] = 'soft_limit'; record[#record + 1] = sl end
    if producer then record[#record + 1] = 'producer'; record[#record + 1] = producer end
    plan[4 * n - 1] = record
  else
    plan[4 * n - 1] = i + 3
  end
  local size = #args + #kwargs + (headers and #headers or 0)
  if size > largest then largest = size end
  plan[4 * n - 3], plan[4 * n - 2], plan[4 * n] = id, delay, size
  i = i + 3 + 2 * k
end
local limit = 1048576
if i <= #ARGV then
  limit = tonumber(ARGV[i])
  if i < #ARGV or not limit or limit < 0 or limit % 1 ~= 0 then
    return refuse('BadCall', 'after the ' .. n_jobs .. ' jobs only the payload limit (bytes) may follow')
  end
end
if largest > limit then
  for n = 1, n_jobs do
    if plan[4 * n] > limit then
      return refuse('PayloadTooLarge', 'job ' .. plan[4 * n - 3] .. ': args, kwargs and headers take ' .. plan[4 * n]
        .. ' bytes; the limit is ' .. limit)
    end
  end
end

-- Pass 2: write. The ids of the jobs made pending go to items and pending in one SADD and
-- one LPUSH per CHUNK jobs, and one wake token is left at the end: the same end state as
-- making each job pending on its own, for a fraction of the commands.
if registry then
  redis.call('SADD', registry, queue)
end
local CHUNK = 1000
local t = now()
local enqueued_at = fmt(t)
local meta = redis.call('HMGET', p .. 'meta', 'bound', 'closed')
local bound, closed = tonumber(meta[1]) or 0, meta[2] == '1'
local items, pending = p .. 'items', p .. 'pending'
local waiting = bound > 0 and not closed and redis.call('LLEN', pending)  -- counted here on
local out, fresh = {}, {}
local added, bytes, pushed = 0, 0, 0
local function push()
  redis.call('SADD', items, unpack(fresh))
  redis.call('LPUSH', pending, unpack(fresh))
  pushed = pushed + #fresh
  fresh = {}
end
for n = 1, n_jobs do
  local id, delay, fields, size = plan[4 * n - 3], plan[4 * n - 2], plan[4 * n - 1], plan[4 * n]
  local job = p .. 'job:' .. id
  if closed then
    out[n] = -2
  elseif redis.call('EXISTS', job) == 1 then
    out[n] = 0
  elseif delay <= 0 and waiting and waiting >= bound then
    out[n] = -1
  else
    local state = delay > 0 and 'delayed' or 'pending'
    if type(fields) == 'number' then  -- the producer's fields as sent
      redis.call('HSET', job, 'id', id, 'enqueued_at', enqueued_at, 'attempts', '0', 'state', state,
        unpack(ARGV, fields, fields + 2 * tonumber(ARGV[fields - 1]) - 1))
    else
      redis.call('HSET', job, 'id', id, 'enqueued_at', enqueued_at, 'attempts', '0', 'state', state,
        unpack(fields))
    end
    bytes = bytes + size
    if delay > 0 then
      to_delayed(p, id, job, t + delay)
    else
      fresh[#fresh + 1] = id
      if #fresh == CHUNK then push() end
      if waiting then waiting = waiting + 1 end
    end
    added = added + 1
    out[n] = 1
  end
end
if #fresh > 0 then push() end
if pushed > 0 then
  wake(p)
end
if added > 0 then
  redis.call('HINCRBY', p .. 'meta', 'produced_messages', added)
  redis.call('HINCRBY', p .. 'meta', 'produced_bytes', bytes)
  signal_room(p, bound)
end
return out
