"""`python manage.py create_api_key USERNAME [--name NAME]`: prints the new key alone on its last line."""

from django.contrib.auth import get_user_model
from django.core.management.base import BaseCommand, CommandError

from accounts.services import create_api_key


class Command(BaseCommand):
    help = "Create an API key for a user; the key is printed once, alone on the last line."

    def add_arguments(self, parser):
        parser.add_argument("username")
        parser.add_argument("--name", default="cli")

    def handle(self, *args, username, name, **options):
        user = get_user_model().objects.filter(username=username).first()
        if user is None:
            raise CommandError(f"no user named {username!r}")
        key, raw = create_api_key(user, name=name)
        self.stdout.write(f"created API key {key.prefix}… ({name}) for {username}; it is not shown again:")
        self.stdout.write(raw)
