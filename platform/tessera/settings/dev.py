"""Local development and `make run`: the embedded defaults."""

import os

from .base import *  # noqa: F401,F403

DEBUG = os.environ.get("DEBUG", "1") == "1"
