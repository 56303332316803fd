"""The Batches web pages (session auth): upload and start, list, live progress, cancel, download."""

from __future__ import annotations

from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.http import Http404
from django.shortcuts import redirect, render
from django.views.decorators.http import require_POST

from errors import NotFound, ServiceError

from . import presenters, selectors, services
from .validation import SUPPORTED_URLS


@login_required
def batch_list(request):
    return render(
        request, "batches/list.html", {"batches": selectors.recent_batches(request.user), "endpoints": SUPPORTED_URLS}
    )


@login_required
@require_POST
def upload(request):
    """Upload a JSONL file and start a batch on it in one step."""
    upload_file = request.FILES.get("file")
    if upload_file is None:
        messages.error(request, "Choose a JSONL file to upload.")
        return redirect("batches:list")
    try:
        file = services.upload_file(
            request.user, content=upload_file.read(), filename=upload_file.name, purpose="batch"
        )
        batch = services.create_batch(
            request.user,
            input_file_id=file.public_id,
            endpoint=request.POST.get("endpoint", SUPPORTED_URLS[0]),
            completion_window="24h",
            metadata=_description(request),
        )
    except ServiceError as exc:
        messages.error(request, exc.message)
        return redirect("batches:list")
    return redirect("batches:detail", batch_id=batch.public_id)


def _description(request) -> dict | None:
    text = request.POST.get("description", "").strip()[:512]
    return {"description": text} if text else None


@login_required
def batch_detail(request, batch_id: str):
    batch = _owned_batch(request, batch_id)
    return render(request, "batches/detail.html", {"batch": batch, "data": presenters.batch_object(batch)})


@login_required
@require_POST
def cancel(request, batch_id: str):
    _owned_batch(request, batch_id)
    try:
        services.cancel_batch(request.user, batch_id)
    except ServiceError as exc:
        messages.error(request, exc.message)
    return redirect("batches:detail", batch_id=batch_id)


@login_required
def download(request, file_id: str):
    from .api import file_download

    try:
        return file_download(selectors.get_file(request.user, file_id))
    except NotFound:
        raise Http404("No such file") from None


def _owned_batch(request, batch_id: str):
    try:
        return selectors.get_batch(request.user, batch_id)
    except NotFound:
        raise Http404("No such batch") from None
