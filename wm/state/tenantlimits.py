"""A tenant's ``max_concurrency`` and ``rate_limit`` across the cluster (issue 28, point 4;
the ``tenantlimits`` feature of ``wm.dataplane.features``), both taken in one script.

- ``max_concurrency``: a sorted set per tenant (``wm:tenant-slots:{<tenant>}``) of the
  deliveries running, each scored with the time its slot expires (its time limit plus a
  grace, as ``wm.state.slots`` does for a worker's), so a slot whose holder was killed frees
  itself without a heartbeat.
- ``rate_limit``: a GCRA bucket (``wm:tenant-rate:{<tenant>}``, the theoretical arrival time
  of the next delivery, in ms): a delivery may begin ``1/rate`` seconds after the previous
  one, or earlier by a tolerance of one second's worth of deliveries (a burst of ``rate``,
  at least 1). One over the rate is told how long until it conforms.

A delivery refused by either takes neither (no slot held for a delivery that waits for the
rate, no rate spent on one that waits for a slot). The server's clock, so every node measures
alike; both keys carry the tenant's hash tag, so one script reads them on a Redis Cluster.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from wm.config import Settings
from wm.state.connection import redis_errors, redis_for

_SLOTS = "wm:tenant-slots:"
_RATE = "wm:tenant-rate:"
_BEGUN = "wm:tenant-begun:"
# KEYS: slots, rate, deliveries begun per second (a hash by second, the last few kept, for
# ``wm status``). ARGV: holder, hold ms, concurrency limit (0: none), emission interval ms
# (0: no rate), tolerance ms. Returns {1, 0} when admitted (the slot taken, if limited), {0,
# 0} when every slot is taken, {0, ms} when over the rate for ms more.
_ADMIT = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + tonumber(t[2]) / 1000
local limit, interval = tonumber(ARGV[3]), tonumber(ARGV[4])
if limit > 0 then
  redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
  if redis.call('ZCARD', KEYS[1]) >= limit then return {0, 0} end
end
if interval > 0 then
  local tat = math.max(tonumber(redis.call('GET', KEYS[2]) or '0'), now)
  local allowed = tat - tonumber(ARGV[5])
  if now < allowed then return {0, math.ceil(allowed - now)} end
  redis.call('SET', KEYS[2], tostring(tat + interval), 'PX', math.ceil(tat + interval - now) + 1000)
end
if limit > 0 then
  local hold = tonumber(ARGV[2])
  redis.call('ZADD', KEYS[1], now + hold, ARGV[1])
  if redis.call('PTTL', KEYS[1]) < hold then redis.call('PEXPIRE', KEYS[1], hold) end
end
local second = math.floor(now / 1000)
redis.call('HINCRBY', KEYS[3], second, 1)
redis.call('HDEL', KEYS[3], second - 3)
redis.call('EXPIRE', KEYS[3], 5)
return {1, 0}
"""


def slots_key(tenant: str) -> str:
    return f"{_SLOTS}{{{tenant}}}"


def rate_key(tenant: str) -> str:
    return f"{_RATE}{{{tenant}}}"


def begun_key(tenant: str) -> str:
    return f"{_BEGUN}{{{tenant}}}"


@dataclass(frozen=True)
class Refusal:
    """Why a delivery waits: every slot taken (``wait_ms`` 0), or over the rate for
    ``wait_ms`` more."""

    wait_ms: int

    @property
    def full(self) -> bool:
        return self.wait_ms == 0


class TenantGate:
    def __init__(self, settings: Settings) -> None:
        self.settings = settings

    def admit(
        self, tenant: str, holder: str, hold_s: float, concurrency: int | None, rate: float | None
    ) -> Refusal | None:
        """None when the delivery may begin now (holding one of ``concurrency`` slots, if
        given, which :meth:`release` frees); else why it waits."""
        interval_ms = 1000.0 / rate if rate else 0.0
        tolerance_ms = max(0.0, (max(1.0, float(int(rate or 0))) - 1) * interval_ms)
        with redis_errors(self.settings):
            taken, wait_ms = redis_for(self.settings).eval(
                _ADMIT,
                3,
                slots_key(tenant),
                rate_key(tenant),
                begun_key(tenant),
                holder,
                int(hold_s * 1000),
                concurrency or 0,
                repr(interval_ms),
                repr(tolerance_ms),
            )
        return None if int(taken) else Refusal(int(wait_ms))

    def release(self, tenant: str, holder: str) -> None:
        with redis_errors(self.settings):
            redis_for(self.settings).zrem(slots_key(tenant), holder)

    @contextmanager
    def holding(self, tenant: str, holder: str, concurrency: int | None) -> Iterator[None]:
        """The block runs in its slot (taken by :meth:`admit`), freed after."""
        try:
            yield
        finally:
            if concurrency:
                self.release(tenant, holder)

    def in_use(self, tenants: list[str]) -> dict[str, tuple[int, int]]:
        """Per tenant (those with a delivery limit; others have no counts): deliveries
        running now (their live slots) and begun in the last whole second, for ``wm status``."""
        with redis_errors(self.settings):
            redis = redis_for(self.settings)
            seconds, micros = redis.time()
            now_ms = seconds * 1000 + micros / 1000
            pipe = redis.pipeline(transaction=False)
            for tenant in tenants:
                pipe.zcount(slots_key(tenant), f"({now_ms!r}", "+inf")
                pipe.hget(begun_key(tenant), str(seconds - 1))
            found = pipe.execute()
        return {
            tenant: (int(found[2 * i]), int(found[2 * i + 1] or 0))
            for i, tenant in enumerate(tenants)
        }
