#!/usr/bin/env python
"""Django's command-line utility. platform/ is a source root, not a package (see docs)."""

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent / "platform"))


def main():
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tessera.settings.dev")
    from django.core.management import execute_from_command_line

    execute_from_command_line(sys.argv)


if __name__ == "__main__":
    main()
