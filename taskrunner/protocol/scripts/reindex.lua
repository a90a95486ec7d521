-- Index failed or killed jobs that ended before the failure indexes existed (taskrunner
-- failures reindex, taskrunner/ops/failures.py): each id still listed in <p><state> whose
-- record is in that state is added to the indexes with its score there, as "Finalize as S"
-- would have (docs/PROTOCOL.md, Failure indexes). Idempotent: a job already indexed is
-- written again, unchanged. An id whose record is gone or in another state is left as it is
-- (retry, delete and the sweep take such ids out of <p><state>).
-- KEYS[1]  queue key prefix
-- ARGV[1]  state: failed or killed   ARGV[2..]  job ids (a batch read from <p><state>)
-- Returns {indexed, skipped}.
local p, state = KEYS[1], ARGV[1]
if state ~= 'failed' and state ~= 'killed' then
  return redis.error_reply('ERR taskrunner: BadCall: reindex: ARGV[1] must be failed or killed; got '
    .. string.format('%q', string.sub(tostring(state), 1, 50)))
end
local indexed, skipped = 0, 0
for i = 2, #ARGV do
  local id = ARGV[i]
  local t = redis.call('ZSCORE', p .. state, id)
  local r = t and redis.call('HMGET', p .. 'job:' .. id, 'state', 'task', 'error_type')
  if r and r[1] == state then
    index_failure(p, state, id, r[2] or nil, r[3] or nil, t)
    indexed = indexed + 1
  else
    skipped = skipped + 1
  end
end
return {indexed, skipped}
