"""Quota state: gauges (things held now) and sliding-window rate counters, in Redis or in process.

Owns the two atomic primitives every quota is built from, with one implementation on a real Redis
(Lua scripts, so one check-and-take is one atomic step on the server, shared by every gateway
replica) and one in process (a lock; only valid with a single gateway replica, which the config
enforces):

* gauge: a hash ``member -> value`` per subject key. `acquire` takes ``member`` in every key at
  once, or in none, when for each key ``count + 1 <= max_count`` and ``sum + value <= max_sum``
  (a member already held is not counted twice, so retries are idempotent). `release` drops it.
* rate: per subject key, buckets of ``bucket_s`` seconds over a sliding ``window_s``. `charge`
  adds ``amount`` to the current bucket of every key, or to none when any key would exceed its
  limit; the denial says how long until enough old buckets expire (for ``retry-after``). The
  window counts one bucket more than ``window_s / bucket_s`` (the one the window's start falls
  in), so no real interval of ``window_s`` seconds ever holds more than the limit; the price is
  a throughput of at least ``window_s / (window_s + bucket_s)`` of it (98 % for a minute).

Time for rates is the Redis server's clock (``TIME``), so replicas with skewed clocks agree.
"""

from __future__ import annotations

import math
import threading
import time
from dataclasses import dataclass
from typing import cast


@dataclass(frozen=True, slots=True)
class GaugeCheck:
    key: str
    max_count: int | None = None
    max_sum: int | None = None


@dataclass(frozen=True, slots=True)
class RateCheck:
    key: str
    limit: int
    window_s: float
    bucket_s: float


@dataclass(frozen=True, slots=True)
class Denial:
    """Which check failed (index into the list given), on what, the current use, and (rates)
    seconds until the charge could fit."""

    index: int
    what: str  # "count" | "sum" | "rate"
    current: int
    retry_after_s: float = 0.0


_NONE = -1  # "no limit" in the Lua argument lists

_GAUGE_ACQUIRE = """
local member = ARGV[1]
local value = tonumber(ARGV[2])
for i, k in ipairs(KEYS) do
  if redis.call('HEXISTS', k, member) == 0 then
    local maxc = tonumber(ARGV[1 + 2 * i])
    local maxs = tonumber(ARGV[2 + 2 * i])
    if maxc >= 0 then
      local c = redis.call('HLEN', k)
      if c + 1 > maxc then return {i, 'count', c} end
    end
    if maxs >= 0 then
      local s = 0
      for _, v in ipairs(redis.call('HVALS', k)) do s = s + tonumber(v) end
      if s + value > maxs or s >= maxs then return {i, 'sum', s} end
    end
  end
end
for _, k in ipairs(KEYS) do
  if redis.call('HEXISTS', k, member) == 0 then redis.call('HSET', k, member, value) end
end
return 0
"""

_GAUGE_SEED = """
if redis.call('EXISTS', KEYS[2]) == 1 then return 0 end
for j = 1, #ARGV, 2 do redis.call('HSETNX', KEYS[1], ARGV[j], ARGV[j + 1]) end
redis.call('SET', KEYS[2], '1')
return 1
"""

_RATE_CHARGE = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local amount = tonumber(ARGV[1])
for i, k in ipairs(KEYS) do
  local limit = tonumber(ARGV[3 * i - 1])
  local window = tonumber(ARGV[3 * i])
  local bsz = tonumber(ARGV[3 * i + 1])
  local cur = math.floor(now / bsz)
  local nb = math.floor(window / bsz + 0.5)
  local h = redis.call('HGETALL', k)
  local used = 0
  local buckets = {}
  for j = 1, #h, 2 do
    local b = tonumber(h[j])
    local v = tonumber(h[j + 1])
    if b < cur - nb then
      redis.call('HDEL', k, h[j])
    else
      used = used + v
      table.insert(buckets, {b, v})
    end
  end
  if used + amount > limit then
    table.sort(buckets, function(a, b) return a[1] < b[1] end)
    local need = used + amount - limit
    local freed = 0
    local wait = window
    for _, bv in ipairs(buckets) do
      freed = freed + bv[2]
      if freed >= need then
        wait = (bv[1] + nb + 1) * bsz - now
        break
      end
    end
    return {i, tostring(used), tostring(wait)}
  end
end
for i, k in ipairs(KEYS) do
  local window = tonumber(ARGV[3 * i])
  local bsz = tonumber(ARGV[3 * i + 1])
  local cur = math.floor(now / bsz)
  redis.call('HINCRBY', k, string.format('%d', cur), amount)
  redis.call('EXPIRE', k, math.ceil(window + bsz) + 1)
end
return 0
"""

_RATE_ADJUST = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
for i, k in ipairs(KEYS) do
  local bsz = tonumber(ARGV[2 * i + 1])
  local cur = math.floor(now / bsz)
  if redis.call('EXISTS', k) == 1 then
    redis.call('HINCRBY', k, string.format('%d', cur), tonumber(ARGV[1]))
  end
end
return 0
"""


def _lim(v: int | None) -> int:
    return _NONE if v is None else int(v)


class RedisQuotaStore:
    """The store on a real redis-server (``redis.asyncio``); safe across gateway replicas."""

    def __init__(self, url: str, prefix: str = "twinkle:quota:") -> None:
        import redis.asyncio as aioredis

        # A bounded, blocking pool: a burst of requests waits for a connection instead of opening
        # hundreds at once; generous timeouts because a quota check must not fail on a busy host.
        pool = aioredis.BlockingConnectionPool.from_url(
            url,
            decode_responses=True,
            max_connections=32,
            timeout=30,
            socket_connect_timeout=30,
            socket_timeout=30,
        )
        self._redis = aioredis.Redis(connection_pool=pool)
        self.prefix = prefix
        self._acquire = self._redis.register_script(_GAUGE_ACQUIRE)
        self._seed = self._redis.register_script(_GAUGE_SEED)
        self._charge = self._redis.register_script(_RATE_CHARGE)
        self._adjust = self._redis.register_script(_RATE_ADJUST)

    def _k(self, key: str) -> str:
        return self.prefix + key

    async def acquire(self, checks: list[GaugeCheck], member: str, value: int = 1) -> Denial | None:
        args: list[str | int | float] = [member, int(value)]
        for c in checks:
            args += [_lim(c.max_count), _lim(c.max_sum)]
        res = await self._acquire(keys=[self._k(c.key) for c in checks], args=args)
        if res == 0:
            return None
        return Denial(int(res[0]) - 1, str(res[1]), int(res[2]))

    async def set_value(self, keys: list[str], member: str, value: int) -> None:
        async with self._redis.pipeline(transaction=True) as p:
            for k in keys:
                p.hset(self._k(k), member, int(value))
            await p.execute()

    async def release(self, keys: list[str], member: str) -> None:
        async with self._redis.pipeline(transaction=True) as p:
            for k in keys:
                p.hdel(self._k(k), member)
            await p.execute()

    async def gauge(self, key: str) -> dict[str, int]:
        # the pool decodes responses, so members are str (the stubs cannot know that)
        raw = cast("dict[str, str]", await self._redis.hgetall(self._k(key)))
        return {m: int(v) for m, v in raw.items()}

    async def is_seeded(self, key: str) -> bool:
        return bool(await self._redis.exists(self._k(key) + ":seeded"))

    async def seed(self, key: str, members: dict[str, int]) -> None:
        args: list[str | int | float] = []
        for m, v in members.items():
            args += [m, int(v)]
        await self._seed(keys=[self._k(key), self._k(key) + ":seeded"], args=args)

    async def charge(self, checks: list[RateCheck], amount: int) -> Denial | None:
        args: list[str | int | float] = [int(amount)]
        for c in checks:
            args += [int(c.limit), float(c.window_s), float(c.bucket_s)]
        res = await self._charge(keys=[self._k(c.key) for c in checks], args=args)
        if res == 0:
            return None
        return Denial(int(res[0]) - 1, "rate", int(float(res[1])), max(0.0, float(res[2])))

    async def adjust(self, checks: list[RateCheck], amount: int) -> None:
        args: list[str | int | float] = [int(amount)]
        for c in checks:
            args += [float(c.window_s), float(c.bucket_s)]
        await self._adjust(keys=[self._k(c.key) for c in checks], args=args)

    async def used(self, check: RateCheck) -> int:
        now = float((await self._redis.time())[0])
        raw = await self._redis.hgetall(self._k(check.key))
        return _sum_window(raw, now, check)

    async def aclose(self) -> None:
        await self._redis.aclose(close_connection_pool=True)


def _sum_window(raw: dict, now: float, c: RateCheck) -> int:
    cur = math.floor(now / c.bucket_s)
    nb = math.floor(c.window_s / c.bucket_s + 0.5)
    return sum(int(v) for b, v in raw.items() if int(b) >= cur - nb)


class MemoryQuotaStore:
    """The same semantics in this process (one gateway replica only)."""

    def __init__(self, clock=time.time) -> None:
        self._lock = threading.Lock()
        self._gauges: dict[str, dict[str, int]] = {}
        self._seeded: set[str] = set()
        self._rates: dict[str, dict[int, int]] = {}
        self._clock = clock

    async def acquire(self, checks: list[GaugeCheck], member: str, value: int = 1) -> Denial | None:
        with self._lock:
            for i, c in enumerate(checks):
                g = self._gauges.get(c.key, {})
                if member in g:
                    continue
                if c.max_count is not None and len(g) + 1 > c.max_count:
                    return Denial(i, "count", len(g))
                s = sum(g.values())
                if c.max_sum is not None and (s + value > c.max_sum or s >= c.max_sum):
                    return Denial(i, "sum", s)
            for c in checks:
                self._gauges.setdefault(c.key, {}).setdefault(member, int(value))
        return None

    async def set_value(self, keys: list[str], member: str, value: int) -> None:
        with self._lock:
            for k in keys:
                self._gauges.setdefault(k, {})[member] = int(value)

    async def release(self, keys: list[str], member: str) -> None:
        with self._lock:
            for k in keys:
                self._gauges.get(k, {}).pop(member, None)

    async def gauge(self, key: str) -> dict[str, int]:
        with self._lock:
            return dict(self._gauges.get(key, {}))

    async def is_seeded(self, key: str) -> bool:
        return key in self._seeded

    async def seed(self, key: str, members: dict[str, int]) -> None:
        with self._lock:
            if key in self._seeded:
                return
            g = self._gauges.setdefault(key, {})
            for m, v in members.items():
                g.setdefault(m, int(v))
            self._seeded.add(key)

    async def charge(self, checks: list[RateCheck], amount: int) -> Denial | None:
        now = self._clock()
        with self._lock:
            for i, c in enumerate(checks):
                cur = math.floor(now / c.bucket_s)
                nb = math.floor(c.window_s / c.bucket_s + 0.5)
                h = self._rates.setdefault(c.key, {})
                for b in [b for b in h if b < cur - nb]:
                    del h[b]
                used = sum(h.values())
                if used + amount > c.limit:
                    need, freed, wait = used + amount - c.limit, 0, c.window_s
                    for b in sorted(h):
                        freed += h[b]
                        if freed >= need:
                            wait = (b + nb + 1) * c.bucket_s - now
                            break
                    return Denial(i, "rate", used, max(0.0, wait))
            for c in checks:
                cur = math.floor(now / c.bucket_s)
                h = self._rates[c.key]
                h[cur] = h.get(cur, 0) + int(amount)
        return None

    async def adjust(self, checks: list[RateCheck], amount: int) -> None:
        now = self._clock()
        with self._lock:
            for c in checks:
                if c.key in self._rates:
                    cur = math.floor(now / c.bucket_s)
                    h = self._rates[c.key]
                    h[cur] = h.get(cur, 0) + int(amount)

    async def used(self, check: RateCheck) -> int:
        with self._lock:
            return _sum_window(dict(self._rates.get(check.key, {})), self._clock(), check)

    async def aclose(self) -> None:
        return None


QuotaStore = RedisQuotaStore | MemoryQuotaStore
