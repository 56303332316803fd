from django.urls import path

from . import views

app_name = "accounts"

urlpatterns = [
    path("signup/", views.signup, name="signup"),
    path("login/", views.LoginView.as_view(), name="login"),
    path("logout/", views.LogoutView.as_view(), name="logout"),
    path("password/", views.PasswordChangeView.as_view(), name="password_change"),
    path("keys/", views.api_key_list, name="api_keys"),
    path("keys/<int:key_id>/revoke/", views.api_key_revoke, name="api_key_revoke"),
]
