-- Add jobs to one queue, all in one call. Every job is checked before any is written: a
-- call with one bad job changes nothing and answers an error (below).
-- KEYS[1]  queue key prefix "<P>:{<Q>}:"; Q must be a valid queue name; a shard's name
--          (Q~i) only while its meta has `bound` (written by `queue create` to each shard it
--          makes: InvalidName otherwise, as for such a queue among KEYS[3..]); a shard a
--          smaller count retired (meta `retired`, `closed`) answers -2, as a closed queue
-- KEYS[2]  optional, never on a Redis Cluster (another slot): the global queue set
--          "<P>:{_}:queues"; Q is added to it (the dispatcher sweeps the queues listed there)
-- KEYS[3..] optional, after KEYS[2], off a cluster only: the key prefixes of other queues
--          (same prefix P) whose jobs this call writes (field queue) or names as parents
-- ARGV[1]  number of jobs N; then per job: id, delay (s, 0 = now), K, then K field/value
--          pairs; then, optionally, the payload limit in bytes (default 1048576)
-- Fields a producer may send (any other is refused): task (required), queue (if sent, Q;
-- the record gets queue Q either way), args (JSON array, default []), kwargs (JSON object,
-- default {}), headers (JSON object; none when not sent), max_duration (s > 0), retries
-- (0 to 2^31-1), retry_backoff (s >= 0), timeout_policy (kill|flag), max_lost (1 to
-- 2^31-1), max_retries (0 to 2^31-1), retry_backoff_max (s >= 0), result_ttl and failed_ttl
-- (whole s, 1 to 2^31-1), soft_limit (s > 0, < max_duration), producer (text); flow
-- control (docs/PROTOCOL.md, Flow control): rate_limit ("N/s", "N/m" or "N/h"),
-- max_concurrency (1 to 2^31-1), concurrency_key (a name; needs max_concurrency, the job's
-- or the declaration's); for a
-- workflow's step (docs/PROTOCOL.md, Workflows): parents ("<queue> <id> ..."; each an
-- earlier job of this call or an existing one that has not failed — or has, with
-- on_parent_failure continue or only; no delay; when all have ended already it is settled
-- at once, as by the join of its last parent), takes
-- ("result": its one parent's result goes first in its args; "results": a JSON array of
-- its parents' results, in the order of parents, goes first: a chord's callback) and
-- on_parent_failure ("cancel", the default: a parent that does not complete cancels it;
-- "continue": such a parent counts as done, its result null; "only": it runs only if its
-- one parent does not complete, an on_failure callback, canceled when it completes; with
-- takes "error" it gets {"id", "task", "state", "error_type", "error"} of that parent
-- first in its args); on a Redis Cluster, for edges between slots: cross_slot ("1": its
-- parents in other queues than its own are in other slots: neither checked nor touched here,
-- each counted as not completed, and joined by join.lua; entries join.lua kept for it before
-- it came are applied once it is written) and cross_children ("<queue> <id> <takes> ...",
-- takes result, results, error or -: its children in other slots, enqueued after it, which
-- its end tells through its queue's outbox; they join its `children`). Pause, priorities and
-- unique jobs (docs/PROTOCOL.md, of that name): priority (0-9, higher claimed first; 0 is the
-- same as none), unique_key (1-200 printable characters, no spaces: while a job holding
-- <p>unique:<key> has not started or ended, per unique_until, a job with that key is not
-- added and answered the holder's id), unique_until ("start" or "finish", the default),
-- unique_for (whole s, 1 to 2^31-1: the lock's TTL, at the latest); unique_until and
-- unique_for need unique_key, and a unique job is no workflow's step, nor a parent in the
-- same call. expires (s > 0 and < 2^53, from now: the record gets `expires` = now + that,
-- an absolute time of Redis's clock, and `opt` names it; a claim at or after it ends the
-- job killed, Expired, instead of delivering it: docs/PROTOCOL.md, Expiry). A producer
-- that leaves out any of max_duration, retries, retry_backoff, timeout_policy and max_lost
-- gets those, and any of max_retries, retry_backoff_max, result_ttl, failed_ttl,
-- soft_limit, rate_limit and max_concurrency it left out too, from the task's declaration,
-- <p>tasks[task] (JSON, written by workers), when there is one. One that sends the first
-- five knows the task: the last seven it did not send are left out of the record (their
-- defaults apply; no soft limit, no flow control),
-- and no declaration is read. Numbers not in plain decimal notation are written back in it.
-- Returns one value per job: 1 added, 0 an id that already exists (nothing changed, and
-- nothing checked of its parents or its queue's state: a call sent again after its answer
-- was lost finds its jobs so, whatever happened since),
-- -1 the queue is full (its bound is reached; delayed jobs and jobs with parents do not
-- count), -2 it is closed; a job whose parent in this call was refused gets its answer;
-- a unique job whose key is held: the holder's id (text), counted in meta
-- duplicates|<task>.
-- Errors: "ERR taskrunner: <Kind>: <message>", Kind one of InvalidName, NotJSON,
-- PayloadTooLarge, BadValue, BadCall.
-- Sets: job:<id> (fields + state, enqueued_at, opt: the optional fields its claim reads, see
-- claim.lua; expires as the absolute time), then pending (or pending:<priority>)+items
-- (+wake, unless the queue is paused) or delayed; unique:<key>;
-- meta produced_messages/produced_bytes (bytes = length of args + kwargs + headers, the
-- payload the limit applies to); meta flow = 1 when a job written has rate_limit or
-- max_concurrency (the claim then checks the queue's jobs for them).
local p = KEYS[1]
local n_jobs = tonumber(ARGV[1])
local WHOLE_MAX = 2147483647
local FAILED_TTL = 604800  -- for a job canceled here (see cross_slot): the default failed TTL
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
local WHOLE = {retries = 0, max_lost = 1, max_retries = 0, result_ttl = 1, failed_ttl = 1, max_concurrency = 1,
  unique_for = 1}

-- The setting `name` (text, or a number from a declaration) as the text to store, or nil
-- when it is not acceptable. Text already in plain decimal is kept as it is.
local function setting(name, v)
  if name == 'timeout_policy' then
    if v == 'kill' or v == 'flag' then return v end
    return nil
  elseif name == 'rate_limit' then  -- flow control
    if rate_of(v) then return v end
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
  local positive = name == 'max_duration' or name == 'soft_limit' or name == 'expires'
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
  if name == 'max_duration' or name == 'soft_limit' or name == 'expires' then
    return 'a number of seconds > 0 and < 2^53'
  elseif name == 'retry_backoff' or name == 'retry_backoff_max' then return 'a number of seconds >= 0 and < 2^53'
  elseif WHOLE[name] then return 'a whole number from ' .. WHOLE[name] .. ' to 2147483647'
  elseif name == 'rate_limit' then return '"N/s", "N/m" or "N/h" with N a whole number from 1 to 999999999'
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
if not queue or not is_queue(queue) then
  return refuse('InvalidName', 'KEYS[1] must be "<prefix>:{<queue>}:" with a queue name of letters, digits and '
    .. '_.:@- (at most 200, starting with a letter or digit), not ' .. quote(p))
end
local base = string.sub(p, 1, #p - #queue - 3)
local registry = KEYS[2]
if registry and registry ~= base .. '{_}:queues' then
  return refuse('BadCall', 'KEYS[2] must be the global queue set "<prefix>:{_}:queues" of KEYS[1]\'s prefix')
end
local prefixes = {[queue] = p}  -- queue -> key prefix, for every queue this call may touch
for k = 3, #KEYS do
  local q = string.match(KEYS[k], '{([^{}]*)}:$')
  if not q or not is_queue(q) or KEYS[k] ~= base .. '{' .. q .. '}:' then
    return refuse('BadCall', 'KEYS[' .. k .. '] must be the key prefix of a queue, "<prefix>:{<queue>}:" with '
      .. 'KEYS[1]\'s prefix, not ' .. quote(KEYS[k]))
  end
  prefixes[q] = KEYS[k]
end
if not n_jobs or n_jobs < 0 or n_jobs % 1 ~= 0 then
  return refuse('BadCall', 'ARGV[1] must be the number of jobs')
end

-- What the task's declaration gives for each of DECLARED, in that order: the text to
-- store, false (none) or true (not acceptable, refused for a job that needs it); false
-- when there is no declaration. Read and checked once per task and call; nil and the
-- refusal when it is not a JSON object.
local DECLARED = {'max_duration', 'retries', 'retry_backoff', 'timeout_policy', 'max_lost', 'max_retries',
  'retry_backoff_max', 'result_ttl', 'failed_ttl', 'soft_limit', 'rate_limit', 'max_concurrency'}
local declarations  -- queue prefix .. task -> fill, made when needed
local function declared(jp, task)
  declarations = declarations or {}
  local fill = declarations[jp .. task]
  if fill ~= nil then return fill end
  fill = false
  local raw = redis.call('HGET', jp .. 'tasks', task)
  if raw then
    local ok, d = pcall(cjson.decode, raw)
    if not ok or type(d) ~= 'table' then
      return nil, refuse('BadValue', 'the declaration of task ' .. task .. ' in ' .. jp .. 'tasks is not a JSON object')
    end
    fill = {}
    for k, name in ipairs(DECLARED) do
      local v = d[name]
      fill[k] = v ~= nil and v ~= cjson.null and (setting(name, v) or true)
    end
  end
  declarations[jp .. task] = fill
  return fill
end

-- A workflow step's parents ("<queue> <id> ..."), checked: a list of {queue, id}, or nil and
-- why not. `here`: "<queue prefix><id>" -> true for the jobs before it in this call. `ended`:
-- a parent may have ended otherwise than completed (on_parent_failure continue or only: it
-- is settled as its end says; with cancel it would never run).
local FINAL = {completed = true, failed = true, killed = true, canceled = true}
local function parents_of(text, jq, id, here, cross, ended)
  local list, seen = {}, {}
  local rest = string.gsub(text, '(%S+)%s+(%S+)', function(q, pid)
    list[#list + 1] = {q, pid}
    return ''
  end)
  if #list == 0 or string.find(rest, '%S') then
    return nil, 'parents must be "<queue> <id>" pairs separated by spaces, not ' .. quote(text)
  end
  for _, e in ipairs(list) do
    local q, pid = e[1], e[2]
    local key = (cross and q ~= jq and q .. ' ' or prefixes[q] or '') .. pid
    if cross and q ~= jq then  -- in another slot: joined by join.lua
      e[3] = true
      if seen[key] then
        return nil, 'parent ' .. q .. ' ' .. pid .. ' listed twice'
      end
    elseif not prefixes[q] then
      return nil, 'parent ' .. pid .. ' is in queue ' .. quote(q) .. ', which is not among KEYS (a queue of '
        .. 'another slot: on a Redis Cluster send cross_slot 1)'
    elseif seen[key] or (q == jq and pid == id) then
      return nil, 'parent ' .. q .. ' ' .. pid .. ' listed twice, or the job itself'
    end
    seen[key] = true
    local state = not e[3] and redis.call('HGET', prefixes[q] .. 'job:' .. pid, 'state')
    local bad
    if not e[3] and (not here[key] or state) then  -- an existing job (one of this call may be one: answer 0)
      if not state then
        bad = 'parent ' .. pid .. ' not found in queue ' .. q .. ' (never enqueued, expired, or not before it in '
          .. 'this call)'
      elseif FINAL[state] and state ~= 'completed' and not ended then
        bad = 'parent ' .. pid .. ' (queue ' .. q .. ') ended ' .. state .. ': the job would never run'
      end
    end
    -- unless the job exists: a producer's call sent again, its answer lost, is answered 0 in
    -- pass 2 whatever its parents became since (read only here: a step that passes costs nothing)
    if bad and redis.call('EXISTS', prefixes[jq] .. 'job:' .. id) == 0 then
      return nil, bad
    end
  end
  return list
end

-- The time of the call: an expiry counts from it (pass 1), the records are written at it (pass 2).
local t = now()
local enqueued_at = fmt(t)  -- now()'s own text, before an expiry is formatted

-- Pass 1: check every job, and build what each one writes: the producer's fields as they
-- are (ARGV from..to) when they need no change, which is the common case, else a record.
-- plan: four entries a job (one table, not four: a lone job's tables are a good part of
-- its cost): id, delay, the index in ARGV of its first field or its record, size.
local tasks_ok = n_jobs ~= 1 and {}  -- task names found valid in this call (a batch's)
local plan = {}
local marks  -- job n -> {priority, unique_key, unique_until, unique_for, task} of those with either
-- job n -> its queue prefix when not p; its parents and takes. `here`: made at the first job
-- with parents (jobs outside workflows pay nothing for it), see parents_of().
local queues_of, steps, here = {}, {}, nil
local flows = {}  -- job n -> true when it has rate_limit or max_concurrency (flow control)
local opts  -- job n -> its record's `opt` (the optional fields a claim reads), for those that have any
local uniques  -- "<queue prefix><id>" -> true for the unique jobs of this call, made at the first
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
  local task, queue_f, args, kwargs, headers, producer, md, rt, rb, tp, ml, mr, bm, rtl, ftl, sl, parents, takes
  local opf, cross, cross_children, rl, mc, ck, prio, uk, uu, uf, ex
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
    elseif name == 'parents' then seen = parents; parents = value
    elseif name == 'takes' then seen = takes; takes = value
    elseif name == 'on_parent_failure' then seen = opf; opf = value
    elseif name == 'cross_slot' then seen = cross; cross = value
    elseif name == 'cross_children' then seen = cross_children; cross_children = value
    elseif name == 'concurrency_key' then  -- flow control
      if not is_name(value) then
        return refuse('BadValue', 'job ' .. id .. ': concurrency_key must be a name (1-200 of letters, digits and '
          .. '_.:@-, starting with a letter or digit), not ' .. quote(value))
      end
      seen = ck; ck = value
    elseif name == 'priority' then seen = prio; prio = value
    elseif name == 'unique_key' then seen = uk; uk = value
    elseif name == 'unique_until' then seen = uu; uu = value
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
      elseif name == 'rate_limit' then seen = rl; rl = v
      elseif name == 'max_concurrency' then seen = mc; mc = v
      elseif name == 'unique_for' then seen = uf; uf = v
      elseif name == 'expires' then seen = ex; ex = v
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
  elseif queue_f and not prefixes[queue_f] then
    return refuse('BadValue', 'job ' .. id .. ': field queue is ' .. quote(queue_f)
      .. ' but KEYS[1] is queue ' .. queue .. (#KEYS > 2 and ' and KEYS[3..] name others' or ''))
  end
  local jq = queue_f or queue
  local jp = prefixes[jq]
  if cross_children then
    local children_of, bad = {}, false
    local rest = string.gsub(cross_children, '(%S+)%s+(%S+)%s+(%S+)', function(cq, cid, ct)
      bad = bad or not is_queue(cq) or cq == jq or #cid > 200 or not string.find(cid, '^[A-Za-z0-9_.:@%-]+$')
        or not (ct == 'result' or ct == 'results' or ct == 'error' or ct == '-')
      children_of[#children_of + 1] = cq .. ' ' .. cid
      return ''
    end)
    if bad or #children_of == 0 or string.find(rest, '%S') then
      return refuse('BadValue', 'job ' .. id .. ': cross_children must be "<queue> <id> <takes>" triples (a queue '
        .. 'other than its own; takes result, results, error or -), not ' .. quote(cross_children))
    end
    cross_children = {cross_children, table.concat(children_of, ' ')}
  end
  if prio and not string.find(prio, '^%d$') then
    return refuse('BadValue', 'job ' .. id .. ': priority must be a whole number from 0 to 9, not ' .. quote(prio))
  elseif (uu or uf) and not uk then
    return refuse('BadCall', 'job ' .. id .. ': unique_until and unique_for need unique_key')
  elseif uk and (#uk > 200 or not string.find(uk, '^[%w%p]+$')) then
    return refuse('BadValue', 'job ' .. id .. ': unique_key must be 1-200 printable characters without spaces, not '
      .. quote(uk))
  elseif uu and uu ~= 'start' and uu ~= 'finish' then
    return refuse('BadValue', 'job ' .. id .. ': unique_until must be "start" or "finish", not ' .. quote(uu))
  elseif uk and (parents or cross) then
    return refuse('BadValue', 'job ' .. id .. ': a unique job cannot wait for parents (a workflow\'s step)')
  end
  if parents or takes or opf or cross then
    if not parents then
      return refuse('BadCall', 'job ' .. id .. ': takes, on_parent_failure and cross_slot need parents')
    elseif cross and cross ~= '1' then
      return refuse('BadValue', 'job ' .. id .. ': cross_slot must be 1, not ' .. quote(cross))
    elseif delay > 0 then
      return refuse('BadValue', 'job ' .. id .. ': a job with parents cannot have a delay')
    end
    if not here then
      here = {}
      for k = 1, n - 1 do here[(queues_of[k] or p) .. plan[4 * k - 3]] = true end
    end
    local list, bad = parents_of(parents, jq, id, here, cross, opf == 'continue' or opf == 'only')
    if not list then return refuse('BadValue', 'job ' .. id .. ': ' .. bad) end
    for _, e in ipairs(list) do
      if uniques and uniques[prefixes[e[1]] .. e[2]] then
        return refuse('BadValue', 'job ' .. id .. ': its parent ' .. e[2] .. ' is a unique job of this call (it may '
          .. 'not be added): enqueue it first')
      end
    end
    if takes and not ((takes == 'result' or takes == 'error') and #list == 1 or takes == 'results') then
      return refuse('BadValue', 'job ' .. id .. ': takes must be "result" or "error" (a job with one parent) or '
        .. '"results", not ' .. quote(takes))
    elseif opf and opf ~= 'cancel' and opf ~= 'continue' and opf ~= 'only' then
      return refuse('BadValue', 'job ' .. id .. ': on_parent_failure must be "cancel", "continue" or "only", not '
        .. quote(opf))
    elseif takes == 'error' and opf ~= 'only' or opf == 'only' and takes and takes ~= 'error' then
      return refuse('BadValue', 'job ' .. id .. ': takes "error" goes with on_parent_failure "only" (an on_failure '
        .. 'callback)')
    end
    steps[n] = {list, takes, cross, opf}
  end
  if jp ~= p then queues_of[n] = jp end
  if here then here[jp .. id] = true end
  if uk then
    uniques = uniques or {}
    uniques[jp .. id] = true
  end
  if tasks_ok then tasks_ok[task] = true end
  -- the record gets them all; expires as the absolute time (never as sent)
  changed = changed or not (args and kwargs and queue_f) or cross_children or ex
  args, kwargs = args or '[]', kwargs or '{}'
  local why = args ~= '[]' and bad_json(args, '[')
  if why then return refuse('NotJSON', 'job ' .. id .. ': args ' .. why) end
  why = kwargs ~= '{}' and bad_json(kwargs, '{')
  if why then return refuse('NotJSON', 'job ' .. id .. ': kwargs ' .. why) end
  why = headers and bad_json(headers, '{')
  if why then return refuse('NotJSON', 'job ' .. id .. ': headers ' .. why) end
  if not (md and rt and rb and tp and ml) then  -- what the producer left to the declaration
    local fill, refusal = declared(jp, task)
    if refusal then return refusal end
    if fill then
      md, rt, rb, tp, ml = md or fill[1], rt or fill[2], rb or fill[3], tp or fill[4], ml or fill[5]
      mr, bm, rtl, ftl, sl = mr or fill[6], bm or fill[7], rtl or fill[8], ftl or fill[9], sl or fill[10]
      rl, mc = rl or fill[11], mc or fill[12]
      local bad = md == true and 1 or rt == true and 2 or rb == true and 3 or tp == true and 4 or ml == true and 5
        or mr == true and 6 or bm == true and 7 or rtl == true and 8 or ftl == true and 9 or sl == true and 10
        or rl == true and 11 or mc == true and 12
      if bad then
        return refuse('BadValue', 'the declaration of task ' .. task .. ' in ' .. jp .. 'tasks: ' .. DECLARED[bad]
          .. ' must be ' .. rule(DECLARED[bad]))
      end
      changed = true
    end
  end
  if sl and md and tonumber(sl) >= tonumber(md) then
    return refuse('BadValue', 'job ' .. id .. ': soft_limit (' .. sl .. 's) must be less than max_duration ('
      .. md .. 's): the hard kill comes at max_duration')
  end
  if ck and not mc then
    return refuse('BadValue', 'job ' .. id .. ': concurrency_key needs max_concurrency (the job\'s or its task\'s '
      .. 'declaration)')
  end
  if rl or mc then flows[n] = true end
  if headers or sl or uu == 'start' or ex then  -- what its claim must read besides the fields every job has
    local names = {}
    if headers then names[#names + 1] = 'headers' end
    if sl then names[#names + 1] = 'soft_limit' end
    if uu == 'start' then names[#names + 1] = 'unique_key' end  -- its lock ends at the claim
    if ex then names[#names + 1] = 'expires' end  -- its claim checks it
    opts = opts or {}
    opts[n] = table.concat(names, ' ')
  end
  if changed then
    local record = {'queue', jq, 'task', task, 'args', args, 'kwargs', kwargs}
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
    if parents then record[#record + 1] = 'parents'; record[#record + 1] = parents end
    if takes then record[#record + 1] = 'takes'; record[#record + 1] = takes end
    if opf then record[#record + 1] = 'on_parent_failure'; record[#record + 1] = opf end
    if cross then record[#record + 1] = 'cross_slot'; record[#record + 1] = cross end
    if cross_children then
      record[#record + 1] = 'cross_children'; record[#record + 1] = cross_children[1]
      record[#record + 1] = 'children'; record[#record + 1] = cross_children[2]
    end
    if rl then record[#record + 1] = 'rate_limit'; record[#record + 1] = rl end
    if mc then record[#record + 1] = 'max_concurrency'; record[#record + 1] = mc end
    if ck then record[#record + 1] = 'concurrency_key'; record[#record + 1] = ck end
    if prio then record[#record + 1] = 'priority'; record[#record + 1] = prio end
    if uk then record[#record + 1] = 'unique_key'; record[#record + 1] = uk end
    if uu then record[#record + 1] = 'unique_until'; record[#record + 1] = uu end
    if uf then record[#record + 1] = 'unique_for'; record[#record + 1] = uf end
    if ex then record[#record + 1] = 'expires'; record[#record + 1] = fmt(t + tonumber(ex)) end
    plan[4 * n - 1] = record
  else
    plan[4 * n - 1] = i + 3
  end
  local size = #args + #kwargs + (headers and #headers or 0)
  if size > largest then largest = size end
  plan[4 * n - 3], plan[4 * n - 2], plan[4 * n] = id, delay, size
  if prio and prio ~= '0' or uk then  -- made at the first job that has either
    marks = marks or {}
    marks[n] = {prio ~= '0' and prio or nil, uk, uu, uf, task}
  end
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

-- Pass 2: write, per queue. The ids of the jobs made pending go to items and pending in one
-- SADD and one LPUSH per CHUNK jobs, and one wake token is left at the end: the same end
-- state as making each job pending on its own, for a fraction of the commands.
local CHUNK = 1000

-- The id of the job that holds unique key `key` of queue prefix jp, or nil when none does:
-- the lock names a job that has not started (or ended, per its unique_until) and holds this
-- key. A lock that names another (a job gone, ended, or that released it unseen) is stale
-- and taken over: nothing can leave a key locked for ever.
local LOCKING = {pending = true, delayed = true, waiting = true}
local function held(jp, key, id)
  local h = redis.call('GET', jp .. 'unique:' .. key)
  if not h or h == id then return nil end
  local f = redis.call('HMGET', jp .. 'job:' .. h, 'state', 'unique_key', 'unique_until')
  if f[2] == key and (LOCKING[f[1]] or f[1] == 'running' and f[3] ~= 'start') then
    return h
  end
  return nil
end
local into = {}  -- queue prefix -> what this call does there
local function queue_at(jp)
  local meta = redis.call('HMGET', jp .. 'meta', 'bound', 'closed', 'paused', 'priorities', 'retired')
  local bound, closed = tonumber(meta[1]) or 0, meta[2] == '1' or meta[5] == '1'
  -- room: the pending jobs, counted here on, of a bounded queue; levels: meta priorities
  local qs = {bound = bound, closed = closed, room = bound > 0 and not closed and backlog(jp, meta[4]),
    fresh = {}, added = 0, bytes = 0, pushed = 0, paused = meta[3] == '1', levels = meta[4], made = meta[1] ~= false}
  into[jp] = qs
  return qs
end
local function push(jp, qs)
  redis.call('SADD', jp .. 'items', unpack(qs.fresh))
  redis.call('LPUSH', jp .. 'pending', unpack(qs.fresh))
  qs.pushed = qs.pushed + #qs.fresh
  qs.fresh = {}
end
-- A shard (Q~i) takes jobs only while it is one of Q's shards (docs/PROTOCOL.md, Sharded
-- queues). Its meta is all this slot holds of Q: `queue create` writes `bound` to the meta of
-- every shard it makes, so a shard whose meta has none was never made (it is at or past Q's
-- count, where no worker serves it) and is refused before anything is written; one a smaller
-- count retired has `retired` and `closed` and is answered closed (-2). A plain queue's
-- check costs no command: its meta is read anyway, and the other queues' only when shards.
local function unmade(q, bound)
  if bound or not string.find(q, '~', 1, true) then return nil end
  return refuse('InvalidName', 'queue ' .. q .. ' is not a shard of queue ' .. string.match(q, '^(.*)~')
    .. ' (shard i of a queue with N shards (its meta shards) is <queue>~i, 1 <= i < N; '
    .. '`taskrunner queue create <queue> --shards N` makes them)')
end
local main = queue_at(p)
local stray = unmade(queue, main.made)
if stray then return stray end
for q, jp in pairs(prefixes) do  -- KEYS[3..]: a workflow's other queues, off a cluster
  stray = jp ~= p and string.find(q, '~', 1, true) and unmade(q, redis.call('HEXISTS', jp .. 'meta', 'bound') == 1)
  if stray then return stray end
end
if registry then
  redis.call('SADD', registry, queue)
end
local workflow = next(steps) ~= nil
local out, answer = {}, {}  -- answer: "<queue prefix><id>" -> out of a job of this call
for n = 1, n_jobs do
  local id, delay, fields, size = plan[4 * n - 3], plan[4 * n - 2], plan[4 * n - 1], plan[4 * n]
  local jp = queues_of[n] or p
  local qs = jp == p and main or into[jp] or queue_at(jp)
  local job = jp .. 'job:' .. id
  local step, left, refused = steps[n], 0, nil
  if step then  -- a parent of this call that was refused: so is this job
    for _, e in ipairs(step[1]) do
      local a = not e[3] and answer[prefixes[e[1]] .. e[2]]
      if type(a) == 'number' and a < 0 then refused = a end
    end
  end
  local fl = marks and marks[n]  -- {priority, unique_key, unique_until, unique_for, task}
  -- an id that exists first: a call sent again (its answer lost) finds its jobs whatever
  -- happened since (the queue closed, say)
  local exists = redis.call('EXISTS', job) == 1
  local holder = not exists and fl and fl[2] and not qs.closed and held(jp, fl[2], id)
  if exists then
    out[n] = 0
  elseif qs.closed then
    out[n] = -2
  elseif holder then
    out[n] = holder
    redis.call('HINCRBY', jp .. 'meta', 'duplicates|' .. fl[5], 1)
  elseif refused then
    out[n] = refused
  elseif not step and delay <= 0 and qs.room and qs.room >= qs.bound then
    out[n] = -1
  else
    if step then  -- each parent that has not ended yet gets it among its children
      workflows()
      for _, e in ipairs(step[1]) do
        local pjob = not e[3] and prefixes[e[1]] .. 'job:' .. e[2]
        local f = pjob and redis.call('HMGET', pjob, 'state', 'children') or {}
        if not pjob then  -- in another slot: counted, and joined by join.lua
          left = left + 1
        elseif not FINAL[f[1]] then  -- one that ended otherwise than completed: only where parents_of() let it
          redis.call('HSET', pjob, 'children', (f[2] and f[2] .. ' ' or '') .. string.match(jp, '{([^{}]*)}:$') .. ' '
            .. id)
          left = left + 1
        end
      end
    end
    local state = left > 0 and 'waiting' or delay > 0 and 'delayed' or 'pending'
    local opt = opts and opts[n] or ''
    if type(fields) == 'number' then  -- the producer's fields as sent
      redis.call('HSET', job, 'id', id, 'enqueued_at', enqueued_at, 'attempts', '0', 'state', state, 'opt', opt,
        unpack(ARGV, fields, fields + 2 * tonumber(ARGV[fields - 1]) - 1))
    else
      redis.call('HSET', job, 'id', id, 'enqueued_at', enqueued_at, 'attempts', '0', 'state', state, 'opt', opt,
        unpack(fields))
    end
    qs.bytes = qs.bytes + size
    if left > 0 then
      redis.call('HSET', job, 'waiting_on', left)
      redis.call('ZADD', jp .. 'waiting', t, id)
      if step[3] then  -- parents in other slots that ended before it came (join.lua kept them)
        local kept, far = redis.call('HGETALL', jp .. 'joined:' .. id), {}
        for _, e in ipairs(step[1]) do
          if e[3] then far[e[1] .. ' ' .. e[2]] = true end
        end
        for k = 1, #kept, 2 do
          local c = redis.call('HMGET', job, unpack(CHILD))
          if c[1] ~= 'waiting' then break end
          if far[kept[k]] then
            settle(jp, id, far_parent(kept[k], cjson.decode(kept[k + 1])), c, t, FAILED_TTL)
          end
        end
      end
    elseif delay > 0 then
      to_delayed(jp, id, job, t + delay)
    elseif step and (step[2] == 'results' or step[2] == 'error' or step[4] == 'only') then
      -- Every parent ended already, and what it takes (the array of their results, an error),
      -- or whether it runs at all (an on_failure callback), is the join's to say: it waits for
      -- its last parent, settled now as it ended, behind the jobs of this call before it.
      if #qs.fresh > 0 then push(jp, qs) end
      local e = step[1][#step[1]]
      if step[4] == 'only' then  -- a parent that completed cancels it, whichever ended last (as joins would)
        for _, x in ipairs(step[1]) do
          if redis.call('HGET', prefixes[x[1]] .. 'job:' .. x[2], 'state') == 'completed' then
            e = x
            break
          end
        end
      end
      local pjob = prefixes[e[1]] .. 'job:' .. e[2]
      local pf = redis.call('HMGET', pjob, 'task', 'state', 'error_type', 'error', 'canceled_by')
      redis.call('HSET', job, 'state', 'waiting', 'waiting_on', 1)
      redis.call('ZADD', jp .. 'waiting', t, id)
      settle(jp, id, {queue = e[1], id = e[2], task = pf[1] or '?', state = pf[2] or 'completed', error_type = pf[3],
        error = pf[4], canceled_by = pf[5], job = pjob}, redis.call('HMGET', job, unpack(CHILD)), t, FAILED_TTL)
      if qs.room and redis.call('HGET', job, 'state') == 'pending' then qs.room = qs.room + 1 end
    else
      if step and step[2] then  -- its parent ended already: its result now (null where it did not complete)
        local e = step[1][1]
        redis.call('HSET', job, 'args', prepend(redis.call('HGET', prefixes[e[1]] .. 'job:' .. e[2], 'result')
          or 'null', redis.call('HGET', job, 'args')))
      end
      if fl and fl[1] then  -- a priority: its own list, registered in meta priorities
        redis.call('SADD', jp .. 'items', id)
        redis.call('LPUSH', pending_of(jp, fl[1]), id)
        qs.levels, qs.pushed = true, qs.pushed + 1
      else
        local fresh = qs.fresh
        fresh[#fresh + 1] = id
        if #fresh == CHUNK then push(jp, qs) end
      end
      if qs.room then qs.room = qs.room + 1 end
    end
    if fl and fl[2] then
      local lk = jp .. 'unique:' .. fl[2]
      if fl[4] then
        redis.call('SET', lk, id, 'EX', fl[4])
      else
        redis.call('SET', lk, id)
      end
    end
    qs.added = qs.added + 1
    if flows[n] then qs.flow = true end
    out[n] = 1
  end
  if workflow then answer[jp .. id] = out[n] end
end
for jp, qs in pairs(into) do
  if #qs.fresh > 0 then push(jp, qs) end
  if qs.pushed > 0 and not qs.paused then  -- a paused queue's workers sleep on
    wake(jp)
  end
  if qs.added > 0 then
    if registry and jp ~= p then
      redis.call('SADD', registry, string.match(jp, '{([^{}]*)}:$'))
    end
    redis.call('HINCRBY', jp .. 'meta', 'produced_messages', qs.added)
    redis.call('HINCRBY', jp .. 'meta', 'produced_bytes', qs.bytes)
    if qs.flow then redis.call('HSET', jp .. 'meta', 'flow', '1') end
    signal_room(jp, qs.bound, qs.levels and redis.call('HGET', jp .. 'meta', 'priorities'))
  end
end
return out
