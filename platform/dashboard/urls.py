from django.urls import path

from . import views

app_name = "dashboard"

urlpatterns = [
    path("", views.index, name="index"),
    path("users/<int:user_id>/", views.user_page, name="user"),
    path("api/usage/", views.usage_json, name="usage-json"),
    path("api/users/<int:user_id>/", views.user_json, name="user-json"),
    path("api/engine/", views.engine_json, name="engine-json"),
]
