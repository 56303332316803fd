"""One batch line -> an ApiCall (openai_api.calls, the endpoint's own build; openai_api.embeddings' for
/v1/embeddings) -> one output line.

A batch line and the same request sent to /v1/chat/completions give the same engine request and
the same response body. The runner admits, submits and finishes each line's generation through
the generation service; this module shapes what comes back.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from errors import EngineFailure, InvalidRequest, ServiceError
from generation import catalog
from openai_api import calls, embeddings, formatting
from openai_api.errors import error_body

KINDS = {"/v1/chat/completions": "chat", "/v1/completions": "completions"}


@dataclass
class LineOutcome:
    ok: bool
    status_code: int
    body: dict | None
    error: dict | None = None
    usage: dict = field(default_factory=dict)

    @property
    def error_code(self) -> str | None:
        return None if self.ok else ((self.body or {}).get("error") or {}).get("code")


# ---------------------------------------------------------------- validation


def model_problem_for(user):
    """check_model for validation: the model must be served and in the user's plan."""
    from quotas.selectors import plan_for

    plan, served = plan_for(user), catalog.known_models()

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

    cap, models = plan_for(user).max_tokens_per_request, catalog.known_models()

    def check(url: str, body: dict):
        try:
            call = build_call(url, body, user=user, models=models)
        except ServiceError as error:
            return error.param, error.message
        if cap is not None and call.gen.max_tokens > cap:
            return "max_tokens", f"max_tokens is {call.gen.max_tokens}, but your plan allows at most {cap} per request."
        return None

    return check


# ---------------------------------------------------------------- building and shaping


def build_call(url: str, body: dict, *, user=None, models: dict | None = None):
    """The ApiCall (an EmbeddingCall for /v1/embeddings) the live endpoint would build
    (errors.ServiceError for a bad body)."""
    models = catalog.known_models() if models is None else models
    if url == embeddings.ENDPOINT:
        call = embeddings.build_call(body=body, user=user, source="batch", models=models)
    else:
        call = calls.build_call(kind=KINDS[url], body=body, user=user, source="batch", endpoint=url, models=models)
    if len(call.gen.prompts) > 1:  # a line is one engine request; its output line has one id
        param = "input" if url == embeddings.ENDPOINT else "prompt"
        raise InvalidRequest(f"A batch line takes one {param}; put each {param} on its own line.", param=param)
    return call


def outcome(call: calls.ApiCall) -> LineOutcome:
    """The line's finished generation shaped as the endpoint's response body (or its error)."""
    result = call.gen.result
    usage = result.usage or {}
    if result.error:
        failure = EngineFailure.from_event(result.error)
        return LineOutcome(ok=False, status_code=failure.status, body=error_body(failure), usage=usage)
    shape = embeddings.response_body if isinstance(call, embeddings.EmbeddingCall) else formatting.response_body
    return LineOutcome(ok=True, status_code=200, body=shape(call, result), usage=usage)


def refused_outcome(error: ServiceError) -> LineOutcome:
    """A line refused before the engine: its output line carries the /v1 envelope the endpoint would answer."""
    return LineOutcome(ok=False, status_code=error.status, body=error_body(error))
