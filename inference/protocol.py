"""The engine protocol over Redis (docs/protocol.md): key names, typed messages and their codecs.

The one definition shared by the engine worker (inference/worker.py) and the web tier
(platform/engine_client). Pure Python: no torch, no Django, no Redis client.

Messages: EngineRequest (web tier -> worker, one entry of its model's request stream), events
(worker -> web tier, a JSON list per entry of the request's output stream; typed dicts built by
the *_event functions) and Heartbeat (a worker's hash, refreshed every second).
"""

from __future__ import annotations

import base64
import json
import struct
import time
import uuid
from dataclasses import asdict, dataclass, field
from typing import Any, Literal, TypedDict

PREFIX = "tessera:engine"
CONSUMER_GROUP = "engines"
ABORT_CHANNEL = f"{PREFIX}:abort"
WORKERS_SET = f"{PREFIX}:workers"
REQUEST_STREAM_MAXLEN = 100_000
OUTPUT_TTL_S = 3600
# A web process refreshes its lease (lease_id) every LEASE_REFRESH_S while it follows streams;
# a worker aborts the requests of a lease that lapsed (the web process died mid-stream).
LEASE_TTL_S = 3.0
LEASE_REFRESH_S = 1.0
# A web process's hub names an output stream in its blocking XREAD while the stream is hot (followed or
# written to in the last HUB_HOT_S) and the rest only every HUB_COLD_READ_S; a worker that writes to a
# leased request's stream after RING_AFTER_S without a write rings the lease's doorbell (hub_doorbell),
# so a stream the hub let cool is named again at once. RING_AFTER_S <= HUB_HOT_S is what makes that hold.
HUB_HOT_S = 0.5
HUB_COLD_READ_S = 1.0
RING_AFTER_S = HUB_HOT_S / 2
DOORBELL_MAXLEN = 1000

# Priority classes (lower runs first in the engine); a request's own priority orders it inside its class.
PRIORITY_CLASSES = {"interactive": 0, "api": 1, "batch": 2}
PRIORITY_CLASS_SPAN = 1000

TERMINAL_EVENTS = ("finish", "error")
# An embedding request names this task; its worker must serve an embedding (encoder) model.
EMBED_TASK = "embed"
# Codes of error events: worker-side validation, a lost or missing worker, engine failure, the caller's timeout.
ERROR_CODES = ("invalid_request", "worker_lost", "no_worker", "engine_error", "worker_shutdown", "expired", "timeout")


# ---------------------------------------------------------------- keys


def request_stream(model: str) -> str:
    """One request stream (and consumer group) per served model name: a worker reads only its own."""
    return f"{PREFIX}:requests:{model}"


def output_stream(request_id: str) -> str:
    return f"{PREFIX}:out:{request_id}"


def aborted_key(request_id: str) -> str:
    return f"{PREFIX}:aborted:{request_id}"


def lease_key(lease_id: str) -> str:
    return f"{PREFIX}:lease:{lease_id}"


def hub_doorbell(lease_id: str) -> str:
    """A web process's doorbell stream: its hub's XREAD always names it (docs/protocol.md)."""
    return f"{PREFIX}:hub-wake:{lease_id}"


def heartbeat_key(worker_id: str) -> str:
    return f"{PREFIX}:worker:{worker_id}"


def block_map_key(worker_id: str) -> str:
    return f"{PREFIX}:worker:{worker_id}:blocks"


def engine_priority(priority_class: str, priority: int = 0) -> int:
    """Map (class, in-class priority) onto the engine's single integer (lower value runs first)."""
    if priority_class not in PRIORITY_CLASSES:
        raise ValueError(f"unknown priority class {priority_class!r}")
    within = min(max(int(priority), 0), PRIORITY_CLASS_SPAN - 1)
    return PRIORITY_CLASSES[priority_class] * PRIORITY_CLASS_SPAN + within


def encode(obj) -> str:
    return json.dumps(obj, separators=(",", ":"))


def decode(raw) -> Any:  # JSON: the caller knows its shape
    if isinstance(raw, bytes):
        raw = raw.decode()
    return json.loads(raw)


# ---------------------------------------------------------------- request


def new_request_id() -> str:
    return uuid.uuid4().hex


@dataclass
class EngineRequest:
    """One generation request (with pooling_params: one embedding). Exactly one of prompt_token_ids / prompt is set."""

    request_id: str
    model: str
    prompt_token_ids: list[int] | None = None
    prompt: str | None = None
    sampling_params: dict = field(default_factory=dict)
    priority: int = 0  # the engine's integer: engine_priority(priority_class, within-class priority)
    priority_class: str = "api"
    user: str | None = None
    submitted_at: float = 0.0
    deadline: float | None = None
    lease_id: str | None = None  # the lease of the web process following it (None: nobody to outlive)
    pooling_params: dict | None = None  # set: an embedding request (inference.pooling.PoolingParams fields)
    tenant: str | None = None  # whose fair share it is served from (the user); None: the request is its own tenant
    weight: float = 1.0  # the tenant's share weight (the user's plan share)

    @classmethod
    def build(
        cls,
        *,
        model: str,
        prompt_token_ids=None,
        prompt: str | None = None,
        sampling_params: dict | None = None,
        priority_class: str = "api",
        priority: int = 0,
        user=None,
        request_id: str | None = None,
        queue_timeout: float | None = None,
        lease_id: str | None = None,
        pooling_params: dict | None = None,
        tenant=None,
        weight: float = 1.0,
    ) -> "EngineRequest":
        """Validate the arguments (ValueError) and stamp the submission time."""
        if (prompt_token_ids is None) == (prompt is None):
            raise ValueError("give exactly one of prompt_token_ids or prompt")
        if not model:
            raise ValueError("a request names the model it is for")
        now = time.time()
        return cls(
            request_id=request_id or new_request_id(),
            model=model,
            prompt_token_ids=None if prompt_token_ids is None else list(prompt_token_ids),
            prompt=prompt,
            sampling_params=dict(sampling_params or {}),
            priority=engine_priority(priority_class, priority),
            priority_class=priority_class,
            user=None if user is None else str(user),
            submitted_at=now,
            deadline=now + queue_timeout if queue_timeout else None,
            lease_id=lease_id,
            pooling_params=None if pooling_params is None else dict(pooling_params),
            tenant=None if tenant is None else str(tenant),
            weight=weight,
        )

    @property
    def stream(self) -> str:
        return request_stream(self.model)

    def fields(self) -> dict[str, str]:
        """The stream entry's fields."""
        return {"data": encode(asdict(self))}

    @classmethod
    def from_fields(cls, fields: dict) -> "EngineRequest":
        """Parse a stream entry; KeyError / TypeError / ValueError for a malformed one."""
        data = decode(fields[b"data"] if b"data" in fields else fields["data"])
        known = {name: data[name] for name in cls.__dataclass_fields__ if name in data}
        return cls(**known)


# ---------------------------------------------------------------- events


class LogprobEntry(TypedDict):
    token_id: int
    token: str
    logprob: float | None
    top: list[dict]


class AcceptedEvent(TypedDict):
    type: Literal["accepted"]
    worker_id: str
    prompt_tokens: int
    accepted_at: float  # unix s: the worker's clock when it claimed the request


class DeltaEvent(TypedDict, total=False):
    type: Literal["delta"]
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    stop_reason: str | int | None
    logprobs: list[LogprobEntry]


class PromptLogprobsEvent(TypedDict):
    type: Literal["prompt_logprobs"]
    logprobs: list[LogprobEntry]  # one per prompt token; the first has logprob None and no top (nothing predicts it)


class Usage(TypedDict):
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int


class FinishEvent(TypedDict):
    type: Literal["finish"]
    finish_reasons: list[str | None]
    usage: Usage
    metrics: dict  # worker-side times: queue_ms, ttft_ms (from acceptance), latency_ms, num_preemptions


class ErrorEvent(TypedDict):
    type: Literal["error"]
    code: str
    message: str


class EmbeddingEvent(TypedDict):
    type: Literal["embedding"]
    embedding: str  # base64 of the float32 little-endian values (OpenAI's encoding_format "base64")
    dimensions: int


Event = AcceptedEvent | DeltaEvent | PromptLogprobsEvent | EmbeddingEvent | FinishEvent | ErrorEvent


def accepted_event(worker_id: str, prompt_tokens: int) -> AcceptedEvent:
    return {"type": "accepted", "worker_id": worker_id, "prompt_tokens": prompt_tokens, "accepted_at": time.time()}


def delta_event(index: int, text: str, token_ids: list[int], finish_reason, stop_reason) -> DeltaEvent:
    return {
        "type": "delta",
        "index": index,
        "text": text,
        "token_ids": token_ids,
        "finish_reason": finish_reason,
        "stop_reason": stop_reason,
    }


def prompt_logprobs_event(logprobs: list[LogprobEntry]) -> PromptLogprobsEvent:
    return {"type": "prompt_logprobs", "logprobs": logprobs}


def finish_event(finish_reasons: list, usage: Usage, metrics: dict) -> FinishEvent:
    return {"type": "finish", "finish_reasons": finish_reasons, "usage": usage, "metrics": metrics}


def embedding_event(float32_le: bytes) -> EmbeddingEvent:
    """An embedding request's result (sent just before its finish): the vector's float32 bytes, little-endian."""
    return {
        "type": "embedding",
        "embedding": base64.b64encode(float32_le).decode("ascii"),
        "dimensions": len(float32_le) // 4,
    }


def embedding_floats(event: EmbeddingEvent) -> list[float]:
    """The values of an embedding event (each a float32 widened to a Python float)."""
    raw = base64.b64decode(event["embedding"])
    return list(struct.unpack(f"<{len(raw) // 4}f", raw))


def error_event(code: str, message: str) -> ErrorEvent:
    return {"type": "error", "code": code, "message": message}


def empty_usage() -> Usage:
    return {"prompt_tokens": 0, "completion_tokens": 0, "cached_tokens": 0}


def output_fields(events: list[Event]) -> dict[str, str]:
    """One output stream entry: a step's events of one request."""
    return {"events": encode(events)}


def events_of(fields: dict) -> list[Event]:
    return decode(fields[b"events"] if b"events" in fields else fields["events"])


def ring_fields(request_ids: list[str]) -> dict[str, str]:
    """One doorbell entry: the requests whose quiet output streams a worker just wrote to."""
    return {"ring": encode(request_ids)}


def rung_request_ids(fields: dict) -> list[str]:
    """The request ids of a doorbell entry; none for a hub's own wake-up entry."""
    raw = fields.get(b"ring", fields.get("ring"))
    return decode(raw) if raw is not None else []


# ---------------------------------------------------------------- heartbeat


@dataclass
class Heartbeat:
    """A worker's heartbeat hash. A worker is alive exactly while this key exists."""

    worker_id: str
    model: str  # the primary served name
    served_model_names: list[str]  # the primary name first, then its aliases
    pid: int = 0
    host: str = ""
    started_at: float = 0.0
    updated_at: float = 0.0
    config: dict = field(default_factory=dict)  # engine_args, model_path, max_model_len
    stats: dict = field(default_factory=dict)  # engine.get_stats() plus the worker's counters

    def fields(self) -> dict[str, str | int | float]:
        data = asdict(self)
        for name in ("served_model_names", "config", "stats"):
            data[name] = encode(data[name])
        data["served_model_name"] = self.model  # older readers
        return data

    @classmethod
    def from_fields(cls, raw: dict) -> "Heartbeat":
        info = {
            (k.decode() if isinstance(k, bytes) else k): (v.decode() if isinstance(v, bytes) else v)
            for k, v in raw.items()
        }
        names = decode(info["served_model_names"]) if info.get("served_model_names") else [info.get("model", "")]
        return cls(
            worker_id=info.get("worker_id", ""),
            model=info.get("model", ""),
            served_model_names=names,
            pid=int(info.get("pid") or 0),
            host=info.get("host", ""),
            started_at=float(info.get("started_at") or 0),
            updated_at=float(info.get("updated_at") or 0),
            config=decode(info["config"]) if info.get("config") else {},
            stats=decode(info["stats"]) if info.get("stats") else {},
        )

    def as_dict(self) -> dict:
        """The plain dict callers read (dashboard, /metrics): the dataclass fields plus served_model_name."""
        return {**asdict(self), "served_model_name": self.model}
