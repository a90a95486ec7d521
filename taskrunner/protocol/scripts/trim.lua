-- Trim a queue's history stream: remove its entries before a stream id, and take their extra
-- records off `history:extra`, in one call, so that no death leaves the count wrong. The
-- stream holds XLEN + history:extra records (an entry of a finish call's many records adds
-- its others there: flush_history() in _lib.lua), which the dispatchers keep within the cap
-- and the archiver and `history status` read without reading the stream. The caller (the
-- archiver, or the dispatchers' cap) holds `p history:lock` and has read what it trims.
-- KEYS[1]  queue key prefix p
-- ARGV[1]  the first stream id kept ("<ms>-<seq>"): every entry before it is removed
-- ARGV[2]  the extra records of the entries removed (the sum over them of records - 1: a
--          whole number >= 0)
-- ARGV[3]  (optional) "1": also forget `p history:batch`, the range a dead archiver began
--          (the cap trims through it: see cap() in taskrunner/ops/history.py)
-- Returns the number of entries removed. history:extra never goes below 0, and goes with
-- the stream's last entry (an empty stream holds no record: any count left over is wrong).
local p = KEYS[1]
if not string.find(ARGV[1], '^%d+%-%d+$') then
  return redis.error_reply('ERR trim: ARGV[1] must be a stream id (<ms>-<seq>), the first entry kept')
end
local extra = tonumber(ARGV[2])
if not extra or extra < 0 or extra % 1 ~= 0 then
  return redis.error_reply('ERR trim: ARGV[2] must be the extra records removed, a whole number >= 0')
end
if ARGV[3] ~= nil and ARGV[3] ~= '0' and ARGV[3] ~= '1' then
  return redis.error_reply('ERR trim: ARGV[3] must be "1" (forget history:batch) or "0"')
end
local removed = redis.call('XTRIM', p .. 'history', 'MINID', ARGV[1])
if ARGV[3] == '1' then
  redis.call('DEL', p .. 'history:batch')
end
if redis.call('XLEN', p .. 'history') == 0 then
  redis.call('DEL', p .. 'history:extra')
elseif extra > 0 and redis.call('DECRBY', p .. 'history:extra', extra) <= 0 then
  redis.call('DEL', p .. 'history:extra')
end
return removed
