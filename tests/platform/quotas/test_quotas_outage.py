"""Settlement survives a Redis outage: a request that ends while Redis is away gets its concurrency
slot back as soon as Redis answers again, not when its lease runs out (chaos: Redis kill under load)."""

from __future__ import annotations

import subprocess
import tempfile
from pathlib import Path

import pytest
import redis

from quotas.ledger import QuotaLedger
from quotas.limits import PlanLimits
from tessera import embedded_redis

ONE_AT_A_TIME = PlanLimits(name="one", concurrent_requests=1)


class RestartableRedis:
    """A private redis-server with an append-only file (fsync always), stopped and started on one port."""

    def __init__(self, data_dir: Path):
        self.data_dir, self.port = data_dir, embedded_redis.free_port()
        self.proc: subprocess.Popen | None = None

    def start(self) -> str:
        command = embedded_redis.server_command(self.port, self.data_dir, persistent=True)
        command[command.index("everysec")] = "always"  # nothing acknowledged is lost by the kill
        self.proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        redis_url = embedded_redis.url(self.port, embedded_redis.password(self.data_dir))
        embedded_redis.wait_until_ready(redis_url, self.proc)  # loaded its append-only file, not just listening
        return redis_url

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait(10)


@pytest.fixture
def server():
    with tempfile.TemporaryDirectory(prefix="quota-outage-") as data_dir:
        running = RestartableRedis(Path(data_dir))
        yield running
        if running.proc and running.proc.poll() is None:
            running.kill()


def test_a_settlement_that_failed_during_an_outage_frees_the_slot_once_redis_is_back(server):
    url = server.start()
    ledger = QuotaLedger(redis.Redis.from_url(url, socket_timeout=5), prefix="outage", lease_seconds=120)
    held = ledger.reserve(7, ONE_AT_A_TIME, 100)
    assert ledger.reserve(7, ONE_AT_A_TIME, 100).limit == "concurrent_requests"  # the one slot is taken

    server.kill()
    assert ledger.settle(held, 42) is False  # Redis is away: kept for later, not raised, not dropped
    with pytest.raises(redis.ConnectionError):  # admission still needs Redis (the web tier answers 503)
        ledger.reserve(7, ONE_AT_A_TIME, 100)

    server.start()  # same port, same data: the held slot is still in the restarted Redis
    admitted = ledger.reserve(7, ONE_AT_A_TIME, 100)  # the queued settlement ran first
    assert not hasattr(admitted, "limit"), admitted
    assert ledger.is_settled(held)
    assert int(ledger.redis.get(held.day_key)) == 42 + 100  # the real tokens of the first, reserved ones of the second
    assert ledger.retry_unsettled() == 0


def test_settlements_waiting_for_redis_are_applied_once_each(server):
    url = server.start()
    ledger = QuotaLedger(redis.Redis.from_url(url, socket_timeout=5), prefix="outage", lease_seconds=120)
    unlimited = PlanLimits(name="free")
    reservations = [ledger.reserve(8, unlimited, 10) for _ in range(3)]
    server.kill()
    for reservation in reservations:
        ledger.settle(reservation, 1)
    ledger.settle(reservations[0], 1)  # a second settle of the same request while away
    server.start()
    assert ledger.retry_unsettled() == 4
    assert all(ledger.is_settled(r) for r in reservations)
    assert int(ledger.redis.get(reservations[0].day_key)) == 3  # each charged its 1 token once
    assert ledger.usage(8).concurrent == 0
