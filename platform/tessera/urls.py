from django.contrib import admin
from django.urls import include, path

urlpatterns = [
    path("admin/", admin.site.urls),
    path("", include("openai_api.urls")),
    path("accounts/", include("accounts.urls")),
    path("chat/", include("chat.urls")),
    path("history/", include("chat.history_urls")),
    path("", include("chat.home_urls")),
    path("dashboard/", include("dashboard.urls")),
    path("", include("batches.urls")),
]
