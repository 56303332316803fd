import redis
from django import forms
from django.conf import settings
from django.contrib.admin.forms import AdminAuthenticationForm
from django.contrib.auth import get_user_model
from django.contrib.auth.forms import AuthenticationForm, UserCreationForm

from . import throttle


class SignupForm(UserCreationForm):
    email = forms.EmailField(required=False, help_text="Optional.")

    class Meta(UserCreationForm.Meta):
        model = get_user_model()
        fields = ("username", "email")

    def save(self, commit=True):
        user = super().save(commit=False)
        user.is_active = not settings.SIGNUP_REQUIRES_APPROVAL  # an admin activates it in /admin/
        if commit:
            user.save()
        return user


class ThrottledLogin:
    """Refuses to check passwords after too many recent failures (accounts/throttle.py says whose)."""

    throttle_messages = {
        "throttled": "Too many failed log-in attempts. Try again in %(minutes)s minute(s).",
        "pending": "Your account is waiting for an administrator's approval.",
        "unavailable": "Log-in is unavailable for a moment (attempts cannot be counted); try again shortly.",
    }

    def clean(self):
        username = self.data.get("username", "")
        address = throttle.client_address(self.request)
        try:
            wait = throttle.is_locked(username, address)
        except redis.RedisError:  # attempts cannot be counted: fail closed, with a reason, not a 500
            raise forms.ValidationError(self.throttle_messages["unavailable"], code="unavailable") from None
        if wait:
            raise forms.ValidationError(
                self.throttle_messages["throttled"], code="throttled", params={"minutes": -(-wait // 60)}
            )
        try:
            cleaned = super().clean()
        except forms.ValidationError:
            throttle.record_failure(username, address)
            self._explain_pending(username)
            raise
        throttle.record_success(username, address)
        return cleaned

    def _explain_pending(self, username: str) -> None:
        """The right password for an account not yet approved: say so (only its owner can see this)."""
        user = get_user_model().objects.filter(username=username).first()
        if user is not None and not user.is_active and user.check_password(self.data.get("password", "")):
            raise forms.ValidationError(self.throttle_messages["pending"], code="pending")


class ThrottledLoginForm(ThrottledLogin, AuthenticationForm):
    pass


class ThrottledAdminLoginForm(ThrottledLogin, AdminAuthenticationForm):
    pass


class ApiKeyForm(forms.Form):
    name = forms.CharField(max_length=100, required=False, help_text="A label to recognise the key by.")
    expires_in_days = forms.TypedChoiceField(
        choices=[("", "Never"), ("7", "7 days"), ("30", "30 days"), ("90", "90 days"), ("365", "1 year")],
        coerce=int,
        empty_value=None,
        required=False,
        label="Expires",
    )
