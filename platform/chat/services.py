"""Writes for the playground: conversations, user turns, edits, regenerations and finished replies.

A reply's life: begin_* (validate, admit the generation through the generation service and
create the streaming assistant message, all in one transaction so a refusal leaves nothing
behind) -> the consumer submits it and streams it (save_progress as it goes) -> the generation
service's finish with save_reply, exactly once: the message, the usage row and the quota
settlement. save_reply is the once-guard, so several followers may try.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from functools import partial

from django.db import transaction
from django.utils import timezone

from common.storable import storable
from errors import InvalidRequest
from generation import services as generation
from generation.services import Generation
from quotas.ledger import Reservation

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
    gen: Generation

    @property
    def request_id(self) -> str:
        return self.gen.request_id

    @property
    def model(self) -> str:
        return self.gen.model

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.gen.prompts[0]

    @property
    def sampling_params(self) -> dict:
        return self.gen.sampling_params


def title_from(text: str) -> str:
    line = " ".join(text.split())
    return line if len(line) <= TITLE_LENGTH else line[: TITLE_LENGTH - 1] + "…"


def create_conversation(
    user, *, model: str = "", system_prompt: str = "", params: dict | None = None, title: str = ""
) -> Conversation:
    return Conversation.objects.create(
        user=user,
        model=model or prompting.served_model_name(),
        system_prompt=system_prompt,
        params=params or {},
        title=title,
    )


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
    if "\x00" in content:  # PostgreSQL's text cannot hold it (SQLite's can): one rule for both
        raise ChatError("Messages cannot contain the NUL character (\\x00).")
    return content


def _apply_settings(conversation: Conversation, settings: dict) -> dict:
    """Store the panel's model, system prompt and parameters on the conversation; return clean params."""
    try:
        clean = chat_params.clean(settings.get("params"))
    except chat_params.InvalidParams as exc:
        raise ChatError(f"Invalid parameter {exc}", code="invalid_params") from None
    conversation.params = clean
    if "system_prompt" in settings:
        system_prompt = str(settings.get("system_prompt") or "")[:MAX_MESSAGE_CHARS]
        if "\x00" in system_prompt:
            raise ChatError("The system prompt cannot contain the NUL character (\\x00).")
        conversation.system_prompt = system_prompt
    model = settings.get("model") or conversation.model or prompting.served_model_name()
    if model not in prompting.available_models():
        raise ChatError(f"The model '{model}' is not being served.", code="model_not_found")
    conversation.model = model
    conversation.save()
    return clean


def _begin_reply(
    user, conversation: Conversation, user_message: Message, params: dict, arrived_at: float | None
) -> Reply:
    """Reserve quota and create the streaming assistant message (inside the caller's transaction)."""
    ids = prompting.prompt_token_ids(
        conversation.model, conversation.system_prompt, selectors.branch_turns(user_message)
    )
    gen = Generation(
        source="playground",
        endpoint="playground",
        user=user,
        model=conversation.model,
        prompts=[ids],
        sampling_params=chat_params.sampling_params(params),
        max_tokens=params["max_tokens"],
        arrived_at=arrived_at,
    )
    generation.admit(gen)
    try:  # if saving fails, the reservation must not leak: give it back with nothing used
        assistant = Message.objects.create(
            conversation=conversation,
            parent=user_message,
            role=Message.Role.ASSISTANT,
            status=Message.Status.STREAMING,
            request_id=gen.request_id,
            model=conversation.model,
            params=params,
            reservation=gen.reservation.as_dict(),
            prompt_tokens=len(ids),
        )
        conversation.current_leaf = assistant
        conversation.save(update_fields=["current_leaf", "updated_at"])
    except Exception:
        generation.release(gen)
        raise
    return Reply(
        conversation_id=str(conversation.pk), user_message_id=user_message.pk, message_id=assistant.pk, gen=gen
    )


def send_message(
    user, content, settings: dict, conversation: Conversation | None = None, *, arrived_at: float | None = None
) -> Reply:
    """A new user turn at the end of the branch on screen (a new conversation when none is given)."""
    content = _clean_content(content)
    with transaction.atomic():
        if conversation is None:
            conversation = create_conversation(user, title=title_from(content))
        elif conversation.current_leaf and conversation.current_leaf.status == Message.Status.STREAMING:
            raise ChatError("An answer is still being generated in this conversation.", code="busy")
        clean = _apply_settings(conversation, settings)
        user_message = Message.objects.create(
            conversation=conversation, parent=conversation.current_leaf, role=Message.Role.USER, content=content
        )
        return _begin_reply(user, conversation, user_message, clean, arrived_at)


def edit_message(user, message: Message, content, settings: dict, *, arrived_at: float | None = None) -> Reply:
    """Resend an edited user turn as a sibling of the original; the old branch stays reachable."""
    if message.role != Message.Role.USER:
        raise ChatError("Only your own messages can be edited.")
    content = _clean_content(content)
    with transaction.atomic():
        conversation = message.conversation
        clean = _apply_settings(conversation, settings)
        edited = Message.objects.create(
            conversation=conversation, parent=message.parent, role=Message.Role.USER, content=content
        )
        return _begin_reply(user, conversation, edited, clean, arrived_at)


def regenerate(user, message: Message, settings: dict, *, arrived_at: float | None = None) -> Reply:
    """A new answer to the same user turn, as a sibling of `message` (an assistant message)."""
    if message.role != Message.Role.ASSISTANT or message.parent is None:
        raise ChatError("Only answers can be regenerated.")
    if message.status == Message.Status.STREAMING:
        raise ChatError("Wait for the answer to finish (or stop it) before regenerating.")
    with transaction.atomic():
        conversation = message.conversation
        clean = _apply_settings(conversation, settings)
        return _begin_reply(user, conversation, message.parent, clean, arrived_at)


def save_progress(message_id: int, content: str) -> None:
    """Persist the text so far, so a reload mid-answer shows it (only while still streaming)."""
    Message.objects.filter(pk=message_id, status=Message.Status.STREAMING).update(
        content=storable(content), updated_at=timezone.now()
    )


def generation_for(message: Message) -> Generation:
    """The generation of a reply already under way (a resumed socket, a stale reply's clean-up)."""
    reservation = Reservation.from_dict(message.reservation) if message.reservation else None
    return Generation(
        source="playground",
        endpoint="playground",
        user=message.conversation.user,
        model=message.model,
        prompts=[[]],
        prompt_tokens=message.prompt_tokens or 0,
        sampling_params={},
        request_id=message.request_id,
        reservation=reservation,
        arrived_at=message.created_at.timestamp(),
    )


def reply_status(gen: Generation) -> str:
    if gen.outcome[0] != 200:
        return Message.Status.ERROR
    return Message.Status.STOPPED if gen.result.finish_reason == "abort" else Message.Status.COMPLETE


def tokens_per_s(gen: Generation) -> float | None:
    """Decode speed: completion tokens over the time after the first one."""
    if not gen.result.completion_tokens or gen.ttft_ms is None:
        return None
    decode_s = (gen.latency_ms - gen.ttft_ms) / 1000
    return round(gen.result.completion_tokens / decode_s, 2) if decode_s > 0 else None


def save_reply(message_id: int, gen: Generation, saved_content: str = "") -> bool:
    """The final answer from the generation's result; False if another follower saved it first
    (the generation service runs this in the transaction that writes the usage row)."""
    message = Message.objects.select_for_update().filter(pk=message_id, status=Message.Status.STREAMING).first()
    if message is None:
        return False
    result = gen.result
    message.content = storable(result.text or saved_content)
    message.status = reply_status(gen)
    message.finish_reason = result.finish_reason or ("error" if message.status == Message.Status.ERROR else "")
    message.error = (result.error or {}).get("message", "") if message.status == Message.Status.ERROR else ""
    message.prompt_tokens = gen.charged_tokens()[0]
    message.completion_tokens = result.completion_tokens
    message.cached_tokens = result.cached_tokens
    message.ttft_ms, message.latency_ms, message.tokens_per_s = gen.ttft_ms, gen.latency_ms, tokens_per_s(gen)
    message.save()
    Conversation.objects.filter(pk=message.conversation_id).update(updated_at=timezone.now())
    return True


def finish_reply(message_id: int, gen: Generation, saved_content: str = "") -> bool:
    """Save the reply, record usage and settle its quota, once (False if it was already finished)."""
    return generation.finish(gen, save=partial(save_reply, message_id, saved_content=saved_content))


STALE_AFTER_S = 600


def finish_stale_replies(older_than_s: float = STALE_AFTER_S, collect_timeout_s: float = 2.0) -> int:
    """Finish replies stuck in "streaming" (their web process died and nobody reconnected).

    What the engine produced is read from the request's output stream; a request still running
    is aborted (the stream's timeout) and saved as stopped. Each is finished through the
    generation service, so quota is settled and usage recorded once.
    """
    cutoff = timezone.now() - timedelta(seconds=older_than_s)
    finished = 0
    for message in Message.objects.select_related("conversation__user").filter(
        status=Message.Status.STREAMING, updated_at__lt=cutoff
    ):
        gen = generation_for(message)
        gen.result = generation.collect(message.request_id, model=message.model, timeout=collect_timeout_s)
        if (gen.result.error or {}).get("code") == "timeout":  # still running with nobody following: aborted
            gen.result.error = None
            gen.result.choices[0].finish_reason = "abort"
        if finish_reply(message.pk, gen, saved_content=message.content):
            finished += 1
    return finished
