from django import forms
from django.contrib.auth import get_user_model
from django.contrib.auth.forms import AuthenticationForm, UserCreationForm

from . import throttle


class SignupForm(UserCreationForm):
    email = forms.EmailField(required=False, help_text="Optional.")

    class Meta(UserCreationForm.Meta):
        model = get_user_model()
        fields = ("username", "email")


class ThrottledLoginForm(AuthenticationForm):
    """AuthenticationForm that refuses to check passwords after too many recent failures."""

    error_messages = {
        **AuthenticationForm.error_messages,
        "throttled": "Too many failed log-in attempts. Try again in %(minutes)s minute(s).",
    }

    def clean(self):
        username = self.data.get("username", "")
        address = throttle.client_address(self.request)
        wait = throttle.is_locked(username, address)
        if wait:
            raise forms.ValidationError(self.error_messages["throttled"], code="throttled",
                                        params={"minutes": -(-wait // 60)})
        try:
            cleaned = super().clean()
        except forms.ValidationError:
            throttle.record_failure(username, address)
            raise
        throttle.record_success(username, address)
        return cleaned


class ApiKeyForm(forms.Form):
    name = forms.CharField(max_length=100, required=False, help_text="A label to recognise the key by.")
    expires_in_days = forms.TypedChoiceField(
        choices=[("", "Never"), ("7", "7 days"), ("30", "30 days"), ("90", "90 days"), ("365", "1 year")],
        coerce=int, empty_value=None, required=False, label="Expires")
