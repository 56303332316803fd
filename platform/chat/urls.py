from django.urls import path

from . import views

app_name = "chat"

urlpatterns = [
    path("", views.playground, name="playground"),
    path("c/<uuid:conversation_id>/", views.playground, name="conversation"),
]
