"""One batch line -> one engine request -> one OpenAI response body, through the engine client.

The batch runner calls run_line() from a worker thread; everything here is engine I/O, no DB writes.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass, field

from django.conf import settings

from engine_client import client as engine

from openai_api.serializers import ChatCompletionRequestSerializer, CompletionRequestSerializer
from openai_api.tokenization import chat_prompt_ids, text_prompt_ids

BATCH_PRIORITY_CLASS = "batch"


@dataclass
class LineOutcome:
    ok: bool
    status_code: int
    body: dict | None
    error: dict | None = None
    usage: dict = field(default_factory=dict)
    metrics: dict = field(default_factory=dict)
    latency_ms: float | None = None


@dataclass
class EngineCall:
    """What to send for one line: prompt (ids or text), sampling params, and how to shape the reply."""

    url: str
    model: str
    prompt_token_ids: list[int] | None
    prompt: str | None
    sampling_params: dict
    max_tokens: int


def served_model_names() -> set[str]:
    names = {getattr(settings, "SERVED_MODEL_NAME", "") or os.path.basename(os.path.normpath(settings.MODEL))}
    try:
        names |= {w.get("served_model_name") for w in engine.workers() if w.get("served_model_name")}
    except Exception:  # Redis down: the configured name still applies
        pass
    return {n for n in names if n}


def model_problem_for(user):
    """A check_model for validation: the model must be served and in the user's plan."""
    from quotas.selectors import plan_for

    plan = plan_for(user)
    served = served_model_names()

    def problem(model: str) -> str | None:
        if model not in served:
            return f"The model '{model}' does not exist (served: {', '.join(sorted(served))})."
        if not plan.allows_model(model):
            return f"Your plan does not include the model '{model}'."
        return None

    return problem


REQUEST_SERIALIZERS = {"/v1/chat/completions": ChatCompletionRequestSerializer,
                       "/v1/completions": CompletionRequestSerializer}


def body_problem(url: str, body: dict):
    """(param, message) when the body would be refused by the live endpoint, else None."""
    serializer = REQUEST_SERIALIZERS[url](data=body)
    if not serializer.is_valid():
        param, problems = next(iter(serializer.errors.items()))
        return param, f"{param}: {_first(problems)}"
    return None


def body_checker_for(user):
    """body_problem plus the user's plan cap on max_tokens (a line the plan refuses must not start)."""
    from quotas.selectors import plan_for

    cap = plan_for(user).max_tokens_per_request

    def check(url: str, body: dict):
        problem = body_problem(url, body)
        if problem:
            return problem
        max_tokens = body.get("max_completion_tokens") or body.get("max_tokens") or DEFAULT_MAX_TOKENS
        if cap is not None and max_tokens > cap:
            return "max_tokens", f"max_tokens is {max_tokens}, but your plan allows at most {cap} per request."
        return None

    return check


def _first(problems) -> str:
    while isinstance(problems, (list, dict)) and problems:
        problems = problems[0] if isinstance(problems, list) else next(iter(problems.values()))
    return str(problems)


# ---------------------------------------------------------------- request building

SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "seed", "presence_penalty", "frequency_penalty",
                   "repetition_penalty", "min_tokens", "ignore_eos", "stop_token_ids", "n")
DEFAULT_MAX_TOKENS = 16


def build_call(url: str, body: dict) -> EngineCall:
    max_tokens = body.get("max_completion_tokens") or body.get("max_tokens") or DEFAULT_MAX_TOKENS
    params = {k: body[k] for k in SAMPLING_FIELDS if body.get(k) is not None}
    params["max_tokens"] = int(max_tokens)
    if body.get("stop") is not None:
        params["stop"] = body["stop"]
    if url == "/v1/chat/completions":
        ids = chat_prompt_ids(settings.MODEL, body["messages"])
        return EngineCall(url, body["model"], list(ids), None, params, int(max_tokens))
    prompt = body["prompt"]
    if isinstance(prompt, list):
        return EngineCall(url, body["model"], list(prompt), None, params, int(max_tokens))
    return EngineCall(url, body["model"], text_prompt_ids(settings.MODEL, prompt), None, params, int(max_tokens))


def prompt_tokens(call: EngineCall) -> int:
    return len(call.prompt_token_ids or [])


# ---------------------------------------------------------------- running one line

def submit(call: EngineCall, request_id: str, user_id: int) -> None:
    engine.submit(prompt_token_ids=call.prompt_token_ids, sampling_params=call.sampling_params,
                  priority_class=BATCH_PRIORITY_CLASS, user=user_id, request_id=request_id)


def wait(call: EngineCall, request_id: str, timeout: float) -> LineOutcome:
    """Collect the request's whole result and shape it as the endpoint's response (or an error)."""
    started = time.monotonic()
    result = engine.collect(request_id, n=call.sampling_params.get("n", 1), timeout=timeout)
    latency_ms = (time.monotonic() - started) * 1000
    engine.delete_output(request_id)
    usage = result.get("usage") or {}
    if result.get("error"):
        return error_outcome(result["error"], usage, latency_ms)
    body = response_body(call, request_id, result)
    return LineOutcome(ok=True, status_code=200, body=body, usage=usage, metrics=result.get("metrics") or {},
                       latency_ms=latency_ms)


ERROR_STATUS = {"invalid_request": 400, "no_worker": 503, "worker_lost": 503, "worker_shutdown": 503,
                "expired": 408, "timeout": 408}


def error_outcome(error: dict, usage: dict, latency_ms: float) -> LineOutcome:
    code = error.get("code") or "engine_error"
    status = ERROR_STATUS.get(code, 500)
    kind = "invalid_request_error" if status == 400 else "server_error"
    body = {"error": {"message": error.get("message", code), "type": kind, "param": error.get("param"), "code": code}}
    return LineOutcome(ok=False, status_code=status, body=body, error=None, usage=usage, latency_ms=latency_ms)


def was_aborted(outcome: LineOutcome) -> bool:
    choices = (outcome.body or {}).get("choices") or []
    return any(c.get("finish_reason") == "abort" for c in choices)


def response_body(call: EngineCall, request_id: str, result: dict) -> dict:
    usage = result.get("usage") or {}
    prompt, completion = usage.get("prompt_tokens", 0), usage.get("completion_tokens", 0)
    shaped_usage = {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                    "prompt_tokens_details": {"cached_tokens": usage.get("cached_tokens", 0)}}
    created = int(time.time())
    if call.url == "/v1/chat/completions":
        choices = [{"index": c["index"], "message": {"role": "assistant", "content": c["text"]},
                    "logprobs": None, "finish_reason": c["finish_reason"]} for c in result["choices"]]
        return {"id": f"chatcmpl-{request_id}", "object": "chat.completion", "created": created,
                "model": call.model, "choices": choices, "usage": shaped_usage}
    choices = [{"index": c["index"], "text": c["text"], "logprobs": None, "finish_reason": c["finish_reason"]}
               for c in result["choices"]]
    return {"id": f"cmpl-{request_id}", "object": "text_completion", "created": created, "model": call.model,
            "choices": choices, "usage": shaped_usage}
