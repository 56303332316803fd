"""Realistic synthetic usage for demos and tests (`manage.py generate_usage`).

Shapes that a real deployment shows: a daily cycle with quieter weekends, a few heavy users and a
long tail, API traffic with keys, interactive playground chats with prefix-cache hits, nightly batch
bursts, log-normal token counts and latencies that grow with prompt length and load, and a few
per cent of 429s and errors.
"""

from __future__ import annotations

import contextlib
import math
import random
from dataclasses import dataclass
from datetime import datetime, timedelta

from django.contrib.auth import get_user_model
from django.db import transaction
from django.utils import timezone

from usage.models import UsageRecord

MODELS = {  # name -> (share of traffic, TPOT median ms, prefill ms per prompt token)
    "SmolLM2-135M-Instruct": (0.55, 18.0, 0.08),
    "llama-3.2-1b-instruct": (0.30, 32.0, 0.15),
    "qwen2.5-7b-instruct": (0.15, 65.0, 0.45),
}
USERNAME_PREFIX = "demo-user-"


@dataclass
class DemoUser:
    user: object
    weight: float  # share of all traffic
    sources: dict[str, float]  # source -> share of this user's traffic
    key_ids: list[int]
    model: str  # favourite model


def generate(
    *,
    days: int = 30,
    users: int = 12,
    requests_per_day: int = 2000,
    seed: int = 0,
    now: datetime | None = None,
    progress=None,
) -> int:
    """Create demo users, API keys and `days` of usage ending now; returns the number of rows."""
    rng = random.Random(seed)
    now = now or timezone.now()
    demo_users = [_demo_user(i, rng) for i in range(users)]
    start = (now - timedelta(days=days)).replace(minute=0, second=0, microsecond=0)
    hours = int((now - start).total_seconds() // 3600) + 1
    total = 0
    with _keep_created_at(), transaction.atomic():
        batch: list[UsageRecord] = []
        for h in range(hours):
            hour = start + timedelta(hours=h)
            for _ in range(_poisson(rng, requests_per_day / 24 * _load(hour))):
                at = hour + timedelta(seconds=rng.uniform(0, 3600))
                if at <= now:
                    batch.append(_record(rng, rng.choices(demo_users, [u.weight for u in demo_users])[0], at, hour))
            if len(batch) >= 5000 or h == hours - 1:
                UsageRecord.objects.bulk_create(batch, batch_size=1000)
                total += len(batch)
                batch = []
                if progress:
                    progress(h + 1, hours, total)
    return total


def generate_batches(*, count: int = 10, seed: int = 0, now: datetime | None = None) -> int:
    """Demo batch jobs of the demo users in every state, one still running with lines finishing now.

    Only rows for the dashboard's batch panel: nothing is queued, no engine work is done.
    """
    from batches.models import Batch, BatchLine

    rng = random.Random(seed)
    now = now or timezone.now()
    owners = list(get_user_model().objects.filter(username__startswith=USERNAME_PREFIX).order_by("username")[:4])
    if not owners:
        return 0
    statuses = [Batch.Status.COMPLETED] * 6 + [Batch.Status.FAILED, Batch.Status.CANCELLED, Batch.Status.EXPIRED]
    with transaction.atomic():
        for i in range(count):
            status = Batch.Status.IN_PROGRESS if i == 0 else statuses[i % len(statuses)]
            created = now - timedelta(hours=rng.uniform(1, 24 * 20)) if i else now - timedelta(minutes=42)
            total = rng.randint(50, 2000)
            done = total if status == Batch.Status.COMPLETED else rng.randint(0, total // 2)
            batch = Batch.objects.create(
                user=owners[i % len(owners)],
                input_file_public_id=f"file-demo{i:04d}",
                endpoint="/v1/chat/completions",
                status=status,
                total=total,
                completed=done,
                failed=rng.randint(0, 3) if done else 0,
                expires_at=created + timedelta(hours=24),
                in_progress_at=created + timedelta(seconds=5),
                metadata={"demo": True},
            )
            Batch.objects.filter(pk=batch.pk).update(created_at=created)
            if status == Batch.Status.IN_PROGRESS:
                BatchLine.objects.bulk_create(
                    BatchLine(
                        batch=batch,
                        line_number=n,
                        custom_id=f"demo-{n}",
                        url="/v1/chat/completions",
                        body={},
                        status="completed",
                        finished_at=now - timedelta(seconds=rng.uniform(0, 58)),
                    )
                    for n in range(90)
                )
    return count


def _demo_user(i: int, rng: random.Random) -> DemoUser:
    from accounts.models import ApiKey
    from accounts.services import create_api_key

    user, created = get_user_model().objects.get_or_create(
        username=f"{USERNAME_PREFIX}{i + 1:02d}", defaults={"email": f"demo{i + 1}@example.com"}
    )
    if created:
        user.set_unusable_password()
        user.save(update_fields=["password"])
    kind = ("api", "playground", "mixed", "batch")[i % 4]
    sources = {
        "api": {"api": 0.9, "playground": 0.1},
        "playground": {"playground": 0.95, "api": 0.05},
        "mixed": {"api": 0.5, "playground": 0.3, "batch": 0.2},
        "batch": {"batch": 0.7, "api": 0.3},
    }[kind]
    keys = list(ApiKey.objects.filter(user=user).values_list("pk", flat=True))
    if not keys and kind != "playground":
        keys = [create_api_key(user, name=name)[0].pk for name in ("production", "staging")[: 1 + i % 2]]
    return DemoUser(
        user=user, weight=1.0 / (i + 1) ** 1.1, sources=sources, key_ids=keys, model=list(MODELS)[i % len(MODELS)]
    )


def _load(hour: datetime) -> float:
    """Relative traffic: a daily sine peaking mid-afternoon UTC, weekends at 40%."""
    daily = 0.35 + 0.65 * (1 + math.sin((hour.hour - 9) / 24 * 2 * math.pi)) / 2
    return daily * (0.4 if hour.weekday() >= 5 else 1.0) * 1.6


def _poisson(rng: random.Random, mean: float) -> int:
    if mean > 50:  # normal approximation; exact enough for a demo and much faster
        return max(0, round(rng.gauss(mean, math.sqrt(mean))))
    limit, k, p = math.exp(-mean), 0, 1.0
    while True:
        p *= rng.random()
        if p <= limit:
            return k
        k += 1


def _record(rng: random.Random, who: DemoUser, at: datetime, hour: datetime) -> UsageRecord:
    source = rng.choices(list(who.sources), list(who.sources.values()))[0]
    if source == "batch" and not 0 <= hour.hour < 7 and rng.random() < 0.8:
        source = "api"  # batches mostly run at night
    model = who.model if rng.random() < 0.7 else rng.choices(list(MODELS), [m[0] for m in MODELS.values()])[0]
    key_id = rng.choice(who.key_ids) if source == "api" and who.key_ids else None
    prompt = max(1, int(rng.lognormvariate(math.log({"playground": 180, "api": 450, "batch": 900}[source]), 0.8)))
    status = _status(rng, source, _load(hour))
    fields = dict(
        user=who.user,
        api_key_id=key_id,
        source=source,
        model=model,
        created_at=at,
        endpoint="/v1/completions" if source == "api" and rng.random() < 0.2 else "/v1/chat/completions",
        request_id=f"synthetic-{rng.getrandbits(64):016x}",
        prompt_tokens=prompt,
        status_code=status,
    )
    if source == "playground":
        fields["endpoint"] = "playground"
    if status >= 400:
        return UsageRecord(
            **fields,
            error_code=_error_code(status),
            latency_ms=round(rng.uniform(2, 15) if status != 500 else rng.uniform(50, 3000), 2),
        )
    return UsageRecord(**fields, **_served(rng, source, model, prompt, _load(hour)))


def _status(rng: random.Random, source: str, load: float) -> int:
    roll = rng.random()
    if roll < 0.015 * load * (0.3 if source == "batch" else 1.0):
        return 429
    if roll < 0.015 * load + 0.004:
        return 400
    if roll < 0.015 * load + 0.007:
        return 500
    return 200


def _error_code(status: int) -> str:
    return {429: "rate_limit_exceeded", 400: "invalid_request_error", 500: "engine_error"}[status]


def _served(rng: random.Random, source: str, model: str, prompt: int, load: float) -> dict:
    _, tpot_median, prefill_per_token = MODELS[model]
    completion = max(1, int(rng.lognormvariate(math.log({"playground": 220, "api": 140, "batch": 300}[source]), 0.7)))
    cached = int(prompt * rng.uniform(0.4, 0.9)) if source == "playground" and rng.random() < 0.7 else 0
    queueing = rng.expovariate(1 / (5 + 40 * load**2))
    ttft = (15 + (prompt - cached) * prefill_per_token) * rng.lognormvariate(0, 0.25) + queueing
    tpot = tpot_median * (0.8 + 0.3 * load) * rng.lognormvariate(0, 0.15)
    return {
        "completion_tokens": completion,
        "cached_tokens": cached,
        "ttft_ms": round(ttft, 3),
        "latency_ms": round(ttft + (completion - 1) * tpot, 3),
    }


@contextlib.contextmanager
def _keep_created_at():
    """UsageRecord.created_at is auto_now_add; synthetic rows need their own past timestamps."""
    field = UsageRecord._meta.get_field("created_at")
    saved = field.auto_now_add
    field.auto_now_add = False
    try:
        yield
    finally:
        field.auto_now_add = saved
