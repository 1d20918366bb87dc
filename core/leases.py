"""Leases in Redis sorted sets: the one protocol behind admission slots and engine caps shared by replicas.

A limit shared by every replica is a sorted set (its *main key*): each member is one lease, named by its
lease id (``<replica id>:<n>``) and scored by its expiry in milliseconds of the Redis server's clock
(``TIME``), so the replicas' clocks never matter. A lease may also be counted in one *tenant key*, a
second sorted set for a tenant's quota, under the same id and expiry. Every script that counts first
removes the expired members, and every script that writes sets the keys' own expiry to the TTL, so a set
nobody writes to any more disappears by itself. Each script is atomic: Redis runs one at a time.

- :data:`ACQUIRE_LUA` decides a batch of requests in arrival order, each exactly as if alone: refused
  when its tenant key already holds its quota (:data:`REFUSED_QUOTA`), refused when the main key already
  holds its hard limit (:data:`REFUSED_LIMIT`), otherwise taken (:data:`GRANTED`: added to the main key and
  to its tenant key). Each answer is ``[code, leases in the main key before, in its tenant key before]``.
- :data:`RELEASE_LUA` removes leases from the main key and their tenant keys (a missing one is no error).
- :data:`RENEW_LUA` pushes the expiry of the leases still there to now + TTL and returns the ids of those
  that are not (expired or removed): they are not brought back.
- :data:`COUNT_LUA` counts the live leases of a main key.

Its users: the gateway's admission slots (gateway/admission_redis.py: one main key for every request, a
tenant key per tenant with a quota) and the engines' caps (engines/selection/shared_caps.py: one main key
per engine, the engine's cap as the hard limit, no tenant key). Renewing is the holder's job: a lease is
renewed on a heartbeat only while the request holding it lives, so a dead replica's leases expire one TTL
after its last heartbeat. The helpers below build a script call's KEYS and ARGV; nothing here talks to Redis.
"""

from __future__ import annotations

from collections.abc import Iterable

#: the codes of an acquire's answer
GRANTED, REFUSED_QUOTA, REFUSED_LIMIT = 1, 2, 3

_NOW = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
"""

# KEYS[1] the main key, KEYS[2..] tenant keys
# ARGV[1] ttl ms, then per request: lease id, hard limit, tenant quota, index into KEYS of its tenant key (0: none)
# -> per request {code, leases in the main key before, in its tenant key before}
ACQUIRE_LUA = (
    _NOW
    + """
local ttl = tonumber(ARGV[1])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
local n = redis.call('ZCARD', KEYS[1])
local tn = {}
for k = 2, #KEYS do
  redis.call('ZREMRANGEBYSCORE', KEYS[k], '-inf', now)
  tn[k] = redis.call('ZCARD', KEYS[k])
end
local out = {}
for i = 2, #ARGV, 4 do
  local lease, hard, quota, k = ARGV[i], tonumber(ARGV[i + 1]), tonumber(ARGV[i + 2]), tonumber(ARGV[i + 3])
  local t = 0
  if k > 0 then t = tn[k] end
  if k > 0 and t >= quota then
    out[#out + 1] = {2, n, t}
  elseif n >= hard then
    out[#out + 1] = {3, n, t}
  else
    redis.call('ZADD', KEYS[1], now + ttl, lease)
    if k > 0 then
      redis.call('ZADD', KEYS[k], now + ttl, lease)
      tn[k] = t + 1
    end
    out[#out + 1] = {1, n, t}
    n = n + 1
  end
end
for k = 1, #KEYS do
  if redis.call('EXISTS', KEYS[k]) == 1 then redis.call('PEXPIRE', KEYS[k], ttl) end
end
return out
"""
)

# KEYS[1] the main key, KEYS[2..] tenant keys; ARGV: (lease id, index into KEYS or 0) pairs -> leases removed
RELEASE_LUA = """
local removed = 0
for i = 1, #ARGV, 2 do
  removed = removed + redis.call('ZREM', KEYS[1], ARGV[i])
  local k = tonumber(ARGV[i + 1])
  if k > 0 then redis.call('ZREM', KEYS[k], ARGV[i]) end
end
return removed
"""

# KEYS[1] the main key, KEYS[2..] tenant keys; ARGV[1] ttl ms, then (lease id, index into KEYS or 0) pairs
# -> the lease ids that were no longer there (expired or removed); they are not brought back
RENEW_LUA = (
    _NOW
    + """
local exp = now + tonumber(ARGV[1])
local lost = {}
for i = 2, #ARGV, 2 do
  local lease = ARGV[i]
  if redis.call('ZSCORE', KEYS[1], lease) then
    redis.call('ZADD', KEYS[1], 'XX', exp, lease)
    local k = tonumber(ARGV[i + 1])
    if k > 0 then redis.call('ZADD', KEYS[k], 'XX', exp, lease) end
  else
    lost[#lost + 1] = lease
  end
end
for i = 1, #KEYS do
  if redis.call('EXISTS', KEYS[i]) == 1 then redis.call('PEXPIRE', KEYS[i], ARGV[1]) end
end
return lost
"""
)

# KEYS[1] the main key -> live leases
COUNT_LUA = (
    _NOW
    + """
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
return redis.call('ZCARD', KEYS[1])
"""
)

Args = list[str | int]


class _Keys:
    """One call's KEYS: the main key first, then each tenant key once, in the order first asked for."""

    __slots__ = ("_at", "keys")

    def __init__(self, main: str) -> None:
        self.keys = [main]
        self._at: dict[str, int] = {}

    def index(self, key: str | None) -> int:
        """Where ``key`` is in KEYS, counted from 1 as Lua does (0: no tenant key)."""
        if key is None:
            return 0
        at = self._at.get(key)
        if at is None:
            self.keys.append(key)
            at = self._at[key] = len(self.keys)
        return at


def acquire_call(
    main: str, ttl_ms: int, requests: Iterable[tuple[str, int, int | None, str | None]]
) -> tuple[list[str], Args]:
    """KEYS and ARGV of :data:`ACQUIRE_LUA` for ``(lease id, hard limit, tenant quota, tenant key)`` requests."""
    keys = _Keys(main)
    args: Args = [ttl_ms]
    for lease, hard, quota, tenant_key in requests:
        args += [lease, hard, quota or 0, keys.index(tenant_key)]
    return keys.keys, args


def release_call(main: str, leases: Iterable[tuple[str, str | None]]) -> tuple[list[str], Args]:
    """KEYS and ARGV of :data:`RELEASE_LUA` for ``(lease id, tenant key or None)`` pairs."""
    keys = _Keys(main)
    args: Args = []
    for lease, tenant_key in leases:
        args += [lease, keys.index(tenant_key)]
    return keys.keys, args


def renew_call(main: str, ttl_ms: int, leases: Iterable[tuple[str, str | None]]) -> tuple[list[str], Args]:
    """KEYS and ARGV of :data:`RENEW_LUA` for ``(lease id, tenant key or None)`` pairs."""
    keys, args = release_call(main, leases)
    return keys, [ttl_ms, *args]


def lease_ids(raw: Iterable[object]) -> list[str]:
    """The lease ids of a script's answer (bytes or str, as the client decodes them)."""
    return [r.decode() if isinstance(r, bytes) else str(r) for r in raw]
