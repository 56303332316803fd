"""Where the browser tests write their screenshots.

A test run writes them to var/test-screenshots/ (git-ignored), so `git status` stays clean after
the tests. Refreshing the README's images in docs/screenshots/ is an explicit step:
`make screenshots` sets TESSERA_SCREENSHOTS to that folder and runs the browser tests.
"""
from __future__ import annotations

import os
from pathlib import Path

REPO_DIR = Path(__file__).resolve().parents[2]
SCREENSHOTS_ENV = "TESSERA_SCREENSHOTS"


def screenshot_dir() -> Path:
    folder = Path(os.environ.get(SCREENSHOTS_ENV) or REPO_DIR / "var" / "test-screenshots")
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def save_screenshot(page, name: str, full_page: bool = False) -> Path:
    path = screenshot_dir() / f"{name}.png"
    page.screenshot(path=str(path), full_page=full_page)
    return path
