"""Writes for the playground: conversations, user turns, edits, regenerations and finished replies.

A reply's life: begin_* (validate, reserve quota, create the streaming assistant message, all in
one transaction so a refusal leaves nothing behind) -> the consumer submits it to the engine and
streams it (save_progress as it goes) -> finish_reply, exactly once, which settles the quota
reservation and records usage. finish_reply is safe to call from several followers.
"""
from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

from django.db import transaction
from django.utils import timezone

from engine_client import client as engine
from errors import InvalidRequest
from inference import protocol
from quotas import services as quotas
from quotas.ledger import Reservation
from usage import services as usage

from . import params as chat_params
from . import prompting, selectors
from .models import Conversation, Message

TITLE_LENGTH = 60
MAX_MESSAGE_CHARS = 32_000


class ChatError(InvalidRequest):
    """A request the playground refuses with a readable message (bad input, not found)."""

    code = "invalid_request"


@dataclass(frozen=True)
class Reply:
    """Everything the consumer needs to submit and follow one assistant message."""

    conversation_id: str
    user_message_id: int
    message_id: int
    request_id: str
    model: str
    prompt_token_ids: list[int]
    sampling_params: dict


def title_from(text: str) -> str:
    line = " ".join(text.split())
    return line if len(line) <= TITLE_LENGTH else line[: TITLE_LENGTH - 1] + "…"


def create_conversation(user, *, model: str = "", system_prompt: str = "", params: dict | None = None,
                        title: str = "") -> Conversation:
    return Conversation.objects.create(user=user, model=model or prompting.served_model_name(),
                                       system_prompt=system_prompt, params=params or {}, title=title)


def rename_conversation(conversation: Conversation, title: str) -> Conversation:
    conversation.title = title.strip()[:200]
    conversation.save(update_fields=["title", "updated_at"])
    return conversation


def delete_conversation(conversation: Conversation) -> None:
    conversation.delete()


def select_branch(conversation: Conversation, message: Message) -> Conversation:
    """Show the branch through `message` (its newest continuation)."""
    if message.conversation_id != conversation.pk:
        raise ChatError("That message is not part of this conversation.", code="not_found")
    conversation.current_leaf = selectors.latest_leaf(message)
    conversation.save(update_fields=["current_leaf"])
    return conversation


def _clean_content(content) -> str:
    if not isinstance(content, str) or not content.strip():
        raise ChatError("Write a message first.")
    if len(content) > MAX_MESSAGE_CHARS:
        raise ChatError(f"Messages are limited to {MAX_MESSAGE_CHARS} characters.")
    return content


def _apply_settings(conversation: Conversation, settings: dict) -> dict:
    """Store the panel's model, system prompt and parameters on the conversation; return clean params."""
    try:
        clean = chat_params.clean(settings.get("params"))
    except chat_params.InvalidParams as exc:
        raise ChatError(f"Invalid parameter {exc}", code="invalid_params") from None
    conversation.params = clean
    if "system_prompt" in settings:
        conversation.system_prompt = str(settings.get("system_prompt") or "")[:MAX_MESSAGE_CHARS]
    model = settings.get("model") or conversation.model or prompting.served_model_name()
    if model not in prompting.available_models():
        raise ChatError(f"The model '{model}' is not being served.", code="model_not_found")
    conversation.model = model
    conversation.save()
    return clean


def _begin_reply(user, conversation: Conversation, user_message: Message, params: dict) -> Reply:
    """Reserve quota and create the streaming assistant message (inside the caller's transaction)."""
    ids = prompting.prompt_token_ids(conversation.model, conversation.system_prompt,
                                     selectors.branch_turns(user_message))
    reservation = quotas.reserve(user, conversation.model, len(ids), params["max_tokens"], source="playground")
    try:  # if saving fails, the reservation must not leak: settle it with nothing used
        assistant = Message.objects.create(
            conversation=conversation, parent=user_message, role=Message.Role.ASSISTANT,
            status=Message.Status.STREAMING, request_id=protocol.new_request_id(), model=conversation.model,
            params=params, reservation=reservation.as_dict(), prompt_tokens=len(ids))
        conversation.current_leaf = assistant
        conversation.save(update_fields=["current_leaf", "updated_at"])
    except Exception:
        quotas.settle(reservation, 0, 0)
        raise
    return Reply(conversation_id=str(conversation.pk), user_message_id=user_message.pk, message_id=assistant.pk,
                 request_id=assistant.request_id, model=conversation.model, prompt_token_ids=ids,
                 sampling_params=chat_params.sampling_params(params))


def send_message(user, content, settings: dict, conversation: Conversation | None = None) -> Reply:
    """A new user turn at the end of the branch on screen (a new conversation when none is given)."""
    content = _clean_content(content)
    with transaction.atomic():
        if conversation is None:
            conversation = create_conversation(user, title=title_from(content))
        elif conversation.current_leaf and conversation.current_leaf.status == Message.Status.STREAMING:
            raise ChatError("An answer is still being generated in this conversation.", code="busy")
        clean = _apply_settings(conversation, settings)
        user_message = Message.objects.create(conversation=conversation, parent=conversation.current_leaf,
                                              role=Message.Role.USER, content=content)
        return _begin_reply(user, conversation, user_message, clean)


def edit_message(user, message: Message, content, settings: dict) -> Reply:
    """Resend an edited user turn as a sibling of the original; the old branch stays reachable."""
    if message.role != Message.Role.USER:
        raise ChatError("Only your own messages can be edited.")
    content = _clean_content(content)
    with transaction.atomic():
        conversation = message.conversation
        clean = _apply_settings(conversation, settings)
        edited = Message.objects.create(conversation=conversation, parent=message.parent,
                                        role=Message.Role.USER, content=content)
        return _begin_reply(user, conversation, edited, clean)


def regenerate(user, message: Message, settings: dict) -> Reply:
    """A new answer to the same user turn, as a sibling of `message` (an assistant message)."""
    if message.role != Message.Role.ASSISTANT or message.parent is None:
        raise ChatError("Only answers can be regenerated.")
    if message.status == Message.Status.STREAMING:
        raise ChatError("Wait for the answer to finish (or stop it) before regenerating.")
    with transaction.atomic():
        conversation = message.conversation
        clean = _apply_settings(conversation, settings)
        return _begin_reply(user, conversation, message.parent, clean)


def save_progress(message_id: int, content: str) -> None:
    """Persist the text so far, so a reload mid-answer shows it (only while still streaming)."""
    Message.objects.filter(pk=message_id, status=Message.Status.STREAMING).update(
        content=content, updated_at=timezone.now())


@dataclass
class Outcome:
    """How a reply ended, as the stream follower measured it."""

    content: str
    finish_reason: str = ""
    error: str = ""
    error_code: str = ""
    prompt_tokens: int | None = None
    completion_tokens: int = 0
    cached_tokens: int = 0
    ttft_ms: float | None = None  # from the websocket frame's arrival (usage.models.UsageRecord)
    engine_ttft_ms: float | None = None  # from the worker's acceptance (the finish event's metrics)
    latency_ms: float | None = None

    @property
    def status(self) -> str:
        if self.error:
            return Message.Status.ERROR
        return Message.Status.STOPPED if self.finish_reason == "abort" else Message.Status.COMPLETE

    @property
    def tokens_per_s(self) -> float | None:
        if not self.completion_tokens or self.latency_ms is None or self.ttft_ms is None:
            return None
        decode_s = (self.latency_ms - self.ttft_ms) / 1000
        return round(self.completion_tokens / decode_s, 2) if decode_s > 0 else None


def finish_reply(message_id: int, outcome: Outcome) -> Message | None:
    """Save the final answer, settle its quota reservation and record usage: once; None if already done."""
    with transaction.atomic():
        message = (Message.objects.select_for_update().select_related("conversation__user")
                   .filter(pk=message_id, status=Message.Status.STREAMING).first())
        if message is None:
            return None
        prompt_tokens = outcome.prompt_tokens if outcome.prompt_tokens is not None else (message.prompt_tokens or 0)
        message.content = outcome.content
        message.status = outcome.status
        message.finish_reason = outcome.finish_reason or ("error" if outcome.error else "")
        message.error = outcome.error
        message.prompt_tokens = prompt_tokens
        message.completion_tokens = outcome.completion_tokens
        message.cached_tokens = outcome.cached_tokens
        message.ttft_ms = outcome.ttft_ms
        message.latency_ms = outcome.latency_ms
        message.tokens_per_s = outcome.tokens_per_s
        message.save()
        Conversation.objects.filter(pk=message.conversation_id).update(updated_at=timezone.now())
        usage.record_usage(
            user=message.conversation.user, source="playground", endpoint="playground", model=message.model,
            request_id=message.request_id, prompt_tokens=prompt_tokens, completion_tokens=outcome.completion_tokens,
            cached_tokens=outcome.cached_tokens, ttft_ms=outcome.ttft_ms, engine_ttft_ms=outcome.engine_ttft_ms,
            latency_ms=outcome.latency_ms,
            status_code=500 if outcome.error else 200, error_code=outcome.error_code)
    if message.reservation:
        quotas.settle(Reservation.from_dict(message.reservation), prompt_tokens, outcome.completion_tokens)
    return message


STALE_AFTER_S = 600


def outcome_from_result(result: dict, saved_content: str) -> Outcome:
    """An Outcome from engine_client.collect()'s result (used when no live follower is left)."""
    choice = result["choices"][0] if result["choices"] else {"text": "", "token_ids": [], "finish_reason": None}
    usage_info = result.get("usage") or {}
    error = result.get("error")
    outcome = Outcome(content=choice["text"] or saved_content, finish_reason=choice.get("finish_reason") or "",
                      prompt_tokens=usage_info.get("prompt_tokens"),
                      completion_tokens=usage_info.get("completion_tokens", len(choice["token_ids"])),
                      cached_tokens=usage_info.get("cached_tokens") or 0)
    if error and error.get("code") == "timeout":  # still running with nobody following: collect() aborted it
        outcome.finish_reason = "abort"
    elif error:
        outcome.error, outcome.error_code = error.get("message", "The engine failed."), error.get("code", "")
    return outcome


def finish_stale_replies(older_than_s: float = STALE_AFTER_S, collect_timeout_s: float = 2.0) -> int:
    """Finish replies stuck in "streaming" (their web process died and nobody reconnected).

    What the engine produced is folded from the request's output stream; a request still running
    is aborted. Each is finished through finish_reply, so quota is settled and usage recorded once.
    """
    cutoff = timezone.now() - timedelta(seconds=older_than_s)
    finished = 0
    for message in Message.objects.filter(status=Message.Status.STREAMING, updated_at__lt=cutoff):
        result = engine.client().collect(message.request_id, model=message.model, timeout=collect_timeout_s)
        if finish_reply(message.pk, outcome_from_result(result, message.content)) is not None:
            finished += 1
    return finished
