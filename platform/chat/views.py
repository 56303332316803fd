"""Playground and history pages: thin views over chat.selectors / chat.services."""

from __future__ import annotations

import json
from datetime import timedelta

from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.core.paginator import Paginator
from django.http import Http404, HttpResponse, JsonResponse
from django.shortcuts import redirect, render
from django.utils import timezone
from django.utils.text import slugify
from django.views.decorators.http import require_POST

from quotas import selectors as quota_selectors

from . import params as chat_params
from . import prompting, selectors, services

PAGE_SIZE = 20


def home(request):
    return redirect("chat:playground" if request.user.is_authenticated else "accounts:login")


def _own_conversation(request, conversation_id):
    conversation = selectors.conversation_for(request.user, conversation_id)
    if conversation is None:
        raise Http404("No such conversation")
    return conversation


@login_required
def playground(request, conversation_id=None):
    conversation = _own_conversation(request, conversation_id) if conversation_id else None
    state = {
        "conversation": None
        if conversation is None
        else {
            "id": str(conversation.pk),
            "title": conversation.title,
            "model": conversation.model,
            "system_prompt": conversation.system_prompt,
        },
        "messages": selectors.current_branch(conversation) if conversation else [],
        "params": {**chat_params.defaults(), **(conversation.params if conversation else {})},
        "param_defaults": chat_params.defaults(),
        "param_sources": chat_params.default_sources(),
        "models": prompting.available_models(),
        "ws_path": "/ws/chat/",
    }
    return render(
        request,
        "chat/playground.html",
        {
            "conversation": conversation,
            "state": state,
            "recent": selectors.conversations_for(request.user)[:30],
        },
    )


# ---------------------------------------------------------------- conversation history


@login_required
def conversation_list(request):
    query = request.GET.get("q", "")
    page = Paginator(selectors.conversations_for(request.user, query), PAGE_SIZE).get_page(request.GET.get("page"))
    return render(request, "chat/history.html", {"page": page, "query": query})


@require_POST
@login_required
def conversation_rename(request, conversation_id):
    conversation = _own_conversation(request, conversation_id)
    services.rename_conversation(conversation, request.POST.get("title", ""))
    if request.headers.get("accept") == "application/json":
        return JsonResponse({"id": str(conversation.pk), "title": conversation.title})
    messages.success(request, "Conversation renamed.")
    return redirect(request.POST.get("next") or "history:conversations")


@require_POST
@login_required
def conversation_delete(request, conversation_id):
    services.delete_conversation(_own_conversation(request, conversation_id))
    messages.success(request, "Conversation deleted.")
    return redirect("history:conversations")


def _download_name(conversation, ext: str) -> str:
    return f"{slugify(conversation.title) or 'conversation'}-{str(conversation.pk)[:8]}.{ext}"


@login_required
def conversation_export_json(request, conversation_id):
    conversation = _own_conversation(request, conversation_id)
    response = HttpResponse(
        json.dumps(selectors.export_json(conversation), indent=2, ensure_ascii=False),
        content_type="application/json; charset=utf-8",
    )
    response["Content-Disposition"] = f'attachment; filename="{_download_name(conversation, "json")}"'
    return response


@login_required
def conversation_export_markdown(request, conversation_id):
    conversation = _own_conversation(request, conversation_id)
    response = HttpResponse(selectors.export_markdown(conversation), content_type="text/markdown; charset=utf-8")
    response["Content-Disposition"] = f'attachment; filename="{_download_name(conversation, "md")}"'
    return response


# ---------------------------------------------------------------- API requests and usage


@login_required
def request_list(request):
    filters = {k: request.GET.get(k, "") for k in (*selectors.REQUEST_FILTERS, "date_from", "date_to")}
    page = Paginator(selectors.usage_records_for(request.user, filters), PAGE_SIZE).get_page(request.GET.get("page"))
    query = request.GET.copy()
    query.pop("page", None)
    return render(
        request,
        "chat/requests.html",
        {
            "page": page,
            "filters": filters,
            "choices": [
                (field, values, filters.get(field, ""))
                for field, values in selectors.filter_choices(request.user).items()
            ],
            "querystring": query.urlencode(),
        },
    )


@login_required
def request_detail(request, record_id: int):
    record = selectors.usage_record_for(request.user, record_id)
    if record is None:
        raise Http404("No such request")
    return render(request, "chat/request_detail.html", {"record": record})


def _meter(used: int, limit: int | None) -> int | None:
    return None if not limit else min(100, round(100 * used / limit))


@login_required
def usage(request):
    status = quota_selectors.quota_status(request.user)
    now = timezone.now()
    start_of_day = now.replace(hour=0, minute=0, second=0, microsecond=0)
    return render(
        request,
        "chat/usage.html",
        {
            "status": status,
            "plan": status.plan,
            "day_pct": _meter(status.usage.tokens_today, status.plan.tokens_per_day),
            "month_pct": _meter(status.usage.tokens_this_month, status.plan.tokens_per_month),
            "today": selectors.usage_totals(request.user, start_of_day),
            "last_30_days": selectors.usage_totals(request.user, now - timedelta(days=30)),
            "headers": quota_selectors.headers_for(status),
        },
    )
