"""One generation, whichever front door it came through: admit -> submit -> follow -> finish.

    gen = Generation(source="api", endpoint="/v1/chat/completions", user=user, model="smollm2",
                     prompts=[prompt_ids], sampling_params={"max_tokens": 64}, max_tokens=64)
    admit(gen)                        # the quota reservation: QuotaExceeded / PlanViolation
    await asubmit(gen)                # submit() on the bookkeeping thread, with this loop's lease_id
    async for event in follow(gen):   # each event is already folded into gen.result
        ...                           # the front door turns it into a frame, an SSE chunk or nothing
    await afinish(gen)                # the usage row and the quota settlement, exactly once

The websocket consumer (chat), the SSE / JSON views (openai_api) and the batch runner (batches)
are adapters around these calls. Every metric has one definition, stored on the usage row:
  ttft_ms         the worker wrote the first token - the request arrived at the front door
  engine_ttft_ms  the worker wrote the first token - the worker accepted the request
  latency_ms      the worker wrote the last event  - the request arrived at the front door
The worker's write times are its output stream's entry ids, so a request followed token by
token and a batch line polled once a second measure the same way.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TypeVar

from asgiref.sync import sync_to_async
from django.db import InterfaceError, OperationalError, close_old_connections, connection, transaction

from engine_client import client as engine
from errors import EngineFailure
from inference import protocol
from quotas import services as quotas
from quotas.ledger import Reservation
from usage.services import record_usage

from .result import Result

T = TypeVar("T")
PRIORITY_CLASSES = {"playground": "interactive", "api": "api", "batch": "batch"}
QUOTA_RENEW_S = 30.0


@dataclass
class Generation:
    """One request for text: who asks, through which door, what to run; then how it went."""

    source: str  # "playground" | "api" | "batch" (usage.models.UsageRecord.Source)
    endpoint: str  # the usage row's endpoint: "playground", "/v1/chat/completions", ...
    user: object
    model: str
    prompts: list[list[int]]  # one engine request per prompt (a batched /v1/completions has several)
    sampling_params: dict
    pooling_params: dict | None = None  # set: each prompt's embedding instead of text (/v1/embeddings)
    prompt_tokens: int | None = None  # sum of the prompts' lengths; given when the ids are not (a resumed reply)
    request_id: str = field(default_factory=protocol.new_request_id)
    n: int = 1
    max_tokens: int = 0  # per choice
    priority: int = 0  # inside the source's priority class
    api_key: object = None
    end_user: str = ""  # the OpenAI `user` field
    arrived_at: float | None = None  # wall clock, compared with the worker's write times (default: now)
    reservation: Reservation | None = None
    share: float = 1.0  # the user's plan share: the weight of their engine requests (fair share)
    result: Result = field(init=False)
    status_code: int | None = None  # set for outcomes the engine did not report (refusals, disconnects)
    error_code: str = ""
    finished: bool = False

    def __post_init__(self):
        self.result = Result(n=self.num_choices)
        self.arrived_at = self.arrived_at or time.time()
        if self.prompt_tokens is None:
            self.prompt_tokens = sum(len(p) for p in self.prompts)

    @property
    def engine_request_ids(self) -> list[str]:
        """One engine request per prompt; a single prompt's is the request id itself."""
        if len(self.prompts) == 1:
            return [self.request_id]
        return [f"{self.request_id}-{i}" for i in range(len(self.prompts))]

    @property
    def longest_prompt_tokens(self) -> int:
        return max(len(p) for p in self.prompts)

    @property
    def num_choices(self) -> int:
        return len(self.prompts) * self.n

    @property
    def ttft_ms(self) -> float | None:
        if self.result.first_token_at is None:
            return None
        return round(max(0.0, self.result.first_token_at - self.arrival) * 1000, 1)

    @property
    def latency_ms(self) -> float:
        return round(max(0.0, (self.result.ended_at or time.time()) - self.arrival) * 1000, 1)

    @property
    def arrival(self) -> float:
        """arrived_at, which __post_init__ always sets."""
        assert self.arrived_at is not None
        return self.arrived_at

    @property
    def prompt_token_count(self) -> int:
        """prompt_tokens, which __post_init__ always sets."""
        assert self.prompt_tokens is not None
        return self.prompt_tokens

    @property
    def engine_ttft_ms(self) -> float | None:
        return self.result.engine_metrics.get("ttft_ms")

    def fail(self, status: int, code: str) -> None:
        self.status_code, self.error_code = status, code

    @property
    def outcome(self) -> tuple[int, str]:
        """(HTTP-like status, error code) of how it ended: 200 and "" for a finished answer."""
        if self.status_code is not None:
            return self.status_code, self.error_code
        if self.result.error is not None:
            failure = EngineFailure.from_event(self.result.error)
            return failure.status, failure.code
        return 200, ""

    def charged_tokens(self) -> tuple[int, int]:
        """(prompt, completion) tokens to charge: the engine's usage summary, else what was seen."""
        result = self.result
        if result.usage is not None:
            return result.usage.get("prompt_tokens", self.prompt_token_count), result.completion_tokens
        return self.prompt_token_count, result.tokens_seen


# ---------------------------------------------------------------- the bookkeeping thread

# Admission, quota renewal and settlement (database + Redis) run on one dedicated thread, first
# come first served. On Django's per-request threads a burst of requests ran its admissions side
# by side under the GIL, so every one finished late (docs/architecture.md has the measurement).
# A large admission (a long prompt to tokenize: milliseconds to seconds) runs on a thread of its
# own instead, so a flood of them queues behind itself, never in front of the small ones.
_bookkeeping = ThreadPoolExecutor(max_workers=1, thread_name_prefix="generation-bookkeeping")
_large_admissions = ThreadPoolExecutor(max_workers=1, thread_name_prefix="generation-large-admissions")


async def on_bookkeeping_thread(fn: Callable[..., T], /, *args, large: bool = False, **kwargs) -> T:
    """fn(*args, **kwargs) on the bookkeeping thread (large: the large-admission one), awaited: two
    thread hops, the event loop's to that thread and the result's (or exception's) back to the loop."""

    def run() -> T:
        close_old_connections()  # this thread never sees request_finished: honour CONN_MAX_AGE here
        return fn(*args, **kwargs)

    executor = _large_admissions if large else _bookkeeping
    return await sync_to_async(run, thread_sensitive=False, executor=executor)()


# ---------------------------------------------------------------- admit, submit


def admit(gen: Generation, *, plan=None) -> None:
    """Reserve prompt + n x max_tokens of the user's quota (QuotaExceeded / PlanViolation)."""
    plan = plan or quotas.plan_for(gen.user)
    gen.share = plan.share
    gen.reservation = quotas.reserve(
        gen.user, gen.model, gen.prompt_token_count, gen.max_tokens * gen.num_choices, gen.source, plan=plan
    )


def _engine_requests(gen: Generation) -> list[dict]:
    return [
        dict(
            model=gen.model,
            prompt_token_ids=prompt,
            sampling_params=gen.sampling_params,
            priority_class=PRIORITY_CLASSES[gen.source],
            priority=gen.priority,
            user=getattr(gen.user, "pk", None),
            request_id=request_id,
            pooling_params=gen.pooling_params,
            tenant=getattr(gen.user, "pk", None),
            weight=gen.share,
        )
        for request_id, prompt in zip(gen.engine_request_ids, gen.prompts)
    ]


def submit(gen: Generation, *, lease_id: str | None = None) -> None:
    """Queue the engine requests (from a thread: the bookkeeping one, or the batch runner's).

    lease_id: the lease of the event loop that will follow() them (engine.aclient().lease()); the
    worker aborts them when it lapses. The batch runner polls its requests and passes none.
    """
    for request in _engine_requests(gen):
        engine.client().submit(lease_id=lease_id, **request)


async def asubmit(gen: Generation) -> None:
    """submit() for a generation this event loop will follow(): the loop's lease_id is taken here, on
    the loop (lease() keeps it alive from a task of that loop), and the requests go out on the
    bookkeeping thread, where one redis-py round trip costs less than one on the event loop."""
    lease_id = engine.aclient().lease()
    await on_bookkeeping_thread(submit, gen, lease_id=lease_id)


async def abort(gen: Generation) -> None:
    for request_id in gen.engine_request_ids:
        await engine.aclient().abort(request_id)


# ---------------------------------------------------------------- follow


async def follow(gen: Generation, *, timeout: float | None = None) -> AsyncIterator[dict]:
    """The generation's engine events in order, each already in gen.result, ending with one
    terminal event. The quota lease is renewed while it runs; a caller that stops reading before
    the end (its client hung up) aborts the engine requests, so their blocks are freed now."""
    last_renew = time.monotonic()
    try:
        async for event in _events(gen, timeout):
            gen.result.add(event)
            if gen.reservation is not None and time.monotonic() - last_renew > QUOTA_RENEW_S:
                last_renew = time.monotonic()
                await on_bookkeeping_thread(quotas.renew, gen.reservation)
            yield event
    finally:
        if not gen.result.ended:
            gen.fail(499, "client_disconnected")
            await abort(gen)


async def _events(gen: Generation, timeout: float | None):
    """One prompt's stream as it is; several prompts' streams (they run side by side in the engine)
    read in prompt order as one: choice i of prompt p is index p * n + i, one finish closes them
    all with the usage summed, and an error aborts the prompts still running."""
    client = engine.aclient()
    if len(gen.prompts) == 1:
        async for event in client.stream(gen.request_id, model=gen.model, timeout=timeout):
            yield event
        return
    reasons: list[str | None] = []
    usage = protocol.empty_usage()
    metrics: dict = {}
    for prompt_index, request_id in enumerate(gen.engine_request_ids):
        async for event in client.stream(request_id, model=gen.model, timeout=timeout):
            if event["type"] == "error":
                await abort(gen)
                yield event
                return
            if event["type"] == "finish":
                reasons.extend(event.get("finish_reasons") or [None] * gen.n)
                usage = _summed(usage, event.get("usage") or {})
                metrics = metrics or event.get("metrics") or {}
                continue
            yield _for_prompt(event, prompt_index, gen.n)
    yield protocol.finish_event(reasons, usage, metrics)


def _summed(total: protocol.Usage, part: dict) -> protocol.Usage:
    return {
        "prompt_tokens": total["prompt_tokens"] + part.get("prompt_tokens", 0),
        "completion_tokens": total["completion_tokens"] + part.get("completion_tokens", 0),
        "cached_tokens": total["cached_tokens"] + part.get("cached_tokens", 0),
    }


def _for_prompt(event: dict, prompt_index: int, n: int) -> dict:
    if event["type"] == "delta":
        return {**event, "index": prompt_index * n + event["index"]}
    if event["type"] in ("prompt_logprobs", "embedding"):
        return {**event, "prompt_index": prompt_index}
    return event


def collect(request_id: str, *, model: str | None = None, n: int = 1, timeout: float | None = None) -> Result:
    """A request's whole stream, read from a thread (a clean-up task, tests), folded into a Result."""
    result = Result(n=n)
    for event in engine.client().stream(request_id, model=model, timeout=timeout):
        result.add(event)
    return result


def fold_output(gen: Generation, events: list[dict]) -> Result:
    """Events read in one go (a batch line's finished stream, a stale reply's) into gen.result."""
    for event in events:
        gen.result.add(event)
    return gen.result


# ---------------------------------------------------------------- finish

Save = Callable[[Generation], bool]
# A lost database connection (PostgreSQL restarted, a failover) is replaced and the transaction run
# again after each of these waits, so the usage row of an answer already sent is not lost.
RECONNECT_WAITS_S = (0.2, 0.5, 1.0, 2.0, 4.0, 8.0)


def _atomic_with_reconnect(work: Callable[[], bool]) -> bool:
    """work() in one transaction; when the connection is lost, a new one runs it again (it rolled back
    whole). Inside a caller's transaction nothing can be retried here, so the error goes up."""
    for wait in (*RECONNECT_WAITS_S, None):
        try:
            with transaction.atomic():
                return work()
        except (OperationalError, InterfaceError):
            if wait is None or connection.in_atomic_block or connection.is_usable():
                raise  # not a lost connection (or no retry left): the caller's to handle
            connection.close()
            time.sleep(wait)
    raise AssertionError("unreachable")


def finish(gen: Generation, *, save: Save | None = None) -> bool:
    """End the generation exactly once: the front door's own record (save: the chat message, the
    batch line; False when another follower already ended it), the usage row in the same
    transaction, then the quota settlement with what was really used. False if already ended.
    A save that raises (a database error) leaves it unfinished, so the caller may try again."""

    def end() -> bool:
        ended = not gen.finished and (save is None or save(gen))
        if ended and gen.user is not None:
            record(gen)
        return ended

    ended_here = _atomic_with_reconnect(end)
    gen.finished = True
    settle_quota(gen)  # idempotent: a second follower's settlement changes nothing
    return ended_here


def record(gen: Generation) -> None:
    prompt_tokens, completion_tokens = gen.charged_tokens()
    status_code, error_code = gen.outcome
    record_usage(
        user=gen.user,
        api_key=gen.api_key,
        source=gen.source,
        endpoint=gen.endpoint,
        model=gen.model,
        request_id=gen.request_id,
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        cached_tokens=gen.result.cached_tokens,
        ttft_ms=gen.ttft_ms,
        engine_ttft_ms=gen.engine_ttft_ms,
        latency_ms=gen.latency_ms,
        status_code=status_code,
        error_code=error_code,
        end_user=gen.end_user,
    )


def release(gen: Generation) -> None:
    """Give back a reservation nothing ran for (the request was never queued)."""
    if gen.reservation is not None:
        quotas.settle(gen.reservation, 0, 0)


def settle_quota(gen: Generation) -> None:
    """Charge what was used and free the concurrency slot (also for an attempt that is run again)."""
    if gen.reservation is not None:
        quotas.settle(gen.reservation, *gen.charged_tokens())


_finishing: set[asyncio.Future] = set()


async def afinish(gen: Generation, *, save: Save | None = None) -> bool:
    """finish() on the bookkeeping thread, shielded: a client that hangs up right after its last
    chunk cancels the caller, and the settlement must run on regardless (or the concurrency slot
    stays held for the lease)."""
    finishing = asyncio.ensure_future(on_bookkeeping_thread(finish, gen, save=save))
    _finishing.add(finishing)
    finishing.add_done_callback(_finishing.discard)
    return await asyncio.shield(finishing)
