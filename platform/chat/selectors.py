"""Reads for the playground and history: a user's conversations, branches, exports, API requests."""

from __future__ import annotations

from django.core.exceptions import ValidationError
from django.db.models import Q, QuerySet

from usage.models import UsageRecord

from .models import Conversation, Message


def conversations_for(user, query: str = "") -> QuerySet[Conversation]:
    """The user's conversations, newest activity first, optionally matching `query` in titles or text."""
    qs = Conversation.objects.filter(user=user)
    query = query.strip()
    if query:
        qs = qs.filter(
            Q(title__icontains=query) | Q(messages__content__icontains=query) | Q(system_prompt__icontains=query)
        ).distinct()
    return qs.order_by("-updated_at")


def conversation_for(user, conversation_id) -> Conversation | None:
    """One of the user's own conversations, or None (another user's is indistinguishable from missing)."""
    try:
        return Conversation.objects.filter(user=user, pk=conversation_id).first()
    except (ValueError, TypeError, ValidationError):  # not a UUID
        return None


def message_for(user, message_id) -> Message | None:
    try:
        return Message.objects.select_related("conversation").filter(conversation__user=user, pk=message_id).first()
    except (ValueError, TypeError, ValidationError):
        return None


def _by_id(conversation: Conversation) -> dict[int, Message]:
    return {m.pk: m for m in conversation.messages.all()}


def path_to(message: Message, messages: dict[int, Message] | None = None) -> list[Message]:
    """Messages from the root down to `message`."""
    messages = messages if messages is not None else _by_id(message.conversation)
    path, node = [], message
    while node is not None:
        path.append(node)
        node = messages.get(node.parent_id) if node.parent_id else None
    return path[::-1]


def branch_turns(message: Message) -> list[dict]:
    """Chat-template turns ({"role", "content"}) for the branch ending at `message` (failed answers left out)."""
    return [{"role": m.role, "content": m.content} for m in path_to(message) if m.status != Message.Status.ERROR]


def latest_leaf(message: Message, messages: dict[int, Message] | None = None) -> Message:
    """Follow the newest child down from `message` to a leaf (what selecting a branch shows)."""
    messages = messages if messages is not None else _by_id(message.conversation)
    children: dict[int | None, list[Message]] = {}
    for m in messages.values():
        children.setdefault(m.parent_id, []).append(m)
    node = message
    while children.get(node.pk):
        node = max(children[node.pk], key=lambda m: (m.created_at, m.pk))
    return node


def current_branch(conversation: Conversation) -> list[dict]:
    """The branch on screen, each message with its siblings (other versions at the same place)."""
    messages = _by_id(conversation)
    leaf = messages.get(conversation.current_leaf_id)
    if leaf is None and messages:
        roots = [m for m in messages.values() if m.parent_id is None]
        leaf = latest_leaf(max(roots, key=lambda m: (m.created_at, m.pk)), messages)
    if leaf is None:
        return []
    siblings: dict[int | None, list[int]] = {}
    for m in sorted(messages.values(), key=lambda m: (m.created_at, m.pk)):
        siblings.setdefault(m.parent_id, []).append(m.pk)
    return [message_dict(m, siblings[m.parent_id]) for m in path_to(leaf, messages)]


def message_dict(message: Message, sibling_ids: list[int] | None = None) -> dict:
    """What the playground's JavaScript receives for one message."""
    sibling_ids = sibling_ids or [message.pk]
    return {
        "id": message.pk,
        "parent_id": message.parent_id,
        "role": message.role,
        "content": message.content,
        "status": message.status,
        "finish_reason": message.finish_reason,
        "error": message.error,
        "model": message.model,
        "siblings": sibling_ids,
        "sibling_index": sibling_ids.index(message.pk),
        "stats": message_stats(message),
    }


def message_stats(message: Message) -> dict | None:
    if message.role != Message.Role.ASSISTANT or message.status == Message.Status.STREAMING:
        return None
    return {
        "prompt_tokens": message.prompt_tokens,
        "completion_tokens": message.completion_tokens,
        "cached_tokens": message.cached_tokens,
        "ttft_ms": message.ttft_ms,
        "tokens_per_s": message.tokens_per_s,
        "latency_ms": message.latency_ms,
    }


def export_json(conversation: Conversation) -> dict:
    """The whole tree (every branch), with parent links, for download."""
    return {
        "id": str(conversation.pk),
        "title": conversation.title,
        "model": conversation.model,
        "system_prompt": conversation.system_prompt,
        "params": conversation.params,
        "created_at": conversation.created_at.isoformat(),
        "updated_at": conversation.updated_at.isoformat(),
        "current_leaf_id": conversation.current_leaf_id,
        "messages": [
            {
                "id": m.pk,
                "parent_id": m.parent_id,
                "role": m.role,
                "content": m.content,
                "status": m.status,
                "finish_reason": m.finish_reason,
                "created_at": m.created_at.isoformat(),
                "stats": message_stats(m),
            }
            for m in conversation.messages.order_by("created_at", "pk")
        ],
    }


def export_markdown(conversation: Conversation) -> str:
    """The branch on screen as Markdown."""
    lines = [f"# {conversation.title or 'Conversation'}", ""]
    if conversation.model:
        lines += [f"*Model: {conversation.model}*", ""]
    if conversation.system_prompt:
        lines += ["## System", "", conversation.system_prompt, ""]
    for m in current_branch(conversation):
        lines += [f"## {m['role'].capitalize()}", "", m["content"], ""]
    return "\n".join(lines)


# ---------------------------------------------------------------- API request history

REQUEST_FILTERS = ("source", "endpoint", "model", "status")


def usage_records_for(user, filters: dict | None = None) -> QuerySet[UsageRecord]:
    """The user's requests, newest first; filters: source, endpoint, model, status ("ok"|"error"), date_from/to."""
    filters = filters or {}
    qs = UsageRecord.objects.filter(user=user).select_related("api_key").order_by("-created_at")
    for field in ("source", "endpoint", "model"):
        if filters.get(field):
            qs = qs.filter(**{field: filters[field]})
    if filters.get("status") == "ok":
        qs = qs.filter(status_code__lt=400)
    elif filters.get("status") == "error":
        qs = qs.filter(status_code__gte=400)
    if filters.get("date_from"):
        qs = qs.filter(created_at__date__gte=filters["date_from"])
    if filters.get("date_to"):
        qs = qs.filter(created_at__date__lte=filters["date_to"])
    return qs


def usage_record_for(user, record_id) -> UsageRecord | None:
    return UsageRecord.objects.select_related("api_key").filter(user=user, pk=record_id).first()


def filter_choices(user) -> dict[str, list[str]]:
    mine = UsageRecord.objects.filter(user=user)
    return {
        field: sorted(v for v in mine.values_list(field, flat=True).distinct() if v)
        for field in ("source", "endpoint", "model")
    }


def usage_totals(user, since) -> dict:
    from django.db.models import Count, Sum

    agg = UsageRecord.objects.filter(user=user, created_at__gte=since).aggregate(
        requests=Count("id"), prompt_tokens=Sum("prompt_tokens"), completion_tokens=Sum("completion_tokens")
    )
    return {k: v or 0 for k, v in agg.items()}


def sibling_ids(message: Message) -> list[int]:
    return list(
        Message.objects.filter(conversation_id=message.conversation_id, parent_id=message.parent_id)
        .order_by("created_at", "pk")
        .values_list("pk", flat=True)
    )


def message_payload(message: Message) -> dict:
    """message_dict with its siblings looked up (for single messages sent over the socket)."""
    return message_dict(message, sibling_ids(message))


def reply_started_payload(reply) -> dict:
    """The socket frame announcing a new reply: its conversation, the user turn and the empty answer."""
    assistant = Message.objects.select_related("conversation", "parent").get(pk=reply.message_id)
    conversation = assistant.conversation
    return {
        "type": "started",
        "request_id": reply.request_id,
        "conversation": {"id": str(conversation.pk), "title": conversation.title},
        "user_message": message_payload(assistant.parent),
        "message": message_payload(assistant),
    }
