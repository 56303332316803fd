"""Run as a separate process by test_quotas_concurrency.py: N threads call the ledger at the same instant.

argv: redis_url prefix user_id threads tokens start_at limits_json; prints one JSON list of outcomes.
"""

import json
import sys
import threading
import time

import redis

from quotas.ledger import QuotaLedger, Reservation
from quotas.limits import PlanLimits


def main() -> None:
    url, prefix, user_id, threads, tokens, start_at, limits_json = sys.argv[1:8]
    ledger = QuotaLedger(redis.Redis.from_url(url, max_connections=64), prefix=prefix)
    limits = PlanLimits.from_mapping(json.loads(limits_json))
    outcomes: list[dict] = []
    lock = threading.Lock()

    def one() -> None:
        time.sleep(max(0.0, float(start_at) - time.time()))
        result = ledger.reserve(int(user_id), limits, int(tokens))
        row = (
            {"ok": True, "reservation": result.as_dict()}
            if isinstance(result, Reservation)
            else {"ok": False, "limit": result.limit, "retry_after": result.retry_after_s}
        )
        with lock:
            outcomes.append(row)

    workers = [threading.Thread(target=one) for _ in range(int(threads))]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    print(json.dumps(outcomes))


if __name__ == "__main__":
    main()
