"""The Batches page in headless Debian Chromium (Playwright) against the live stack with a real Celery
worker: upload a JSONL file, watch the progress bar fill over the websocket, download the output.
Dev settings, so static files are served. Saves batches*.png (tests/platform/browser_output.py).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tests.platform.browser_output import CHROMIUM, browser_stack_model, headless_chromium, save_screenshot
from tests.platform.live_stack import LiveStack

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not shutil.which(CHROMIUM), reason="Debian chromium is not installed (make browser)"),
]


@pytest.fixture(scope="module")
def stack(tiny_model_dir, tmp_path_factory):
    env = {
        "DJANGO_SETTINGS_MODULE": "tessera.settings.dev",
        "DEBUG": "1",
        "BATCH_MAX_IN_FLIGHT": "4",
        "BATCH_PROGRESS_INTERVAL": "0.2",
    }
    model, model_env = browser_stack_model(tiny_model_dir)
    with LiveStack.start(
        model, tmp_path_factory.mktemp("batches-browser"), env={**env, **model_env}, celery=True
    ) as live:
        live.sql("PRAGMA journal_mode=WAL")
        yield live


@pytest.fixture
def page(stack):
    with headless_chromium() as browser:
        context = browser.new_context(
            base_url=stack.base_url, viewport={"width": 1280, "height": 800}, accept_downloads=True
        )
        page = context.new_page()
        page.set_default_timeout(60_000)
        yield page


def requests_file(stack, tmp_path: Path, n: int) -> Path:
    path = tmp_path / "requests.jsonl"
    path.write_text(
        "".join(
            json.dumps(
                {
                    "custom_id": f"web-{i}",
                    "method": "POST",
                    "url": "/v1/chat/completions",
                    "body": {
                        "model": stack.model_name,
                        "max_tokens": 16,
                        "temperature": 0,
                        "ignore_eos": True,
                        "messages": [{"role": "user", "content": f"Line {i}"}],
                    },
                }
            )
            + "\n"
            for i in range(n)
        )
    )
    return path


def test_upload_watch_progress_and_download_in_a_real_browser(page, stack, tmp_path):
    page.goto("/accounts/login/?next=/batches/")
    page.fill("#id_username", stack.username)
    page.fill("#id_password", stack.password)
    page.click("main button[type=submit]")
    page.wait_for_url("**/batches/")
    page.set_input_files("#id_file", str(requests_file(stack, tmp_path, 24)))
    page.fill("#id_description", "browser test")
    page.click("#upload-form button[type=submit]")
    page.wait_for_url("**/batches/batch_*/")
    # The bar moves while lines finish (pushed over the Channels group), then the page shows the results.
    page.wait_for_function("parseInt(document.getElementById('batch-done').textContent) > 0")
    page.wait_for_selector("#download-output")
    assert page.text_content("#batch-status").startswith("completed")
    assert page.text_content("#batch-done") == "24" and page.text_content("#batch-total") == "24"
    assert page.eval_on_selector("#batch-bar", "el => el.style.width") == "100%"
    assert page.is_hidden("#cancel-form")
    save_screenshot(page, "batches-detail")
    with page.expect_download() as download_info:
        page.click("#download-output")
    rows = [json.loads(line) for line in Path(download_info.value.path()).read_text().splitlines()]
    assert sorted(row["custom_id"] for row in rows) == sorted(f"web-{i}" for i in range(24))
    page.goto("/batches/")
    assert "browser test" in page.text_content("#batch-table")
    save_screenshot(page, "batches")
