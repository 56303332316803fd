"""Account pages: sign up, log in (throttled), log out, password change, API keys."""

from __future__ import annotations

from datetime import timedelta

import redis
from django.conf import settings
from django.contrib import messages
from django.contrib.auth import login
from django.contrib.auth import views as auth_views
from django.contrib.auth.decorators import login_required
from django.http import Http404
from django.shortcuts import redirect, render
from django.urls import reverse, reverse_lazy
from django.utils import timezone
from django.views.decorators.http import require_POST

from . import selectors as key_selectors
from . import services as key_services
from . import throttle
from .forms import ApiKeyForm, SignupForm, ThrottledLoginForm


def signup(request):
    """Open while ALLOW_SIGNUP; SIGNUPS_PER_HOUR_PER_ADDRESS accounts an hour from one address; new
    accounts wait for an admin when SIGNUP_REQUIRES_APPROVAL (inactive: no log-in, no working key)."""
    if not settings.ALLOW_SIGNUP:
        return render(request, "accounts/signup_closed.html", status=403)
    if request.user.is_authenticated:
        return redirect("/")
    form = SignupForm(request.POST or None)
    if request.method == "POST" and form.is_valid():
        address = throttle.client_address(request)
        try:
            wait = throttle.signup_wait(address)
        except redis.RedisError:  # sign-ups cannot be counted: refuse for now rather than unthrottled
            form.add_error(None, "Sign-up is unavailable for a moment; try again shortly.")
            return render(request, "accounts/signup.html", {"form": form}, status=503)
        if wait:
            form.add_error(None, f"Too many new accounts from your address. Try again in {-(-wait // 60)} minute(s).")
            return render(request, "accounts/signup.html", {"form": form}, status=429)
        user = form.save()
        throttle.record_signup(address)
        if not user.is_active:
            messages.info(request, "Your account was created and is waiting for an administrator's approval.")
            return redirect("accounts:login")
        login(request, user, backend="django.contrib.auth.backends.ModelBackend")
        messages.success(request, f"Welcome, {user.get_username()}!")
        return redirect("chat:playground")
    return render(request, "accounts/signup.html", {"form": form})


class LoginView(auth_views.LoginView):
    template_name = "accounts/login.html"
    form_class = ThrottledLoginForm
    redirect_authenticated_user = True


class LogoutView(auth_views.LogoutView):
    next_page = reverse_lazy("accounts:login")


class PasswordChangeView(auth_views.PasswordChangeView):
    template_name = "accounts/password_change.html"
    success_url = reverse_lazy("accounts:password_change")

    def form_valid(self, form):
        messages.success(self.request, "Your password was changed.")
        return super().form_valid(form)


def _api_base(request) -> str:
    return request.build_absolute_uri("/v1")


def _with_status(key):
    key.status = "revoked" if key.is_revoked else "expired" if key.is_expired() else "active"
    return key


@login_required
def api_key_list(request):
    """GET lists the keys; POST creates one and shows its secret in this response only."""
    form = ApiKeyForm(request.POST or None)
    context = {"form": form, "api_base": _api_base(request)}
    if request.method == "POST" and form.is_valid():
        days = form.cleaned_data["expires_in_days"]
        expires_at = timezone.now() + timedelta(days=days) if days else None
        _key, context["new_key"] = key_services.create_api_key(request.user, form.cleaned_data["name"], expires_at)
        context["new_key_name"] = form.cleaned_data["name"]
        context["form"] = ApiKeyForm()
    context["keys"] = [_with_status(key) for key in key_selectors.api_keys_for(request.user)]
    response = render(request, "accounts/api_keys.html", context)
    response["Cache-Control"] = "no-store"  # the page may carry a secret
    return response


@require_POST
@login_required
def api_key_revoke(request, key_id: int):
    key = key_selectors.api_key_for(request.user, key_id)
    if key is None:
        raise Http404("No such key")
    key_services.revoke_api_key(key)
    messages.success(request, "The key was revoked.")
    return redirect(reverse("accounts:api_keys"))
