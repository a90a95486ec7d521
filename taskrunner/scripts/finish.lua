-- Record how deliveries ended (ack many in one round trip), fenced by delivery.
-- KEYS[1]  queue key prefix
-- ARGV[1]  result TTL (s)   ARGV[2] retry backoff cap (s)
-- then 7 values per job: id, attempt, outcome, v1, v2, v3, v4 where outcome is
--   completed  v1 = result JSON
--   failed     v1 = error type, v2 = message, v3 = traceback         (final)
--   error      as failed, v4 = jitter factor: retried with backoff while retries remain
--   killed     v2 = reason
--   requeue    v1 = delay (s), v2 = "front" to put it next in line
--   lost       v1 = why its process died (requeue, or WorkerLost after max_lost)
-- Returns one integer per job: 1 applied; 0 fenced off (another delivery holds the job);
-- 2 nothing to do (this delivery was already released, e.g. a retried call).
-- An exclusive queue with jobs waiting gets a wake token (its next job may run now).
local p = KEYS[1]
local ttl, cap = tonumber(ARGV[1]), tonumber(ARGV[2])
local t = now()
local out = {}
for i = 3, #ARGV, 7 do
  local id, attempt, outcome = ARGV[i], ARGV[i + 1], ARGV[i + 2]
  local v1, v2, v3, v4 = ARGV[i + 3], ARGV[i + 4], ARGV[i + 5], ARGV[i + 6]
  local job = p .. 'job:' .. id
  local r = load(job)
  local held = holder_check(p, id, r, attempt, true)
  out[#out + 1] = held
  if held == 1 then
    if outcome == 'lost' then
      lose(p, id, job, r, attempt, t, ttl, v1, true)
    else
      release(p, id, r, true)
      if outcome == 'completed' then
        local ek, ev = ended(attempt, t, 'completed')
        finalize(p, id, job, r, 'completed', t, ttl, {'result', v1, ek, ev}, nil)
      elseif outcome == 'killed' then
        local ek, ev = ended(attempt, t, 'killed')
        finalize(p, id, job, r, 'killed', t, ttl, {'error_type', 'Killed', 'error', v2, ek, ev}, 'Killed')
      elseif outcome == 'requeue' then
        redis.call('HINCRBY', job, 'requeues', 1)
        history(p, id, r, 'requeued', t, nil)
        local delay = tonumber(v1) or 0
        local ek, ev = ended(attempt, t, v2 == 'front' and 'requeued: worker shutting down'
          or string.format('requeued itself (Retry, %gs)', delay))
        local extra = {'last_requeued_at', fmt(t), ek, ev}
        if delay > 0 then
          to_delayed(p, id, job, t + delay, extra)
        else
          to_pending(p, id, job, v2 == 'front', extra)
        end
      else
        local failures = redis.call('HINCRBY', job, 'failures', 1)
        local retries = tonumber(r.retries) or 0
        if outcome == 'error' and failures <= retries then
          history(p, id, r, 'requeued', t, v1)
          local base = tonumber(r.retry_backoff) or 1
          local delay = math.min(base * 2 ^ (failures - 1), cap) * (tonumber(v4) or 1)
          local ek, ev = ended(attempt, t, string.format('failed %s, retry %d of %d in %.2fs', v1, failures,
            retries, delay))
          to_delayed(p, id, job, t + delay, {'error_type', v1, 'error', v2, 'traceback', v3, ek, ev})
        else
          local ek, ev = ended(attempt, t, 'failed ' .. v1)
          finalize(p, id, job, r, 'failed', t, ttl, {'error_type', v1, 'error', v2, 'traceback', v3, ek, ev}, v1)
        end
      end
    end
  end
end
if redis.call('HGET', p .. 'meta', 'exclusive') == '1' and redis.call('LLEN', p .. 'pending') > 0 then
  wake(p)
end
return out
