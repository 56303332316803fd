from django.conf import settings


def signup(request):
    """Templates show the sign-up links only while sign-up is open."""
    return {"allow_signup": settings.ALLOW_SIGNUP}
