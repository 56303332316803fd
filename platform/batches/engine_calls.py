"""One batch line -> one engine request -> one OpenAI response body, through the engine client.

A line is built with the /v1 endpoints' own pieces (openai_api: the request serializers, the chat
template, the context check, the sampling-parameter mapping and the response formatting), so a
batch line and the same request sent to /v1/chat/completions give the same engine request and
the same body. The runner collects results with batches.collector and shapes them with outcome().
"""
from __future__ import annotations

from dataclasses import dataclass, field

from django.conf import settings

from engine_client import client as engine
from errors import EngineFailure, InvalidRequest, ServiceError
from inference import protocol
from openai_api import formatting
from openai_api import services as api
from openai_api.errors import error_body
from openai_api.serializers import ChatCompletionRequestSerializer, CompletionRequestSerializer

BATCH_PRIORITY_CLASS = "batch"
ENDPOINTS = {"/v1/chat/completions": ("chat", ChatCompletionRequestSerializer),
             "/v1/completions": ("completions", CompletionRequestSerializer)}


@dataclass
class LineOutcome:
    ok: bool
    status_code: int
    body: dict | None
    error: dict | None = None
    usage: dict = field(default_factory=dict)
    metrics: dict = field(default_factory=dict)
    latency_ms: float | None = None

    @property
    def error_code(self) -> str | None:
        return None if self.ok else ((self.body or {}).get("error") or {}).get("code")


# ---------------------------------------------------------------- models and validation

def served_models() -> dict[str, dict]:
    """served name -> {"model_path", "max_model_len"} from live workers, plus the configured model."""
    try:
        models = api.models_from_workers(engine.client().workers())
    except Exception:  # Redis unreachable: the configured model still applies
        models = {}
    models.setdefault(api.configured_model_name(), {"max_model_len": None, "model_path": settings.MODEL})
    return models


def model_problem_for(user):
    """check_model for validation: the model must be served and in the user's plan."""
    from quotas.selectors import plan_for

    plan, served = plan_for(user), served_models()

    def problem(model: str) -> str | None:
        if model not in served:
            return f"The model '{model}' does not exist (served: {', '.join(sorted(served))})."
        if not plan.allows_model(model):
            return f"Your plan does not include the model '{model}'."
        return None

    return problem


def body_checker_for(user):
    """check_body for validation: what the live endpoint would refuse, plus the plan's max_tokens cap."""
    from quotas.selectors import plan_for

    cap, models = plan_for(user).max_tokens_per_request, served_models()

    def check(url: str, body: dict):
        try:
            gen = build_call(url, body, models)
        except ServiceError as error:
            return error.param, error.message
        if cap is not None and gen.max_tokens > cap:
            return "max_tokens", f"max_tokens is {gen.max_tokens}, but your plan allows at most {cap} per request."
        return None

    return check


# ---------------------------------------------------------------- building the engine request

def build_call(url: str, body: dict, models: dict | None = None) -> api.Generation:
    """The same Generation the live endpoint would build (raises errors.ServiceError for a bad body)."""
    kind, serializer = ENDPOINTS[url]
    data = api.validate(serializer, body)
    gen = api.Generation(endpoint=kind, model=data["model"], n=data.get("n") or 1, priority=data.get("priority") or 0)
    gen.request_id = ("chatcmpl-" if kind == "chat" else "cmpl-") + protocol.new_request_id()
    info = (models or served_models()).get(gen.model) or {}
    path = info.get("model_path") or settings.MODEL
    requested, prompt_param = api.apply_prompt(gen, data, path)
    if len(gen.all_prompts) > 1:  # a line is one engine request; its output line has one id
        raise InvalidRequest("A batch line takes one prompt; put each prompt on its own line.", param="prompt")
    gen.max_tokens = api.context_check(gen, requested, info.get("max_model_len"), prompt_param)
    gen.sampling_params = api.sampling_params(data, gen.max_tokens, gen.logprobs)
    api.check_sampling_params(gen.sampling_params)
    return gen


def reserved_completion_tokens(gen: api.Generation) -> int:
    return gen.max_tokens * gen.n


# ---------------------------------------------------------------- running one line

def submit(gen: api.Generation, user_id: int) -> None:
    engine.client().submit(model=gen.model, prompt_token_ids=gen.prompt_token_ids,
                           sampling_params=gen.sampling_params, priority_class=BATCH_PRIORITY_CLASS,
                           priority=gen.priority, user=user_id, request_id=gen.request_id)


def outcome(gen: api.Generation, result: dict, latency_ms: float) -> LineOutcome:
    """A collected engine result shaped as the endpoint's response body (or its error)."""
    usage = result.get("usage") or {}
    if result.get("error"):
        return error_outcome(result["error"], usage, latency_ms)
    shape = formatting.chat_response if gen.endpoint == "chat" else formatting.completion_response
    return LineOutcome(ok=True, status_code=200, body=shape(gen, result), usage=usage,
                       metrics=result.get("metrics") or {}, latency_ms=latency_ms)


def error_outcome(error: dict, usage: dict, latency_ms: float) -> LineOutcome:
    failure = EngineFailure.from_event(error)
    return LineOutcome(ok=False, status_code=failure.status, body=error_body(failure), usage=usage,
                       latency_ms=latency_ms)


def refused_outcome(error: ServiceError) -> LineOutcome:
    """A line refused before the engine: its output line carries the /v1 envelope the endpoint would answer."""
    return LineOutcome(ok=False, status_code=error.status, body=error_body(error))


def was_aborted(outcome: LineOutcome) -> bool:
    return any(c.get("finish_reason") == "abort" for c in (outcome.body or {}).get("choices") or [])
