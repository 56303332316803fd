"""The Redis side of quotas: one Lua script admits a request atomically for every web process.

Keys per user (prefix `quota`):
  {p}:{uid}:rpm          sorted set, reservation id -> admission time (ms); a 60 s sliding window
  {p}:{uid}:conc         sorted set, reservation id -> lease expiry (ms); expired leases free the slot
  {p}:{uid}:d:YYYYMMDD   tokens used or reserved today (UTC)
  {p}:{uid}:m:YYYYMM     tokens used or reserved this month (UTC)
  {p}:res:{rid}          hash describing one reservation; `settled` makes settlement idempotent
Background sources (batches) count in their own rpm/conc sets ({p}:{uid}:rpm:batch, ...), so a
running batch never takes the user's interactive slots; tokens are one budget for every source.
No Django imports: the multi-process tests drive this module directly.
"""

from __future__ import annotations

import calendar
import logging
import time
import uuid
from collections import deque
from dataclasses import asdict, dataclass, field
from datetime import datetime, timedelta, timezone

import redis

from .limits import PlanLimits

log = logging.getLogger(__name__)

UNLIMITED = -1
DAY_TTL_S = 2 * 86400
MONTH_TTL_S = 32 * 86400
RESERVATION_TTL_S = 3 * 86400
BACKGROUND_SOURCES = ("batch",)

# Checks every limit first, then applies every counter, so a refusal changes nothing.
RESERVE_LUA = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local rid = ARGV[1]
local rpm_limit, conc_limit = tonumber(ARGV[2]), tonumber(ARGV[3])
local day_limit, month_limit = tonumber(ARGV[4]), tonumber(ARGV[5])
local tokens, lease_ms = tonumber(ARGV[6]), tonumber(ARGV[7])

redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now - 60000)
redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', now)
local rpm_used = redis.call('ZCARD', KEYS[1])
if rpm_limit >= 0 and rpm_used >= rpm_limit then
  local oldest = redis.call('ZRANGE', KEYS[1], 0, 0, 'WITHSCORES')
  local wait = 60000
  if oldest[2] then wait = tonumber(oldest[2]) + 60000 - now end
  return {'refused', 'requests_per_minute', wait}
end
local conc_used = redis.call('ZCARD', KEYS[2])
if conc_limit >= 0 and conc_used >= conc_limit then
  return {'refused', 'concurrent_requests', 1000}
end
local day_used = tonumber(redis.call('GET', KEYS[3]) or '0')
if day_limit >= 0 and day_used + tokens > day_limit then
  return {'refused', 'tokens_per_day', tonumber(ARGV[8]) * 1000}
end
local month_used = tonumber(redis.call('GET', KEYS[4]) or '0')
if month_limit >= 0 and month_used + tokens > month_limit then
  return {'refused', 'tokens_per_month', tonumber(ARGV[9]) * 1000}
end

redis.call('ZADD', KEYS[1], now, rid)
redis.call('PEXPIRE', KEYS[1], 61000)
redis.call('ZADD', KEYS[2], now + lease_ms, rid)
redis.call('PEXPIRE', KEYS[2], lease_ms + 1000)
redis.call('INCRBY', KEYS[3], tokens)
redis.call('EXPIRE', KEYS[3], ARGV[10])
redis.call('INCRBY', KEYS[4], tokens)
redis.call('EXPIRE', KEYS[4], ARGV[11])
redis.call('HSET', KEYS[5], 'tokens', tokens, 'settled', '0', 'created_ms', now)
redis.call('EXPIRE', KEYS[5], ARGV[12])
local oldest = redis.call('ZRANGE', KEYS[1], 0, 0, 'WITHSCORES')
return {'ok', rpm_used + 1, conc_used + 1, day_used + tokens, month_used + tokens, tonumber(oldest[2]) + 60000 - now}
"""

# Replaces the reserved tokens by the actual ones and frees the slot, once.
SETTLE_LUA = """
if redis.call('HGET', KEYS[1], 'settled') ~= '0' then return 0 end
local actual = tonumber(ARGV[1])
local delta = actual - tonumber(redis.call('HGET', KEYS[1], 'tokens'))
for i = 3, 4 do
  if delta ~= 0 and redis.call('EXISTS', KEYS[i]) == 1 then
    local left = redis.call('INCRBY', KEYS[i], delta)
    if left < 0 then redis.call('SET', KEYS[i], 0, 'KEEPTTL') end
  end
end
redis.call('ZREM', KEYS[2], ARGV[2])
redis.call('HSET', KEYS[1], 'settled', '1', 'actual', actual)
return 1
"""

# Extends a live reservation's concurrency lease (long streams call it periodically).
RENEW_LUA = """
if not redis.call('ZSCORE', KEYS[1], ARGV[1]) then return 0 end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('ZADD', KEYS[1], now + tonumber(ARGV[2]), ARGV[1])
redis.call('PEXPIRE', KEYS[1], tonumber(ARGV[2]) + 1000)
return 1
"""


@dataclass(frozen=True)
class Usage:
    """Live counters of one user."""

    requests_last_minute: int
    concurrent: int
    tokens_today: int
    tokens_this_month: int
    requests_reset_s: float


@dataclass(frozen=True)
class Reservation:
    """A handle to reserved quota; serialisable (as_dict/from_dict) so a task can settle it later.
    `usage` is the user's counters right after this admission (the x-ratelimit headers), not serialised."""

    id: str
    user_id: int
    model: str
    source: str
    prompt_tokens: int
    max_tokens: int
    reserved_tokens: int
    rpm_key: str
    conc_key: str
    day_key: str
    month_key: str
    res_key: str
    usage: Usage | None = field(default=None, compare=False)

    def as_dict(self) -> dict:
        return {name: value for name, value in asdict(self).items() if name != "usage"}

    @classmethod
    def from_dict(cls, data: dict) -> "Reservation":
        return cls(**data)


@dataclass(frozen=True)
class Refusal:
    limit: str
    retry_after_s: int


def seconds_until_next_day(now: datetime) -> int:
    tomorrow = (now + timedelta(days=1)).replace(hour=0, minute=0, second=0, microsecond=0)
    return max(1, int((tomorrow - now).total_seconds()))


def seconds_until_next_month(now: datetime) -> int:
    days = calendar.monthrange(now.year, now.month)[1]
    first_next = now.replace(day=1, hour=0, minute=0, second=0, microsecond=0) + timedelta(days=days)
    return max(1, int((first_next - now).total_seconds()))


def _limit_arg(value: int | None) -> int:
    return UNLIMITED if value is None else int(value)


class QuotaLedger:
    """Atomic admission, lease renewal and settlement against one Redis."""

    def __init__(self, redis_client, prefix: str = "quota", lease_seconds: int = 120):
        self.redis = redis_client
        self.prefix = prefix
        self.lease_ms = int(lease_seconds * 1000)
        self._reserve = redis_client.register_script(RESERVE_LUA)
        self._settle = redis_client.register_script(SETTLE_LUA)
        self._renew = redis_client.register_script(RENEW_LUA)
        self._unsettled: deque[tuple[Reservation, int]] = deque()  # settlements Redis was away for (thread-safe)

    def user_keys(self, user_id: int, now: datetime | None = None, source: str = "") -> dict[str, str]:
        now = now or datetime.now(timezone.utc)
        base = f"{self.prefix}:{user_id}"
        slots = ":batch" if source in BACKGROUND_SOURCES else ""
        return {
            "rpm": f"{base}:rpm{slots}",
            "conc": f"{base}:conc{slots}",
            "day": f"{base}:d:{now:%Y%m%d}",
            "month": f"{base}:m:{now:%Y%m}",
        }

    def reserve(
        self,
        user_id: int,
        limits: PlanLimits,
        tokens: int,
        *,
        model: str = "",
        source: str = "",
        prompt_tokens: int = 0,
        max_tokens: int = 0,
    ) -> Reservation | Refusal:
        """Admit one request and reserve `tokens`, or say which limit refused it and when to retry."""
        self.retry_unsettled()  # slots of requests that ended during an outage come back first
        now = datetime.now(timezone.utc)
        keys = self.user_keys(user_id, now, source)
        rid = uuid.uuid4().hex
        res_key = f"{self.prefix}:res:{rid}"
        result = self._reserve(
            keys=[keys["rpm"], keys["conc"], keys["day"], keys["month"], res_key],
            args=[
                rid,
                _limit_arg(limits.requests_per_minute),
                _limit_arg(limits.concurrent_requests),
                _limit_arg(limits.tokens_per_day),
                _limit_arg(limits.tokens_per_month),
                int(tokens),
                self.lease_ms,
                seconds_until_next_day(now),
                seconds_until_next_month(now),
                DAY_TTL_S,
                MONTH_TTL_S,
                RESERVATION_TTL_S,
            ],
        )
        status = _text(result[0])
        if status != "ok":
            return Refusal(limit=_text(result[1]), retry_after_s=max(1, -(-int(result[2]) // 1000)))
        usage = Usage(
            requests_last_minute=int(result[1]),
            concurrent=int(result[2]),
            tokens_today=int(result[3]),
            tokens_this_month=int(result[4]),
            requests_reset_s=max(0.0, int(result[5]) / 1000),
        )
        return Reservation(
            id=rid,
            user_id=user_id,
            model=model,
            source=source,
            prompt_tokens=prompt_tokens,
            max_tokens=max_tokens,
            reserved_tokens=int(tokens),
            rpm_key=keys["rpm"],
            conc_key=keys["conc"],
            day_key=keys["day"],
            month_key=keys["month"],
            res_key=res_key,
            usage=usage,
        )

    def settle(self, reservation: Reservation, actual_tokens: int) -> bool:
        """Charge the actual tokens instead of the reserved ones and free the slot; False if already settled.

        Redis unreachable: the settlement waits in this process and is applied before its next ledger
        call (settle, reserve, renew), so the slot comes back as soon as Redis does, not when its lease ends.
        """
        try:
            self.retry_unsettled()
            return self._settle_now(reservation, actual_tokens)
        except redis.RedisError:
            self._unsettled.append((reservation, int(actual_tokens)))
            log.warning("settling reservation %s failed; retrying once Redis answers", reservation.id, exc_info=True)
            return False

    def retry_unsettled(self) -> int:
        """Apply the settlements that failed while Redis was away; how many were applied. Raises Redis's
        error while some cannot be applied yet: counters without them are stale, so nobody is admitted
        or refused against them."""
        applied = 0
        while self._unsettled:
            try:
                reservation, tokens = self._unsettled.popleft()
            except IndexError:  # another thread took the last one
                break
            try:
                self._settle_now(reservation, tokens)  # idempotent: one applied before the reply was lost gives 0
            except redis.RedisError:
                self._unsettled.appendleft((reservation, tokens))  # still away: the next call tries again
                raise
            applied += 1
        return applied

    def _settle_now(self, reservation: Reservation, actual_tokens: int) -> bool:
        keys = [reservation.res_key, reservation.conc_key, reservation.day_key, reservation.month_key]
        return bool(self._settle(keys=keys, args=[max(0, int(actual_tokens)), reservation.id]))

    def renew(self, reservation: Reservation) -> bool:
        """Keep the concurrency slot of a still-running request; False once settled or expired."""
        self.retry_unsettled()
        return bool(self._renew(keys=[reservation.conc_key], args=[reservation.id, self.lease_ms]))

    def usage(self, user_id: int) -> Usage:
        keys = self.user_keys(user_id)
        now_ms = time.time() * 1000
        pipe = self.redis.pipeline()
        pipe.zcount(keys["rpm"], now_ms - 60000, "+inf")
        pipe.zcount(keys["conc"], now_ms, "+inf")
        pipe.get(keys["day"])
        pipe.get(keys["month"])
        pipe.zrangebyscore(keys["rpm"], now_ms - 60000, "+inf", start=0, num=1, withscores=True)
        rpm, conc, day, month, oldest = pipe.execute()
        reset = max(0.0, (oldest[0][1] + 60000 - now_ms) / 1000) if oldest else 0.0
        return Usage(
            requests_last_minute=int(rpm),
            concurrent=int(conc),
            tokens_today=int(day or 0),
            tokens_this_month=int(month or 0),
            requests_reset_s=reset,
        )

    def is_settled(self, reservation: Reservation) -> bool:
        return _text(self.redis.hget(reservation.res_key, "settled")) == "1"


def _text(value) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
