"""Staff-only dashboard page and its JSON feeds; everyone else gets 404 (the page does not exist for them)."""

from __future__ import annotations

from functools import wraps

from django.contrib.auth import get_user_model
from django.http import Http404, JsonResponse
from django.shortcuts import get_object_or_404, render
from django.views.decorators.http import require_GET

from . import live, selectors
from .consumers import is_staff


def staff_or_404(view):
    @wraps(view)
    def wrapped(request, *args, **kwargs):
        if not is_staff(request.user):
            raise Http404("no such page")
        return view(request, *args, **kwargs)

    return wrapped


def _window(request) -> selectors.Window:
    range_key = request.GET.get("range", "24h")
    if range_key not in selectors.RANGES:
        range_key = "24h"
    return selectors.window_for(range_key, request.GET.get("bucket"))


@staff_or_404  # outermost: for non-staff not even the allowed methods are revealed
@require_GET
def index(request):
    return render(request, "dashboard/index.html", {"ranges": list(selectors.RANGES)})


@staff_or_404
@require_GET
def user_page(request, user_id: int):
    user = get_object_or_404(get_user_model(), pk=user_id)
    return render(request, "dashboard/user.html", {"subject": user, "ranges": list(selectors.RANGES)})


@staff_or_404
@require_GET
def usage_json(request):
    window = _window(request)
    return JsonResponse(
        {
            "window": {"start": window.start.isoformat(), "end": window.end.isoformat(), "bucket": window.bucket},
            "totals": selectors.totals(window),
            "over_time": selectors.usage_over_time(window),
            "by_model": selectors.breakdown(window, "model"),
            "by_source": selectors.breakdown(window, "source"),
            "model_over_time": selectors.usage_over_time_by(window, "model"),
            "source_over_time": selectors.usage_over_time_by(window, "source"),
            "top_users": selectors.top_users(window),
            "top_api_keys": selectors.top_api_keys(window),
            "latency_over_time": selectors.latency_over_time(window),
            "quotas": selectors.users_near_quota(),
            "batches": selectors.batch_summary(),
        }
    )


@staff_or_404
@require_GET
def user_json(request, user_id: int):
    user = get_object_or_404(get_user_model(), pk=user_id)
    window = _window(request)
    return JsonResponse(
        {
            "window": {"start": window.start.isoformat(), "end": window.end.isoformat(), "bucket": window.bucket},
            **selectors.user_drilldown(user, window),
        }
    )


@staff_or_404
@require_GET
def engine_json(request):
    return JsonResponse(live.engine_snapshot())
