"""Server-side Lua: the one atomic step of a publish, and the careful removal of a corrupt value.

Chunk records are uploaded ahead (``SET NX EX``: content-addressed, invisible until a manifest or node points at
them, and expiring if their checkpoint is never committed). ``COMMIT`` then makes the checkpoint visible in one
script, which Redis and Valkey run atomically: it checks that every chunk is still there (else it writes nothing
and returns the missing ones), makes them persistent, writes the entry and drafter records and the manifest,
and updates the chain's node hashes and (on one server) the namespace's signature set. A reader therefore finds a
checkpoint's manifest only when all of its records were present together.

On a cluster every key the script touches must lie in one hash slot: the checkpoint's keys share its group's hash
tag (``keys.py``), and the signature set and the stats hash, which live elsewhere, are left to the caller
(``index`` 0): it adds the signature after the commit, so a reader still meets the checkpoint only whole.
"""

from __future__ import annotations

#: KEYS: manifest, entry record, sigs set, stats hash, then nd draft keys, nc chunk keys, nc + 1 node keys
#:       (with index 0 the sigs and stats keys are not touched: pass the manifest key twice in their place)
#: ARGV: nd, nc, entry record, nm, minr, complete (1/0), sig (the set member: ``auth.sig_member``), tail, host,
#:       at, bytes, index (1: also add the signature and count the stats), the stats field counting this secret's
#:       publishes (``fp:<fingerprint>``, '' for none), then nm manifest field/value pairs
#:       (``auth.manifest_fields``: the format's own), then per drafter: manifest field name, its value, record.
#:       Records arrive as stored (sealed or not).
#: Returns {0, missing chunk indices} or {1, the signature set's size after the add (0 with index 0)}.
COMMIT = """
local nd = tonumber(ARGV[1])
local nc = tonumber(ARGV[2])
local nm = tonumber(ARGV[4])
local dk, ck, nk = 4, 4 + nd, 4 + nd + nc
local missing = {}
for i = 1, nc do
  if redis.call('EXISTS', KEYS[ck + i]) == 0 then missing[#missing + 1] = i end
end
if #missing > 0 then return {0, missing} end
for i = 1, nc do redis.call('PERSIST', KEYS[ck + i]) end
redis.call('SET', KEYS[2], ARGV[3])
local a = 14 + 2 * nm
for i = 1, nd do
  redis.call('SET', KEYS[dk + i], ARGV[a + 2])
  redis.call('HSET', KEYS[1], ARGV[a], ARGV[a + 1])
  a = a + 3
end
local fields = {}
for i = 14, 13 + 2 * nm do fields[#fields + 1] = ARGV[i] end
redis.call('HSET', KEYS[1], 'host', ARGV[9], 'at', ARGV[10], unpack(fields))
local minr = tonumber(ARGV[5])
for i = 1, nc + 1 do
  local k = KEYS[nk + i]
  local c = redis.call('HGET', k, 'c')
  if c ~= '0' then redis.call('HSET', k, 'c', ARGV[6]) end
  local m = tonumber(redis.call('HGET', k, 'm') or '0') or 0
  if c == false or minr > m then redis.call('HSET', k, 'm', ARGV[5]) end
end
redis.call('HSET', KEYS[nk + nc + 1], 't:' .. ARGV[8], '1')
if ARGV[12] == '1' then
  redis.call('SADD', KEYS[3], ARGV[7])
  redis.call('HINCRBY', KEYS[4], 'checkpoints', 1)
  redis.call('HINCRBY', KEYS[4], 'bytes', ARGV[11])
  if ARGV[13] ~= '' then redis.call('HINCRBY', KEYS[4], ARGV[13], 1) end
  local n = redis.pcall('SCARD', KEYS[3])  -- an ACL without +scard: no trimming, still a commit
  if type(n) ~= 'number' then n = 0 end
  return {1, n}
end
return {1, 0}
"""

#: KEYS: one key. ARGV: the type the key should have (string, hash, set), and the sha1 hex of the string value the
#: caller read ('' if it read no string). A key of another type is deleted; a string only if it still holds exactly
#: what was read (another host may have replaced it with a good value meanwhile); a hash or set whose content was
#: unusable is deleted. Returns 1 if deleted.
DELETE_IF_UNCHANGED = """
local t = redis.call('TYPE', KEYS[1])['ok']
if t == 'none' then return 0 end
if t ~= ARGV[1] then return redis.call('DEL', KEYS[1]) end
if t == 'string' then
  if ARGV[2] ~= '' and redis.sha1hex(redis.call('GET', KEYS[1])) == ARGV[2] then return redis.call('DEL', KEYS[1]) end
  return 0
end
return redis.call('DEL', KEYS[1])
"""
